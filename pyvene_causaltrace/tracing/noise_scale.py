"""The noise scale: which multiple of sigma corrupts the answer (a sweep over scales).

The noise unit sigma itself (ROME's, the embedding matrix's, or a number) is
:func:`~pyvene_causaltrace.interventions.noise.resolve_sigma`, re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..arguments import checked
from ..bound import BoundModel, bind
from ..finite import NonFiniteError
from ..interventions.noise import (  # noqa: F401 - re-exported
    NoiseAdd,
    resolve_sigma,
    rome_sigma,
    subject_sigma,
)
from ..runtime import intervened
from .settings import TraceSettings

# ------------------------------------------------------------------------ scale sweep

#: A scale collapses the answer when every seed leaves P(answer) below this fraction of the
#: clean probability. An absolute 0.01 would be 1.25% of Qwen3-8B's clean 0.80; on small
#: models the answer keeps a floor of a few percent that no scale removes (SmolLM2's " Paris"
#: after "... is in the city of": 0.02-0.05 at every scale from 2 to 10 sigma), so the
#: criterion is relative: every seed removes at least 95% of the answer's probability.
COLLAPSE_FRACTION = 0.05


@dataclass(frozen=True)
class NoiseScaleSweep:
    """Corrupted P(answer) per scale and seed, and the scale chosen from them.

    ``chosen`` is the smallest scale whose *worst* seed leaves P(answer) below ``threshold``
    (``COLLAPSE_FRACTION`` of the clean probability unless given). Judge a scale by its worst
    seed: one seed that barely corrupts has a recovery denominator near zero and dominates any
    average. ``None`` when no scale collapses every seed.
    """

    scales: list[float]
    seeds: list[int]
    clean_prob: float
    corrupt_probs: list[list[float]]  # [scale][seed]
    threshold: float
    sigma: float
    sigma_method: str

    @property
    def worst(self) -> list[float]:
        return [max(row) for row in self.corrupt_probs]

    @property
    def mean(self) -> list[float]:
        return [sum(row) / len(row) for row in self.corrupt_probs]

    @property
    def chosen(self) -> float | None:
        return min((s for s, w in zip(self.scales, self.worst, strict=True)
                    if w < self.threshold), default=None)

    def reason(self) -> str:
        if self.chosen is None:
            return (f"no scale up to {max(self.scales):g} sigma brings every seed below "
                    f"{self.threshold:.4f} (worst seeds: "
                    + ", ".join(f"{s:g}: {w:.4f}" for s, w in zip(self.scales, self.worst,
                                                                    strict=True)) + ")")
        index = self.scales.index(self.chosen)
        below = [f"{s:g} sigma worst {w:.4f}" for s, w in
                 zip(self.scales, self.worst, strict=True) if s < self.chosen]
        return (f"{self.chosen:g} sigma: worst seed {self.worst[index]:.4f} < {self.threshold:.4f}"
                f" (clean {self.clean_prob:.4f})" + (f"; smaller scales fail: {', '.join(below)}"
                                                     if below else ""))

    def to_dataframe(self):
        import pandas as pd  # pandas loads only when a table is asked for

        return pd.DataFrame([
            {"scale": scale, "seed": seed, "corrupt_prob": p}
            for scale, row in zip(self.scales, self.corrupt_probs, strict=True)
            for seed, p in zip(self.seeds, row, strict=True)
        ])

    def summary(self) -> str:
        lines = [f"clean P = {self.clean_prob:.4f}; sigma_{self.sigma_method} = {self.sigma:.4f}",
                 f"{'scale':>6} {'mean':>8} {'worst':>8}"]
        lines += [f"{s:>6g} {m:>8.4f} {w:>8.4f}"
                  for s, m, w in zip(self.scales, self.mean, self.worst, strict=True)]
        lines.append(f"chosen: {self.reason()}")
        return "\n".join(lines)


@checked
@torch.no_grad()
def sweep_noise_scale(
    model: nn.Module | BoundModel,
    input_ids: torch.Tensor,
    noise_positions: Sequence[int],
    answer_id: int,
    seeds: Sequence[int],
    sigma: float,
    *,
    sigma_method: str = "given",
    scales: Sequence[float] = TraceSettings.scales,
    threshold: float | None = None,
    distribution: str = TraceSettings.distribution,
) -> NoiseScaleSweep:
    """Corrupted P(answer) for every scale and seed (one forward of ``len(seeds)`` rows per
    scale). ``threshold`` defaults to ``COLLAPSE_FRACTION`` x the clean probability."""
    bound = bind(model)
    model = bound.model
    ids = input_ids.to(bound.device)
    clean = float(model(input_ids=ids, logits_to_keep=1).logits[0, -1].double()
                  .softmax(-1)[answer_id])
    if not math.isfinite(clean):
        raise NonFiniteError("the clean run's probabilities hold NaN/inf: no noise scale can be "
                             "chosen against them")
    embed = bound.site("embed")
    rows, scales = [], sorted(scales)  # "the smallest scale that collapses": in any order given
    for scale in scales:
        noise = NoiseAdd(seeds=list(seeds), positions=list(noise_positions), scale=scale,
                         sigma=sigma, distribution=distribution)
        with intervened(bound, [{"component": embed, "intervention": noise}]):
            logits = model(input_ids=ids.repeat(len(seeds), 1), logits_to_keep=1)
        rows.append(logits.logits[:, -1].double().softmax(-1)[:, answer_id].tolist())
    if threshold is None:
        threshold = COLLAPSE_FRACTION * clean
    return NoiseScaleSweep(list(map(float, scales)), list(seeds), clean, rows, threshold, sigma,
                           sigma_method)
