"""``noise_add``: seeded noise added at chosen positions, one seed per batch row.

The noise recipe (DESIGN.md) makes a JSON spec reproduce the same corruption anywhere: for seed
``s`` and ``n`` noised positions, ``torch.randn((n, hidden), generator=torch.Generator("cpu")
.manual_seed(s), dtype=torch.float32) * scale * sigma`` (``uniform``: ``rand * 2 - 1`` in place of
``randn``), added to the chosen positions in order.

    noise = NoiseAdd(seeds=[0, 1, 2], positions=[1, 2, 3], scale=3.0, sigma=0.046)
    pv_model = IntervenableModel([{"component": "model.embed_tokens.output",
                                   "intervention": noise}], model)
    _, out = pv_model(base=inputs3)          # row r carries seed r's draw
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..defaults import NOISE_SCALE
from .base import CausalTraceIntervention, fit_mask, positions_to_mask, rows_for

DISTRIBUTIONS = ("gaussian", "uniform")


def noise_recipe(
    seed: int, n_tokens: int, hidden: int, scale: float, sigma: float,
    distribution: str = "gaussian",
) -> torch.Tensor:
    """The ``[n_tokens, hidden]`` float32 noise for one seed (see module docstring)."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    if distribution == "gaussian":
        draw = torch.randn((n_tokens, hidden), generator=generator, dtype=torch.float32)
    elif distribution == "uniform":
        draw = torch.rand((n_tokens, hidden), generator=generator, dtype=torch.float32) * 2 - 1
    else:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return draw * scale * sigma


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    """Seeds as distinct integers: a count ``n`` is ``0..n-1``; a list is kept in order."""
    if isinstance(seeds, int):
        if seeds <= 0:
            raise ValueError(f"seeds must be a positive count or a non-empty list, got {seeds}")
        return list(range(seeds))
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds must be a positive count or a non-empty list")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds repeat: {seeds}")
    return seeds


class NoiseAdd(CausalTraceIntervention):
    """Add :func:`noise_recipe` noise; row ``r`` uses ``seeds[r]`` at its own positions.

    Args:
        seeds: one seed, or one per batch row.
        positions: the noised positions — one list for every row, a list per row, or a
            ``[rows, seq]`` bool mask. Negative positions count from the end.
        scale: noise size in units of ``sigma``.
        sigma: the noise unit (ROME: std of the subject's input embeddings).
        distribution: ``"gaussian"`` or ``"uniform"``.
        offset: the absolute position of the component's first position, when the positions
            before it come from a KV cache; ``positions`` stay absolute and a row's draw is the
            same as without the cache (its rows for positions before ``offset`` are skipped).
    """

    registered_name = "noise_add"
    tensor_fields = ("seeds", "positions")

    def __init__(
        self,
        seeds: int | Sequence[int] | torch.Tensor | None = None,
        positions: Any = None,
        scale: float = NOISE_SCALE,
        sigma: float = 1.0,
        distribution: str = "gaussian",
        offset: int = 0,
        **pyvene_kwargs: Any,
    ) -> None:
        own = {} if seeds is None else dict(
            seeds=seeds, positions=positions, scale=scale, sigma=sigma, distribution=distribution,
            offset=offset,
        )
        super().__init__(**own, **pyvene_kwargs)

    def _setup(self, seeds, positions, scale=NOISE_SCALE, sigma=1.0, distribution="gaussian",
               offset=0) -> None:
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if positions is None:
            raise ValueError("noise_add needs positions")
        seeds = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1)
        if seeds.numel() == 0:
            raise ValueError("noise_add needs at least one seed")
        self._set_tensor("seeds", seeds)
        self._set_tensor("positions", positions_to_mask(positions))
        self._config = {"scale": float(scale), "sigma": float(sigma),
                        "distribution": distribution, "offset": int(offset)}
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def noise(self, batch: int, seq_len: int, hidden: int) -> torch.Tensor:
        """The ``[batch, seq_len, hidden]`` float32 tensor this intervention adds."""
        rows_for(batch, self.seeds.numel(), "seeds")
        offset = self._config["offset"]
        mask = fit_mask(self.positions.cpu(), batch, offset + seq_len)
        delta = torch.zeros(batch, seq_len, hidden, dtype=torch.float32)
        draws: dict[tuple[int, int], torch.Tensor] = {}  # rows often share a seed
        for row in range(batch):
            seed = int(self.seeds[row if self.seeds.numel() > 1 else 0])
            where = mask[row].nonzero().squeeze(-1)
            key = (seed, where.numel())
            if key not in draws:
                draws[key] = noise_recipe(seed, where.numel(), hidden, self._config["scale"],
                                          self._config["sigma"], self._config["distribution"])
            kept = where >= offset
            delta[row, where[kept] - offset] = draws[key][kept]
        return delta

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        key = (tuple(base.shape), base.dtype, base.device)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.noise(*base.shape).to(base.device, base.dtype))
        return base + self._cache[1]
