"""``noise_add``: seeded noise added at chosen positions, one seed per batch row.

The recipe (docs/specs.md) makes a JSON spec reproduce the same corruption anywhere: for seed
``s`` and ``n`` noised positions, ``torch.randn((n, hidden), generator=torch.Generator("cpu")
.manual_seed(s), dtype=torch.float32) * scale * sigma`` (``uniform``: ``rand * 2 - 1`` in place of
``randn``), added to the chosen positions in order.

    noise = NoiseAdd(seeds=[0, 1, 2], positions=[1, 2, 3], scale=3.0, sigma=0.046)
    pv_model = IntervenableModel([{"component": "model.embed_tokens.output",
                                   "intervention": noise}], model)
    _, out = pv_model(base=inputs3)          # row r carries seed r's draw

The noise unit sigma: ROME's (the default) is the standard deviation of the input-embedding
outputs of the subject strings tokenized alone, the spread of the embeddings a subject uses;
the embedding matrix's is an option, and can differ enough that 3 sigma of it fails to corrupt
some models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..bound import BoundModel, bind
from ..defaults import DISTRIBUTION, NOISE_SCALE, SIGMA
from ..errors import InputError, SpecError
from ..finite import NonFiniteError, positive_number
from .base import (
    CausalTraceIntervention,
    as_positions_last,
    fit_mask,
    positions_to_mask,
    rows_for,
    subspace_mask,
)
from .spec_entry import Site, SpecContext

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

DISTRIBUTIONS = ("gaussian", "uniform")


def noise_recipe(
    seed: int, n_tokens: int, hidden: int, scale: float, sigma: float,
    distribution: str = DISTRIBUTION,
) -> torch.Tensor:
    """The ``[n_tokens, hidden]`` float32 noise for one seed (see module docstring)."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    if distribution == "gaussian":
        draw = torch.randn((n_tokens, hidden), generator=generator, dtype=torch.float32)
    elif distribution == "uniform":
        draw = torch.rand((n_tokens, hidden), generator=generator, dtype=torch.float32) * 2 - 1
    else:
        raise InputError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return draw * scale * sigma


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    """Seeds as distinct integers: a count ``n`` is ``0..n-1``; a list is kept in order."""
    if isinstance(seeds, int):
        if seeds <= 0:
            raise InputError(f"seeds must be a positive count or a non-empty list, got {seeds}")
        return list(range(seeds))
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise InputError("seeds must be a positive count or a non-empty list")
    if len(set(seeds)) != len(seeds):
        raise InputError(f"seeds repeat: {seeds}")
    return seeds


SIGMA_METHODS = ("rome", "embedding_matrix")


def check_sigma(sigma: object) -> str | float:
    """``sigma`` as given if it names a noise unit: one of :data:`SIGMA_METHODS` or a finite
    positive number (then as a float); else :class:`~..errors.InputError`."""
    if isinstance(sigma, int | float) and not isinstance(sigma, bool):
        return positive_number(sigma, "sigma")
    if sigma not in SIGMA_METHODS:
        raise InputError(f"sigma must be a number or one of {SIGMA_METHODS}, got {sigma!r}")
    return sigma


def rome_sigma(model: nn.Module | BoundModel, tokenizer: Tokenizer,
               subjects: Sequence[str]) -> float:
    """Std of the input-embedding outputs of ``subjects`` tokenized alone (an entry point:
    it binds the model; below it, :func:`subject_sigma` takes the bound one)."""
    return subject_sigma(bind(model), tokenizer, subjects)


