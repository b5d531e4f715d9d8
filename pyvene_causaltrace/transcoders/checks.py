"""Is this transcoder the right one for this model, and does the model still work through it?

- :func:`check_pairing`: FVU of every layer's output hook from the transcoder fed its input
  hook, mean L0, and two controls that must be far worse (the input one module too early; layer
  ``t``'s reconstruction scored against layer ``t + 1``): :class:`PairingReport`.
- :func:`replacement_anchor`: next-token cross-entropy on held-out text, clean, spliced (from
  the first position and at all), ``b_dec`` only and MLPs zeroed, the share of the clean-to-zero
  gap the splice recovers; answer probability, top-1 and KL on a prompt.

FVU = squared error / squared deviation from each text's mean at that layer (summed over the
texts, then divided), from the first position that is not BOS (BOS is no dictionary's
business). Centring per text leaves out the spread between texts' means, so on 50-token texts it
reads a few hundredths above the FVU centred on one mean over all the texts' tokens, which a
fit's ``train_fvu`` and sae-lens report (``benchmarks/fit_scaling.py`` prints both)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..bound import BoundModel
from ..defaults import BOS
from ..errors import InputError
from ..interventions.clt_splice import clt_splice_representations
from ..interventions.restore import CleanRestore
from ..model_guard import measured
from ..prompts import answer_token_id, first_position
from ..runtime import intervened
from .hooks import hook_states, transcoder_states
from .transcoder import Transcoder, check_fits

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer


def _ids(tokenizer: Tokenizer, text: str, device) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"].to(device)


def _fvu_parts(recon: torch.Tensor, target: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer (squared error, squared deviation) sums over positions >= ``start``: ``[L]``
    each."""
    err = (target - recon)[:, start:].double().pow(2).sum((1, 2))
    t = target[:, start:].double()
    dev = (t - t.mean(1, keepdim=True)).pow(2).sum((1, 2))
    return err, dev


#: FVU from which a transcoder that beats its controls is a poor fit, not a good one: published
#: CLTs score about 0.2 on their own model; 1.0 is no better than each layer's mean.
POOR_FIT_FVU = 0.5
#: At FVU >= 1 a transcoder of another model scores about as badly everywhere: there it counts
#: as paired only at most this fraction of the better control's FVU (a paired CLT: 0.21
#: against 3.3 and 215).
CONTROL_RATIO = 0.5
#: What :attr:`PairingReport.status` may be.
PAIRING_STATUSES = ("paired", "poor_fit", "mispaired")


@dataclass(frozen=True)
class PairingReport:
    """The pairing check's numbers and its verdict, ``status`` (:data:`PAIRING_STATUSES`):
    ``"mispaired"`` when a control fits as well or better (at FVU >= 1: within
    :data:`CONTROL_RATIO`): wrong model, layer or hook; ``"poor_fit"`` when the controls fit worse
    but the FVU, pooled or at the median layer (the layers of largest variance rule the pooled
    one), is :data:`POOR_FIT_FVU` or more; else ``"paired"``. ``from_position``: the first
    position scored."""

    fvu_per_layer: list[float]
    fvu: float
    mean_l0: float
    fvu_wrong_hook: float
    mean_l0_wrong_hook: float
    fvu_wrong_layer: float
    n_tokens: int
    from_position: int = 1
    status: str = field(init=False)

    def __post_init__(self) -> None:
        best = min(self.fvu_wrong_hook, self.fvu_wrong_layer)
        beats = self.fvu < best if self.fvu < 1 else self.fvu < CONTROL_RATIO * best
        fits = max(self.fvu, self.median_layer_fvu) < POOR_FIT_FVU
        status = "mispaired" if not beats else "paired" if fits else "poor_fit"
        object.__setattr__(self, "status", status)

    @property
    def median_layer_fvu(self) -> float:
        """The median of the per-layer FVUs (the pooled :attr:`fvu` weighs each layer by its
        variance)."""
        layers = sorted(self.fvu_per_layer)
        if not layers:
            return self.fvu
        middle = len(layers) // 2
        return layers[middle] if len(layers) % 2 else (layers[middle - 1] + layers[middle]) / 2

    def _layers(self) -> str:
        """The per-layer spread in words: median, worst layer, how many are poor."""
        if len(self.fvu_per_layer) < 2:
            return ""
        worst = max(range(len(self.fvu_per_layer)), key=self.fvu_per_layer.__getitem__)
        poor = sum(f >= POOR_FIT_FVU for f in self.fvu_per_layer)
        return (f"; per layer: median {self.median_layer_fvu:.3f}, worst layer {worst} "
                f"{self.fvu_per_layer[worst]:.3f}, {poor} of {len(self.fvu_per_layer)} at "
                f"{POOR_FIT_FVU} or more")

    @property
    def paired(self) -> bool:
        """The right transcoder for these hooks (a poor fit included): not mispaired."""
        return self.status != "mispaired"

    def _controls(self) -> str:
        return (f"reading the earlier hook {self.fvu_wrong_hook:.3f} (L0 "
                f"{self.mean_l0_wrong_hook:.1f}), scoring against the next layer "
                f"{self.fvu_wrong_layer:.3f}")

    def verdict(self) -> str:
        fit = f"FVU {self.fvu:.3f} pooled (mean L0 {self.mean_l0:.1f}{self._layers()})"
        if self.status == "paired":
            return f"paired: {fit} beats the controls ({self._controls()})"
        if self.status == "poor_fit":
            return (f"paired, poor fit: {fit} — error nodes will carry much of the MLP "
                    "outputs — but it reads its own layer and hook better than the "
                    f"controls ({self._controls()}): the pairing is right, the dictionary is "
                    "weak (fit it longer or wider)")
        which = ("reading the earlier hook" if self.fvu_wrong_hook <= self.fvu_wrong_layer
                 else "scoring against the next layer")
        how = ("as well or better" if min(self.fvu_wrong_hook, self.fvu_wrong_layer) <= self.fvu
               else "nearly as well")
        nothing = (" Every FVU is near or above 1: the transcoder reconstructs nothing here, "
                   "so the controls cannot tell a wrong pairing from no fit at all."
                   if min(self.fvu, self.fvu_wrong_hook, self.fvu_wrong_layer) > 0.9 else "")
        return (f"MISPAIRED: {fit} with the stated hooks, and {which} fits {how} "
                f"({self._controls()}): this transcoder does not reconstruct this model's MLP "
                f"outputs at its stated layers — wrong model, layer or hook.{nothing}")

    def raise_if_mispaired(self) -> None:
        if self.status == "mispaired":
            raise InputError(self.verdict())

    def to_dict(self) -> dict:
        return {**asdict(self), "median_layer_fvu": self.median_layer_fvu,
                "paired": self.paired, "verdict": self.verdict()}


