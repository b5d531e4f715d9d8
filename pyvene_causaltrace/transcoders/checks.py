"""Is this transcoder the right one for this model, and does the model still work through it?

- :func:`check_pairing`: FVU of every layer's output hook from the transcoder
  fed its input hook, mean L0, and two controls that must be worse — encoding the same kind of
  state one module too early (``hook_resid_pre`` for ``hook_resid_mid``, the attention norm's
  output for the MLP norm's) and scoring layer ``t``'s reconstruction against layer ``t + 1``.
  A verdict in words; :meth:`PairingReport.raise_if_mispaired` stops a pipeline before it uses a
  wrong transcoder.
- :func:`replacement_anchor`: next-token cross-entropy on held-out text (every
  target token) for the clean model, the transcoder spliced from position 1,
  spliced at all positions, ``b_dec`` only (every feature off; a skip path stays), and MLPs
  zeroed; the fraction of the clean-to-zero gap the splice recovers; answer probability, top-1 and
  KL on a prompt.

FVU = sum of squared errors / sum of squared deviations from each layer's mean over positions,
positions >= 1 only (BOS is no dictionary's business).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import InputError
from ..interventions.clt_splice import clt_splice_representations
from ..interventions.restore import CleanRestore
from ..model_guard import measured
from ..models import get_adapter
from ..prompts import answer_token_id
from ..pyvene_compat import intervenable_model_class
from .hooks import hook_states, transcoder_states
from .transcoder import Transcoder, check_fits

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer


def _ids(tokenizer: Tokenizer, text: str, device) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"].to(device)


def _fvu_parts(recon: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer (squared error, squared deviation) sums over positions >= 1: ``[L]`` each."""
    err = (target - recon)[:, 1:].double().pow(2).sum((1, 2))
    t = target[:, 1:].double()
    dev = (t - t.mean(1, keepdim=True)).pow(2).sum((1, 2))
    return err, dev


@dataclass(frozen=True)
class PairingReport:
    fvu_per_layer: list[float]
    fvu: float
    mean_l0: float
    fvu_wrong_hook: float
    mean_l0_wrong_hook: float
    fvu_wrong_layer: float
    n_tokens: int

    @property
    def paired(self) -> bool:
        return self.fvu < 1.0 and self.fvu < min(self.fvu_wrong_hook, self.fvu_wrong_layer)

    def verdict(self) -> str:
        if self.paired:
            return (f"paired: FVU {self.fvu:.3f} (mean L0 {self.mean_l0:.1f}) beats reading "
                    f"the earlier hook ({self.fvu_wrong_hook:.3f}, L0 "
                    f"{self.mean_l0_wrong_hook:.1f}) and scoring against the next layer "
                    f"({self.fvu_wrong_layer:.3f})")
        return (f"MISPAIRED: FVU {self.fvu:.3f} with the stated hooks (controls: earlier hook "
                f"{self.fvu_wrong_hook:.3f}, next layer {self.fvu_wrong_layer:.3f}); this "
                "transcoder does not reconstruct this model's MLP outputs — wrong model, layer "
                "or hook")

    def raise_if_mispaired(self) -> None:
        if not self.paired:
            raise InputError(self.verdict())

    def to_dict(self) -> dict:
        return {**asdict(self), "paired": self.paired, "verdict": self.verdict()}