@torch.no_grad()
def subject_sigma(bound: BoundModel, tokenizer: Tokenizer, subjects: Sequence[str]) -> float:
    """:func:`rome_sigma` of a bound model."""
    embed, device = bound.module("embed"), bound.device
    outputs = []
    for subject in subjects:
        ids = tokenizer(subject, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.numel() == 0:
            raise InputError(f"subject {subject!r} tokenizes to nothing")
        outputs.append(embed(ids.to(device)).float().reshape(-1))
    sigma = float(torch.cat(outputs).std())
    if not math.isfinite(sigma) or sigma <= 0:
        raise NonFiniteError(f"ROME's sigma over {list(subjects)[:3]} is {sigma}: the input "
                             "embeddings of the subject hold NaN/inf or are constant")
    return sigma


def resolve_sigma(sigma: str | float, bound: BoundModel, tokenizer: Tokenizer,
                  subject: str | None) -> tuple[str, float]:
    """``(method, value)`` for ``sigma`` given as ``"rome"``, ``"embedding_matrix"`` or a
    positive number (method ``"given"``)."""
    sigma = check_sigma(sigma)
    if isinstance(sigma, float):
        return "given", sigma
    if sigma == "rome":
        if subject is None:
            raise InputError("sigma 'rome' needs a subject")
        return "rome", subject_sigma(bound, tokenizer, [subject])
    return "embedding_matrix", matrix_sigma(bound)


@torch.no_grad()
def matrix_sigma(bound: BoundModel) -> float:
    """The std of the input-embedding weight matrix, in the units of the embedding's outputs
    (the noise is added to them): times the scale a scaled embedding applies (Gemma's
    ``sqrt(hidden)``: in weight units, 3 sigma was 3/48 of that on Gemma-2-2B)."""
    embed = bound.module("embed")
    weight = embed.weight
    rows = torch.arange(min(256, weight.shape[0]), device=weight.device)
    scale = embed(rows).float().norm() / weight[rows].float().norm()
    sigma = float(weight.float().std() * scale)
    if not math.isfinite(sigma) or sigma <= 0:
        raise NonFiniteError(f"the embedding matrix's sigma is {sigma}: its weights hold NaN/inf "
                             "or its first rows are zero")
    return sigma


class NoiseAdd(CausalTraceIntervention):
    """Add :func:`noise_recipe` noise; row ``r`` uses ``seeds[r]`` at its own positions.

    Args:
        seeds: one seed, or one per batch row (default 0).
        positions: the noised positions — one list for every row, a list per row, or a
            ``[rows, seq]`` bool mask. Negative positions count from the end. None (default):
            every position it is handed, e.g. those pyvene's ``unit_locations`` choose.
        scale: noise size in units of ``sigma``.
        sigma: the noise unit (ROME: std of the subject's input embeddings; default 1).
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
        scale: float | None = None,
        sigma: float | None = None,
        distribution: str | None = None,
        offset: int | None = None,
        **pyvene_kwargs: Any,
    ) -> None:
        super().__init__(seeds=seeds, positions=positions, scale=scale, sigma=sigma,
                         distribution=distribution, offset=offset, **pyvene_kwargs)

    def _setup(self, seeds=0, positions=None, scale=NOISE_SCALE, sigma=1.0,
               distribution=DISTRIBUTION, offset=0) -> None:
        if distribution not in DISTRIBUTIONS:
            raise InputError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        scale, sigma = positive_number(scale, "scale"), positive_number(sigma, "sigma")
        seeds = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1)
        if seeds.numel() == 0:
            raise InputError("noise_add needs at least one seed")
        self._set_tensor("seeds", seeds)
        self._set_tensor("positions", positions_to_mask(positions))
        self._config = {"scale": float(scale), "sigma": float(sigma),
                        "distribution": distribution, "offset": int(offset)}
        self._cache: tuple[tuple, torch.Tensor] | None = None

    handles_units = True

    def noise(self, batch: int, seq_len: int, hidden: int,
              offset: int | None = None) -> torch.Tensor:
        """The ``[batch, seq_len, hidden]`` float32 tensor this intervention adds to a
        sequence whose first position is ``offset`` (default: the configured one)."""
        rows_for(batch, self.seeds.numel(), "seeds")
        offset = self._config["offset"] if offset is None else offset
        mask = fit_mask(None if self.positions is None else self.positions.cpu(), batch,
                        offset + seq_len)
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

    def retarget(self, by_seed: torch.Tensor, seed_rows: torch.Tensor, offset: int = 0) -> None:
        """Point this instance at another batch, drawing nothing: row ``r`` of the next
        forwards takes seed ``seed_rows[r]``'s noise from position ``offset`` on. ``by_seed`` is
        :meth:`noise` of one row per seed over the whole sequence (``[n_seeds, seq, hidden]``,
        made once, on the device and in the dtype of the values it is added to). The trace
        engine calls this once per chunk of rows."""
        noise = by_seed.index_select(0, seed_rows)[:, offset:]
        self._config["offset"] = int(offset)
        self._cache = ((tuple(noise.shape), noise.dtype, noise.device, int(offset)), noise)

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        """``base`` plus the noise. Head units (``[batch, heads, seq, d_head]``) take the draw
        of their heads' concatenation; ``subspaces`` keep it to those dimensions."""
        flat, back = as_positions_last(base)
        batch, seq_len, hidden = flat.shape
        offset, _ = self._placement(seq_len, self._config["offset"])
        key = (tuple(base.shape), base.dtype, base.device, offset)
        if self._cache is None or self._cache[0] != key:
            noise = back(self.noise(batch, seq_len, hidden, offset))
            self._cache = (key, noise.to(base.device, base.dtype))
        dims = subspace_mask(subspaces, base, self.subspace_partition)
        if dims is None:
            return base + self._cache[1]
        return torch.where(dims, base + self._cache[1], base)

    # -- spec entry ----------------------------------------------------------------------
    spec_unique = True
    spec_corrupts = True

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "required": ["seeds"], "properties": {
            "type": True,
            "positions": {"$ref": "#/$defs/positions", "default": "subject"},
            "seeds": {"$ref": "#/$defs/seeds"},
            "scale": {"description": "Noise in units of sigma, or auto: the smallest scale whose "
                                     "worst seed leaves P(answer) below 5% of clean (traces "
                                     "only).",
                      "oneOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": "auto"}],
                      "default": NOISE_SCALE},
            "sigma": {"description": "rome (std of the subject's input embeddings), "
                                     "embedding_matrix (std of the embedding weights) or a "
                                     "number.",
                      "oneOf": [{"enum": list(SIGMA_METHODS)},
                                {"type": "number", "exclusiveMinimum": 0}],
                      "default": SIGMA},
            "distribution": {"enum": list(DISTRIBUTIONS), "default": DISTRIBUTION}}}

    @classmethod
    def check_spec(cls, entry: dict, spec: dict, path: str) -> None:
        if entry.get("scale") == "auto" and "trace" not in spec:
            raise SpecError(path + ".scale", "'auto' is for trace specs only")

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        path = ctx.path(index, "positions")
        positions = ctx.positions(entry.get("positions", "subject"), path)
        return [Site(index, ctx.adapter.site("embed"), None, positions, where=path)]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None) -> NoiseAdd:
        path = ctx.path(site.index)
        try:
            seeds = seed_list(entry.get("seeds"))
        except (TypeError, ValueError) as error:
            raise SpecError(path + ".seeds", str(error)) from None
        try:
            _, sigma = resolve_sigma(entry.get("sigma", SIGMA), ctx.bound, ctx.tokenizer,
                                     ctx.spec.subject)
        except ValueError as error:
            raise SpecError(path + ".sigma", str(error)) from None
        return cls(seeds=seeds, positions=site.positions, scale=float(entry.get("scale",
                                                                                NOISE_SCALE)),
                   sigma=sigma, distribution=entry.get("distribution", DISTRIBUTION))

    def to_spec(self, site: Site) -> dict[str, Any]:
        return {"type": self.registered_name,
                "positions": "all" if site.positions is None else list(site.positions),
                "seeds": self.seeds.tolist(), "scale": self._config["scale"],
                "sigma": self._config["sigma"], "distribution": self._config["distribution"]}