@torch.no_grad()
@measured
def check_pairing(model: nn.Module, tokenizer: Tokenizer, transcoder: Transcoder,
                  texts: Sequence[str], *, bos: str = BOS) -> PairingReport:
    """Pairing check on ``texts`` (see module docstring); ``bos``
    (:data:`~..prompts.BOS_MODES`) says whether position 0 is scored."""
    check_fits(model, transcoder)
    start = first_position(tokenizer, bos)
    device = model.device  # bound by @measured
    # per layer (squared error, squared deviation): the fit, and the earlier-hook control
    totals = {k: torch.zeros(2, transcoder.n_layers, dtype=torch.float64, device=device)
              for k in ("fit", "wrong_hook")}
    wrong_layer = torch.zeros(2, dtype=torch.float64, device=device)
    l0 = l0_pre = 0.0
    n_tokens = 0
    for text in texts:
        states = transcoder_states(model, transcoder, _ids(tokenizer, text, device), control=True)
        acts = transcoder.encode_all(states["input"], zero_bos=start > 0)
        recon = transcoder.reconstruct(acts, states["input"])
        totals["fit"] += torch.stack(_fvu_parts(recon, states["output"], start))
        acts_pre = transcoder.encode_all(states["control"], zero_bos=start > 0)
        totals["wrong_hook"] += torch.stack(_fvu_parts(
            transcoder.reconstruct(acts_pre, states["control"]), states["output"], start))
        err, dev = _fvu_parts(recon[:-1], states["output"][1:], start)
        wrong_layer += torch.stack([err.sum(), dev.sum()])
        n_tokens += acts.shape[1] - start
        l0 += float((acts[:, start:] != 0).sum()) / transcoder.n_layers
        l0_pre += float((acts_pre[:, start:] != 0).sum()) / transcoder.n_layers
    if n_tokens == 0:
        raise InputError("the pairing check's texts hold no token past position 0 (BOS)")
    return PairingReport(
        fvu_per_layer=(totals["fit"][0] / totals["fit"][1]).tolist(),
        fvu=float(totals["fit"][0].sum() / totals["fit"][1].sum()),
        mean_l0=l0 / n_tokens,
        fvu_wrong_hook=float(totals["wrong_hook"][0].sum() / totals["wrong_hook"][1].sum()),
        mean_l0_wrong_hook=l0_pre / n_tokens,
        fvu_wrong_layer=float(wrong_layer[0] / wrong_layer[1]),
        n_tokens=n_tokens,
        from_position=start,
    )


# ---------------------------------------------------------------------- replacement anchor

ANCHOR_CONDITIONS = ("clean", "clt", "clt_all_positions", "b_dec_only", "mlp_zero")


