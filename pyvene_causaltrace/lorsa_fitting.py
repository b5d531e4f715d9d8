"""Lorsas for a few of a model's attention layers (``fit-lorsa``, and
``examples/fit_smollm2_lorsa.py``): text, :func:`~.transcoders.lorsa_fit.fit_lorsa` on it, the
held-out FVU, and the set saved in llamascopium's layout, one ``L<layer>`` directory each.

    report = fit_lorsa_set(LorsaFitSettings(layers=(2, 5, 8)))   # .../lorsas/smollm2-135m-lorsa-k32
    lorsa = load_lorsa(report.path)

Text: the model's own (:func:`~.fit_text.generate_ids`, the first transcoder's starts, sampled;
offline) or a file (one text per line, or facts), each cut to ``length`` tokens; a tenth as
many more texts (4 to 32) are held out for the FVU. The directory is written as ``fit`` writes
a transcoder's (:mod:`.fit_output`): ``fit.json`` records the settings and the model's
fingerprint; the same settings reuse it, others are refused unless ``refit``; a folder fit did
not write is refused. The quality caveat is the fit's: QK held at the model's heads, the OV
side trained briefly (docs/attribution.md, "Attention features beside head loadings").
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .arguments import checked
from .bound import BoundModel
from .errors import InputError
from .fingerprint import model_fingerprint
from .fit_output import fit_output
from .fit_text import generate_ids
from .fitting import _data_identity, check_fit_fields, read_texts
from .model_guard import measured
from .models import OFFLINE_DEFAULT, cache_dir, load_model, model_name
from .transcoders.lorsa import LorsaSet, load_lorsa, save_lorsa
from .transcoders.lorsa_fit import fit_lorsa

#: The largest value each size setting takes (a typo's extra zeros refused at once).
LIMITS = {"top_k": 2**20, "steps": 10**7, "texts": 10**7, "batch": 2**16, "length": 8192}


@dataclass(frozen=True)
class LorsaFitSettings:
    """What a Lorsa set is fitted with (``fit.json`` records them); refused when built."""

    layers: tuple[int, ...]
    model: str = OFFLINE_DEFAULT
    top_k: int = 32  # OV heads kept per position
    per_qk_head: int | None = None  # OV heads per QK head (default 2 x head_dim: exact start)
    steps: int = 200
    lr: float = 1e-3
    batch: int = 8
    length: int = 64  # tokens per text (shorter texts are skipped)
    texts: int = 256  # training texts; a tenth as many more (4 to 32) are held out
    data: str = "self"  # "self" (text the model generates), "known_1000", or a file
    seed: int = 0

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, int | str) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers) \
                or not layers:
            raise InputError(f"layers must be one or more layer numbers >= 0, got {layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(set(layers))))
        check_fit_fields(self, LIMITS)
        per = self.per_qk_head
        if per is not None and (isinstance(per, bool) or not isinstance(per, int) or per < 1):
            raise InputError(f"per_qk_head must be an integer >= 1, got {per!r}")

    @property
    def held_out(self) -> int:
        return min(32, max(4, self.texts // 10))


@dataclass(frozen=True)
class LorsaFitReport:
    """A fitted (or reused) Lorsa set: where, and what ``fit.json`` records."""

    path: Path
    reused: bool
    record: dict = field(default_factory=dict)

    def summary(self) -> str:
        s, fit = self.record["settings"], self.record["fit"]
        fvu = ", ".join(f"L{layer} {fit['fvu_start'][layer]:.3f} -> {value:.3f}"
                        for layer, value in fit["fvu"].items())
        how = "reused" if self.reused else f"fitted in {self.record['seconds']:.0f} s"
        return (f"{self.path}: Lorsa at layers {', '.join(map(str, s['layers']))}, "
                f"{fit['n_ov_heads']} OV heads, top {s['top_k']} a position, on "
                f"{fit['n_texts']} texts of {s['length']} tokens; held-out FVU of the attention "
                f"output (start -> fitted): {fvu}; {how}")


def lorsa_dir(settings: LorsaFitSettings) -> Path:
    """Where :func:`fit_lorsa_set` writes by default:
    ``cache_dir()/lorsas/<model>-lorsa-k<top_k>`` (``<model>`` as the transcoders' names)."""
    model = settings.model
    name = model if model == OFFLINE_DEFAULT else "--".join(Path(model).expanduser().parts[-2:])
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "model"
    return cache_dir() / "lorsas" / f"{slug}-lorsa-k{settings.top_k}"


def lorsa_texts(bound, tokenizer, settings: LorsaFitSettings) -> tuple[list[str], list[str]]:
    """``(training texts, held-out texts)`` (module docstring)."""
    n = settings.texts + settings.held_out
    if settings.data == "self":
        ids, _, _ = generate_ids(bound, tokenizer, n, settings.length, seed=settings.seed)
        texts = [tokenizer.decode(one) for one in ids]
    else:
        texts = read_texts(settings.data, n)
        if len(texts) < 2 * 2:
            raise InputError(f"{settings.data} holds {len(texts)} texts; a Lorsa fit needs at "
                             "least 2 to train on and 2 to hold out")
    held = min(settings.held_out, len(texts) // 2)
    return texts[:len(texts) - held], texts[len(texts) - held:]


@measured
def _fit(model: BoundModel, tokenizer, settings: LorsaFitSettings) -> tuple[LorsaSet, dict, int]:
    """Text, the fit, and the number of held-out texts, on the bound model (eval mode)."""
    beyond = [layer for layer in settings.layers if layer >= model.n_layers]
    if beyond:
        raise InputError(f"layers {beyond}: the model has {model.n_layers} layers "
                         f"(0..{model.n_layers - 1})")
    # the seed reaches the model's device's generator too: its state is put back after as well
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(settings.seed)
        texts, held = lorsa_texts(model, tokenizer, settings)
        lorsa, fit = fit_lorsa(model, tokenizer, texts, layers=list(settings.layers),
                               held_out=held, top_k=settings.top_k,
                               per_qk_head=settings.per_qk_head, steps=settings.steps,
                               lr=settings.lr, batch=settings.batch, length=settings.length,
                               seed=settings.seed)
    return lorsa, fit, len(held)


@checked
def fit_lorsa_set(settings: LorsaFitSettings, *, out: str | Path | None = None,
                  refit: bool = False, model=None, tokenizer=None,
                  device: str | torch.device | None = None) -> LorsaFitReport:
    """Fit a Lorsa at each of ``settings.layers`` and save the set in ``out`` (default
    :func:`lorsa_dir`), or reuse the one there fitted with the same settings (module
    docstring). ``model``/``tokenizer``: an already loaded model, fitted on its device (else
    ``settings.model`` is loaded on ``device``, default the CPU); the whole fit runs on the
    model's device, the set is saved from there."""
    if model is not None and device is not None:
        raise InputError("device= is where fit_lorsa_set loads settings.model; a loaded model "
                         "is fitted on its own device (move it there first)")
    path = Path(out).expanduser() if out is not None else lorsa_dir(settings)
    with fit_output(path) as output:
        record = None if refit else output.record()
        if model is None:
            model, tokenizer = load_model(settings.model, device=device or "cpu")
        plain = model.model if isinstance(model, BoundModel) else model
        asked = dict(asdict(settings), layers=list(settings.layers),
                     data=_data_identity(settings.data),
                     model_fingerprint=model_fingerprint(plain))
        if record is not None:
            output.refuse_other_settings(record, asked, "a Lorsa fit")
            return LorsaFitReport(path, True, record)
        start = time.perf_counter()
        lorsa, fit, n_held = _fit(model, tokenizer, settings)
        record = {"settings": asked, "fit": fit, "held_out": n_held,
                  "seconds": round(time.perf_counter() - start, 1)}
        name = model_name(plain) or None

        def write(tmp: Path) -> None:
            for layer, one in lorsa.layers.items():
                save_lorsa(one, tmp / f"L{layer}", model_name=name)
            load_lorsa(tmp)  # what was written reads back

        output.commit(write, record)
    return LorsaFitReport(path, False, record)


__all__ = ["LorsaFitReport", "LorsaFitSettings", "fit_lorsa_set", "lorsa_dir", "lorsa_texts"]
