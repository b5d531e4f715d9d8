"""Which restore rows share a forward: the engine's chunk plan.

A row (one seed, one cell) equals the corrupted run before its position and below its first
layer, so a chunk runs from its smallest position (the *prefix*) and first layer; rows above
either recompute corrupted states (exact, but wasted). The plan trades that waste against the
fixed cost of each forward and layer (Python, hooks, kernel launches), which on a small model or
a GPU outweighs the arithmetic.

    plan = plan_chunks(positions, first_layers, n_layers=30, seq_len=9, max_rows=lambda p: 512,
                       cost=ChunkCost(layer=4.0, forward=40.0))
    for chunk in plan: ...   # chunk.prefix, chunk.first_layer, chunk.rows

The plan is a pure function of its inputs (the same grouping, hence rounding, every run), the
same chunks as the nested-loop planner in ``tests/_support/chunks_reference.py`` (timings:
benchmarks/RESULTS.md, "Chunk planner")."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..bound import BoundModel
from ..errors import InputError, MemoryCapError
from .settings import TraceSettings

#: Widest band of positions that one chunk may mix (bounds the planner's work on long prompts).
MAX_POSITION_BAND = 16


@dataclass(frozen=True)
class DeviceSpeed:
    """Rough speeds of a device: Python and launch overhead per layer and per forward (s),
    memory bandwidth (bytes/s: each layer's weights are read once per forward) and arithmetic
    (FLOP/s)."""

    layer_overhead: float
    forward_overhead: float
    bandwidth: float
    flops: float


#: CPU: fitted to forwards of SmolLM2 and of a tiny Llama on 2 cores (benchmarks/RESULTS.md).
#: CUDA: an H200's bandwidth and a realistic bf16 rate, with ~15 kernel launches per layer: an
#: estimate until ``benchmarks/gpu_fit_costs.py`` (run by ``gpu_check.sh``) fits it on a GPU.
DEVICE_SPEEDS: dict[str, DeviceSpeed] = {
    "cpu": DeviceSpeed(layer_overhead=2.5e-4, forward_overhead=1e-3, bandwidth=1.5e10,
                       flops=2e11),
    "cuda": DeviceSpeed(layer_overhead=1.5e-4, forward_overhead=2e-3, bandwidth=4e12,
                        flops=3e14),
}


@dataclass(frozen=True)
class ChunkCost:
    """The cost of a forward, in units of one token through one layer.

    ``layer``: the fixed cost of running one layer for a whole batch; ``forward``: the fixed
    cost of one forward besides its layers (embedding, cache, logits). A chunk of ``n`` rows of
    ``span`` positions from layer ``c`` of ``L`` costs ``forward + (L - c) * (layer + n * span)``.
    """

    layer: float
    forward: float

    @classmethod
    def estimate(cls, device_type: str, layer_bytes: float, layer_flops: float,
                 head_bytes: float) -> ChunkCost:
        """From a layer's weight bytes and FLOPs per token and the unembedding's bytes."""
        speed = DEVICE_SPEEDS.get(device_type, DEVICE_SPEEDS["cuda"])
        token = layer_flops / speed.flops
        return cls(layer=(speed.layer_overhead + layer_bytes / speed.bandwidth) / token,
                   forward=(speed.forward_overhead + head_bytes / speed.bandwidth) / token)


class Chunk(NamedTuple):
    """Rows computed together: positions ``>= prefix``, layers ``>= first_layer``. (A named
    tuple: a plan of hundreds of chunks is made in a fraction of a frozen dataclass's time.)"""

    prefix: int
    first_layer: int
    rows: torch.Tensor  # int64 indices into the trace's rows


def plan_chunks(
    positions: Sequence[int] | torch.Tensor,
    first_layers: Sequence[int] | torch.Tensor,
    *,
    n_layers: int,
    seq_len: int,
    max_rows: Callable[[int], int],
    cost: ChunkCost,
    reuse_prefix: bool = TraceSettings.reuse_prefix,
    replay_layers: bool = TraceSettings.replay_layers,
) -> list[Chunk]:
    """Group rows into chunks of least estimated :class:`ChunkCost`.

    Rows are banded by position (contiguous bands of distinct positions, at most
    :data:`MAX_POSITION_BAND` wide), and within a band by first layer; a band pair's rows run as
    ``ceil(n / max_rows(prefix))`` forwards of near-equal size. Both bandings are chosen by
    dynamic programming, the inner one for every position band at once; the plan is the
    reference planner's (``tests/_support/chunks_reference.py``). ``reuse_prefix=False``
    computes every row from position 0, ``replay_layers=False`` from layer 0.
    """
    positions, firsts = _as_array(positions), _as_array(first_layers)
    if positions.shape != firsts.shape:
        raise InputError("positions and first_layers must have one entry per row")
    if not reuse_prefix:
        positions = np.zeros_like(positions)
    if not replay_layers:
        firsts = np.zeros_like(firsts)
    if positions.size == 0:
        return []
    (keys, position_at), (layer_keys, layer_at) = _distinct(positions), _distinct(firsts)
    n_keys, n_firsts = len(keys), len(layer_keys)
    _SCRATCH.reset()
    cell = position_at * n_firsts + layer_at  # rows grouped by (position, first layer)
    counts = np.bincount(cell, minlength=n_keys * n_firsts).reshape(n_keys, n_firsts)
    limits = np.array([max(1, max_rows(int(key))) for key in keys], dtype=np.int64)

    # every position band keys[start:end], by end, then start from end - 1 down (the order in
    # which the reference meets them, so that ties resolve alike)
    widths = np.minimum(np.arange(1, n_keys + 1), MAX_POSITION_BAND)
    ends = np.repeat(np.arange(1, n_keys + 1), widths)
    starts = ends - 1 - (np.arange(len(ends)) - np.repeat(np.cumsum(widths) - widths, widths))
    runs = _LayerRuns.of(counts, starts, ends, seq_len - keys[starts], limits[starts],
                         layer_keys, n_layers, cost)
    least = runs.least()
    chosen = _position_bands(least[-1].tolist(), starts.tolist(), n_keys)

    # each chosen band's runs of first layers as groups of (position, first layer) cells
    runs = runs.columns(chosen)
    cuts = runs.cuts(least[:, chosen]).T.tolist()
    group = np.empty((n_keys, n_firsts), dtype=np.int64)
    group_limits: list[int] = []
    for low, high, limit, cut, below in zip(
            starts[chosen].tolist(), ends[chosen].tolist(), limits[starts[chosen]].tolist(),
            cuts, runs.below.T.tolist(), strict=True):
        labels, end = [], n_firsts
        while end:
            start = cut[end]
            labels.append((start, end, below[end] > below[start]))
            end = start
        line = []
        for start, end, has_rows in reversed(labels):
            line += [len(group_limits) if has_rows else -1] * (end - start)
            if has_rows:
                group_limits.append(limit)
        group[low:high] = line
    # rows by group, then position, first layer and index (the reference's order while first
    # layers are at most n_layers)
    rank = np.empty(group.size, dtype=np.min_scalar_type(group.size))
    rank[np.argsort(group.reshape(-1), kind="stable")] = np.arange(group.size)
    order = np.argsort(rank[cell], kind="stable").astype(np.int64, copy=False)  # radix sort
    return _pieces(positions[order], firsts[order], order, group.reshape(-1)[cell[order]],
                   np.array(group_limits))


def _position_bands(values: list[float], starts: list[int], n_keys: int) -> list[int]:
    """The position programme over bands of least cost ``values`` (ordered as in
    :func:`plan_chunks`): the chosen bands, by position. Few candidates: plain Python."""
    best, back = [0.0] + [math.inf] * n_keys, [0] * (n_keys + 1)
    band = 0
    for end in range(1, n_keys + 1):
        for start in range(end - 1, max(-1, end - 1 - MAX_POSITION_BAND), -1):
            if best[start] + values[band] < best[end]:
                best[end], back[end] = best[start] + values[band], band
            band += 1
    chosen, end = [], n_keys
    while end:
        chosen.append(back[end])
        end = starts[back[end]]
    return chosen[::-1]


def _as_array(values: Sequence[int] | torch.Tensor) -> np.ndarray:
    """A flat int64 array (on the CPU)."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).reshape(-1).numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)``, by counting when the values are close."""
    low = int(values.min())
    if int(values.max()) - low > 4 * values.size + 1024:  # sparse: sorting is cheaper
        keys, index = np.unique(values, return_inverse=True)
        return keys, index.reshape(-1)
    present = np.bincount(values - low) > 0
    return np.flatnonzero(present) + low, (np.cumsum(present) - 1)[values - low]


def _pieces(positions: np.ndarray, firsts: np.ndarray, order: np.ndarray, row_group: np.ndarray,
            group_limits: np.ndarray) -> list[Chunk]:
    """Chunks of each group's rows (``order``, grouped, with their positions, first layers and
    groups), split into ``ceil(n / limit)`` near-equal pieces as :func:`torch.tensor_split`
    splits."""
    sizes = np.bincount(row_group, minlength=len(group_limits))
    pieces = -(-sizes // group_limits)
    of = np.repeat(np.arange(len(sizes)), pieces)
    within = np.arange(len(of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    piece_sizes = sizes[of] // pieces[of] + (within < sizes[of] % pieces[of])
    offsets = np.cumsum(piece_sizes) - piece_sizes
    prefixes = np.minimum.reduceat(positions, offsets).tolist()
    first_layers = np.minimum.reduceat(firsts, offsets).tolist()
    rows = torch.from_numpy(order).split(piece_sizes.tolist())
    return list(map(Chunk._make, zip(prefixes, first_layers, rows, strict=True)))


class _Scratch(threading.local):
    """Float64 arrays for one :func:`plan_chunks` call, carved from a buffer that each thread
    keeps between calls (up to :attr:`KEEP` floats). The planner's ``[first layer, band]``
    tables would otherwise be fresh memory on every call, which the allocator hands back to the
    system afterwards: about 550 page faults, some 2 ms, per call at 40 layers x 64 tokens."""

    KEEP = 1 << 22  # 32 MB

    def __init__(self) -> None:
        self.buffer, self.used, self.wanted = np.empty(0), 0, 0

    def reset(self) -> None:
        """Start a call: arrays taken before are free again; grow to the last call's need."""
        if self.buffer.size < min(self.wanted, self.KEEP):
            self.buffer = np.empty(min(self.wanted, self.KEEP))
        self.used, self.wanted = 0, 0

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised C-order array, valid until the next :meth:`reset`."""
        size = math.prod(shape)
        self.wanted += size
        if self.used + size > self.buffer.size:
            return np.empty(shape)
        self.used += size
        return self.buffer[self.used - size:self.used].reshape(shape)


_SCRATCH = _Scratch()


@dataclass(frozen=True)
class _LayerRuns:
    """The first-layer programme of a set of position bands, one column each: split a band's
    first layers into runs, a run costing its :class:`ChunkCost` from its smallest first layer.

    The programme runs over every first layer, present in the band or not: a run's first layer
    is its smallest present one and an empty run costs 0, so its least costs are the
    reference's (over present layers alone) value for value, and the latest least cut is a
    present layer, as the reference's is.
    """

    below: np.ndarray  # [J + 1, B] rows below each boundary (whole numbers: exact)
    fixed: np.ndarray  # [J, B] cost per forward of a run from each first layer
    per_row: np.ndarray  # [J, B] cost per row of such a run
    limits: np.ndarray  # [B] rows per forward (whole numbers: exact)

    @classmethod
    def of(cls, counts: np.ndarray, starts: np.ndarray, ends: np.ndarray, spans: np.ndarray,
           limits: np.ndarray, layer_keys: np.ndarray, n_layers: int,
           cost: ChunkCost) -> _LayerRuns:
        """For the bands ``keys[starts[b]:ends[b]]`` of rows ``counts[position, first layer]``."""
        n_keys, n_firsts = counts.shape
        # [boundary, position] (whole numbers), its bands' differences in C order (indexing the
        # second axis alone would leave Fortran order, and the programme's rows strided)
        cumulative = np.zeros((n_firsts + 1, n_keys + 1))
        cumulative[1:, 1:] = counts.T.cumsum(0).cumsum(1)
        shape = (n_firsts + 1, len(ends))
        below = np.take(cumulative, ends, axis=1, out=_SCRATCH.take(shape), mode="clip")
        below -= np.take(cumulative, starts, axis=1, out=_SCRATCH.take(shape), mode="clip")
        # a run's layers are its first present layer's: the most among present ones from it on
        # (first layers are distinct and ascending); where none is, any finite number will do
        layers = _SCRATCH.take((n_firsts, len(ends)))
        layers[:] = float(n_layers - layer_keys[-1] - 1)
        np.copyto(layers, (n_layers - layer_keys)[:, None].astype(float),
                  where=below[1:] > below[:-1])
        for layer in range(n_firsts - 2, -1, -1):
            np.maximum(layers[layer], layers[layer + 1], out=layers[layer])
        fixed = np.multiply(layers, cost.layer, out=_SCRATCH.take(layers.shape))
        fixed += cost.forward  # forward + layers * layer, as the reference adds them
        return cls(below=below, fixed=fixed, per_row=np.multiply(layers, spans, out=layers),
                   limits=limits.astype(np.float64))

    def columns(self, index: list[int]) -> _LayerRuns:
        return _LayerRuns(self.below[:, index], self.fixed[:, index], self.per_row[:, index],
                          self.limits[index])

    def least(self) -> np.ndarray:
        """``[J + 1, B]``: each band's least cost up to each boundary."""
        n_firsts, n_bands = self.fixed.shape
        best = _SCRATCH.take((n_firsts + 1, n_bands))
        best[0] = 0.0
        rows_at, value_at = (_SCRATCH.take((n_firsts, n_bands)) for _ in range(2))
        for end in range(1, n_firsts + 1):
            rows = np.subtract(self.below[end], self.below[:end], out=rows_at[:end])
            value = self._candidates(rows, self.fixed[:end], self.per_row[:end], best[:end],
                                     value_at[:end])
            value.min(axis=0, out=best[end])
        return best

    def cuts(self, least: np.ndarray) -> np.ndarray:
        """``[J + 1, B]``: the latest start of a least-cost last run before each boundary."""
        n_firsts = self.fixed.shape[0]
        shape = (n_firsts, *self.below.shape)
        rows = np.subtract(self.below[None, :, :], self.below[:-1, None, :],  # [start, end, band]
                           out=_SCRATCH.take(shape))
        value = self._candidates(rows, self.fixed[:, None], self.per_row[:, None],
                                 least[:-1, None], _SCRATCH.take(shape))
        too_late = np.arange(n_firsts)[:, None, None] >= np.arange(n_firsts + 1)[:, None]
        np.copyto(value, math.inf, where=too_late)
        ties = value == value.min(axis=0)  # (the least costs again, bit for bit)
        return n_firsts - 1 - ties[::-1].argmax(axis=0)

    def _candidates(self, rows: np.ndarray, fixed: np.ndarray, per_row: np.ndarray,
                    best: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``best + forwards * (forward + layers * layer) + layers * rows * span`` in the
        reference's order of operations (its floats, bit for bit); overwrites ``rows``."""
        value = np.divide(rows, self.limits, out=out)
        np.ceil(value, out=value)  # forwards
        value *= fixed
        rows *= per_row  # whole numbers below 2**53: exact
        value += rows
        value += best
        return value


def check_seeds_fit(n_seeds: int, seq_len: int, bound: BoundModel, budget_mb: float) -> None:
    """Refuse, before allocating, a seed count whose corrupted run exceeds ``budget_mb``: per
    seed, every layer's block, MLP and attention outputs and keys and values, plus one
    forward's live activations and logits."""
    n_layers, hidden = bound.n_layers, bound.d_model
    per_seed = (3 * n_layers * seq_len * hidden + 2 * n_layers * seq_len * bound.kv_width
                + 8 * seq_len * max(hidden, bound.d_mlp) + 3 * bound.vocab_size)
    need = n_seeds * per_seed * bound.element_size / 2**20
    if need > budget_mb:
        per_seed = need / n_seeds
        raise MemoryCapError(
            f"seeds: {n_seeds} seeds keep {need:,.0f} MB of corrupted states on this prompt, over "
            f"the {budget_mb:g} MB budget: use at most {max(1, int(budget_mb // per_seed))} "
            "seeds or a larger budget (--budget-mb)")