@dataclass(frozen=True)
class AnchorReport:
    """Mean next-token CE (nats per target token) per condition, and the fraction of
    the clean-to-``mlp_zero`` gap the splice recovers; ``prompt`` holds the answer check."""

    ce: dict[str, float]
    gap_recovered: float
    n_tokens: int
    prompt: dict | None = None
    #: the first position the "clt" condition splices (1 when position 0 is BOS)
    from_position: int = 1

    def summary(self) -> str:
        lines = [f"{name:<20} {self.ce[name]:8.3f} nats" for name in ANCHOR_CONDITIONS]
        lines.append(f"fraction of the clean->zero gap recovered: {100 * self.gap_recovered:.1f}%"
                     f" ({self.n_tokens} tokens)")
        if self.prompt:
            p = self.prompt
            lines.append(f"{p['prompt']!r} -> {p['answer']!r}: clean p={p['clean_prob']:.4f}, "
                         f"spliced p={p['clt_prob']:.4f}, spliced top-1 {p['clt_top1']!r}, "
                         f"KL {p['kl']:.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def _condition_representations(name: str, bound: BoundModel, transcoder, n_pos: int,
                               start: int = 1) -> list[dict]:
    if name == "clean":
        return []
    if name == "clt":
        return clt_splice_representations(bound, transcoder, from_position=start)
    if name == "clt_all_positions":
        return clt_splice_representations(bound, transcoder, from_position=0)
    if name == "b_dec_only":
        ablations = [{"clt_layer": layer, "features": "all"}
                     for layer in range(transcoder.n_layers)]
        return clt_splice_representations(bound, transcoder, from_position=start,
                                          ablations=ablations)
    adapter = bound.adapter
    zeros = torch.zeros(1, n_pos, transcoder.cfg.d_model)
    return [{"component": transcoder.cfg.hf_hooks(adapter, layer)["output"],
             "intervention": CleanRestore(positions=list(range(start, n_pos)), states=zeros)}
            for layer in range(transcoder.n_layers)]


def _logits(bound: BoundModel, representations, ids) -> torch.Tensor:
    if not representations:
        return bound.model(input_ids=ids).logits
    with intervened(bound, representations) as spliced:
        return spliced(input_ids=ids).logits


@torch.no_grad()
@measured
def replacement_anchor(model: nn.Module, tokenizer: Tokenizer, transcoder: Transcoder,
                       texts: Sequence[str], *, prompt: str | None = None,
                       answer: str | None = None, bos: str = BOS) -> AnchorReport:
    """The replacement-model anchor (see module docstring); ``bos``
    (:data:`~..prompts.BOS_MODES`) says whether the splice starts at position 0 or 1."""
    bound = model  # bound by @measured: every condition's representations read its sites
    model = bound.model
    check_fits(bound, transcoder)
    start = first_position(tokenizer, bos)
    device = bound.device
    totals = dict.fromkeys(ANCHOR_CONDITIONS, 0.0)
    n_tokens = 0
    for text in texts:
        ids = _ids(tokenizer, text, device)
        for name in ANCHOR_CONDITIONS:
            logits = _logits(bound, _condition_representations(name, bound, transcoder,
                                                               ids.shape[1], start), ids)
            logprobs = logits[0, :-1].double().log_softmax(-1)  # every next-token target counts
            totals[name] -= float(logprobs.gather(1, ids[0, 1:, None]).sum())
        n_tokens += ids.shape[1] - 1
    ce = {name: total / n_tokens for name, total in totals.items()}
    gap = (ce["mlp_zero"] - ce["clt"]) / (ce["mlp_zero"] - ce["clean"])
    report = None
    if prompt is not None:
        ids = _ids(tokenizer, prompt, device)
        clean = model(input_ids=ids).logits[0, -1].double().log_softmax(-1)
        splice = _condition_representations("clt", bound, transcoder, ids.shape[1], start)
        spliced = _logits(bound, splice, ids)[0, -1].double().log_softmax(-1)
        answer_id = (answer_token_id(tokenizer, answer) if answer is not None
                     else int(clean.argmax()))
        report = {"prompt": prompt, "answer": tokenizer.decode([answer_id]),
                  "clean_prob": float(clean[answer_id].exp()),
                  "clt_prob": float(spliced[answer_id].exp()),
                  "clt_top1": tokenizer.decode([int(spliced.argmax())]),
                  "kl": float((clean.exp() * (clean - spliced)).sum())}
    return AnchorReport(ce, gap, n_tokens, report, start)


__all__ = ["ANCHOR_CONDITIONS", "CONTROL_RATIO", "PAIRING_STATUSES", "POOR_FIT_FVU",
           "AnchorReport", "PairingReport", "check_pairing", "hook_states",
           "replacement_anchor", "transcoder_states"]