@torch.no_grad()
@measured
def check_pairing(clt: Transcoder, model: nn.Module, tokenizer: Tokenizer,
                  texts: Sequence[str]) -> PairingReport:
    """Pairing check on ``texts`` (see module docstring)."""
    check_fits(clt, model)
    device = next(model.parameters()).device
    totals = {k: torch.zeros(clt.n_layers, dtype=torch.float64)
              for k in ("err", "dev", "err_pre", "dev_pre")}
    wrong_layer = torch.zeros(2, dtype=torch.float64)
    l0 = l0_pre = 0.0
    n_tokens = 0
    for text in texts:
        states = transcoder_states(clt, model, _ids(tokenizer, text, device), control=True)
        acts = clt.encode_all(states["input"])
        recon = clt.reconstruct(acts, states["input"])
        err, dev = _fvu_parts(recon, states["output"])
        totals["err"] += err
        totals["dev"] += dev
        acts_pre = clt.encode_all(states["control"])
        err, dev = _fvu_parts(clt.reconstruct(acts_pre, states["control"]), states["output"])
        totals["err_pre"] += err
        totals["dev_pre"] += dev
        err, dev = _fvu_parts(recon[:-1], states["output"][1:])
        wrong_layer += torch.stack([err.sum(), dev.sum()])
        n = acts.shape[1] - 1
        n_tokens += n
        l0 += float((acts[:, 1:] != 0).sum()) / clt.n_layers
        l0_pre += float((acts_pre[:, 1:] != 0).sum()) / clt.n_layers
    return PairingReport(
        fvu_per_layer=(totals["err"] / totals["dev"]).tolist(),
        fvu=float(totals["err"].sum() / totals["dev"].sum()),
        mean_l0=l0 / n_tokens,
        fvu_wrong_hook=float(totals["err_pre"].sum() / totals["dev_pre"].sum()),
        mean_l0_wrong_hook=l0_pre / n_tokens,
        fvu_wrong_layer=float(wrong_layer[0] / wrong_layer[1]),
        n_tokens=n_tokens,
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


def _condition_representations(name: str, clt, model, n_pos: int) -> list[dict]:
    if name == "clean":
        return []
    if name == "clt":
        return clt_splice_representations(clt, model)
    if name == "clt_all_positions":
        return clt_splice_representations(clt, model, from_position=0)
    if name == "b_dec_only":
        ablations = [{"clt_layer": layer, "features": "all"} for layer in range(clt.n_layers)]
        return clt_splice_representations(clt, model, ablations=ablations)
    adapter = get_adapter(model)
    zeros = torch.zeros(1, n_pos, clt.cfg.d_model)
    return [{"component": clt.cfg.hf_hooks(adapter, layer)["output"],
             "intervention": CleanRestore(positions=list(range(1, n_pos)), states=zeros)}
            for layer in range(clt.n_layers)]


def _logits(model, representations, ids) -> torch.Tensor:
    if not representations:
        return model(input_ids=ids).logits
    return intervenable_model_class()(representations, model)(base={"input_ids": ids})[1].logits


def _next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    logprobs = logits[0, :-1].double().log_softmax(-1)  # every next-token target counts
    targets = ids[0, 1:]
    return float(-logprobs.gather(1, targets[:, None]).sum()), int(targets.numel())


@torch.no_grad()
@measured
def replacement_anchor(clt: Transcoder, model: nn.Module, tokenizer: Tokenizer,
                       texts: Sequence[str], *, prompt: str | None = None,
                       answer: str | None = None) -> AnchorReport:
    """The replacement-model anchor (see module docstring)."""
    check_fits(clt, model)
    device = next(model.parameters()).device
    totals = dict.fromkeys(ANCHOR_CONDITIONS, 0.0)
    n_tokens = 0
    for text in texts:
        ids = _ids(tokenizer, text, device)
        for name in ANCHOR_CONDITIONS:
            ce, n = _next_token_ce(
                _logits(model, _condition_representations(name, clt, model, ids.shape[1]), ids),
                ids)
            totals[name] += ce
        n_tokens += n
    ce = {name: total / n_tokens for name, total in totals.items()}
    gap = (ce["mlp_zero"] - ce["clt"]) / (ce["mlp_zero"] - ce["clean"])
    report = None
    if prompt is not None:
        ids = _ids(tokenizer, prompt, device)
        clean = model(input_ids=ids).logits[0, -1].double().log_softmax(-1)
        spliced = _logits(model, _condition_representations("clt", clt, model, ids.shape[1]),
                          ids)[0, -1].double().log_softmax(-1)
        answer_id = (answer_token_id(tokenizer, answer) if answer is not None
                     else int(clean.argmax()))
        report = {"prompt": prompt, "answer": tokenizer.decode([answer_id]),
                  "clean_prob": float(clean[answer_id].exp()),
                  "clt_prob": float(spliced[answer_id].exp()),
                  "clt_top1": tokenizer.decode([int(spliced.argmax())]),
                  "kl": float((clean.exp() * (clean - spliced)).sum())}
    return AnchorReport(ce, gap, n_tokens, report)


__all__ = ["ANCHOR_CONDITIONS", "AnchorReport", "PairingReport", "check_pairing", "hook_states",
           "replacement_anchor", "transcoder_states"]
