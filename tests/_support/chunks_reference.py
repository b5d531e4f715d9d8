"""The chunk planner's test oracle: :func:`plan_chunks_reference` is
:func:`pyvene_causaltrace.tracing.chunks.plan_chunks` as two plain nested dynamic programmes in
Python (same search space, same arithmetic, same ties), which ``tests/test_chunks.py`` checks
the fast planner against and ``benchmarks/planner.py`` times it against."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.tracing.chunks import MAX_POSITION_BAND, Chunk, ChunkCost


def cost_of(cost: ChunkCost, rows: int, span: int, layers: int, forwards: int = 1) -> float:
    """The cost of ``forwards`` forwards of ``rows`` rows of ``span`` positions through
    ``layers`` layers (:class:`ChunkCost`), in the order of operations the planners share."""
    return forwards * (cost.forward + layers * cost.layer) + layers * rows * span


def plan_chunks_reference(
    positions: Sequence[int] | torch.Tensor,
    first_layers: Sequence[int] | torch.Tensor,
    *,
    n_layers: int,
    seq_len: int,
    max_rows: Callable[[int], int],
    cost: ChunkCost,
    reuse_prefix: bool = True,
    replay_layers: bool = True,
) -> list[Chunk]:
    """:func:`plan_chunks` as two plain nested dynamic programmes in Python: the simple path the
    fast planner is tested against (same search space, same arithmetic, same ties)."""
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    firsts = torch.as_tensor(first_layers, dtype=torch.int64).reshape(-1)
    if positions.shape != firsts.shape:
        raise InputError("positions and first_layers must have one entry per row")
    if not reuse_prefix:
        positions = torch.zeros_like(positions)
    if not replay_layers:
        firsts = torch.zeros_like(firsts)
    if positions.numel() == 0:
        return []
    # rows grouped by (position, first layer): counts[i][j] over the distinct values
    position_keys, position_at = torch.unique(positions, return_inverse=True)
    layer_keys_t, layer_at = torch.unique(firsts, return_inverse=True)
    keys, layer_keys = position_keys.tolist(), layer_keys_t.tolist()
    counts = torch.bincount(position_at * len(layer_keys) + layer_at,
                            minlength=len(keys) * len(layer_keys))
    counts = counts.reshape(len(keys), len(layer_keys)).tolist()

    def layer_bands(band_counts: list[int], prefix: int) -> tuple[float, list[tuple[int, int]]]:
        """Least cost of splitting one position band by first layer, and the split."""
        span, limit = seq_len - prefix, max(1, max_rows(prefix))
        present = [j for j, n in enumerate(band_counts) if n]
        best = [0.0] + [math.inf] * len(present)
        cut = [0] * (len(present) + 1)
        for end in range(1, len(present) + 1):
            rows = 0
            for start in range(end - 1, -1, -1):
                rows += band_counts[present[start]]
                layers = n_layers - layer_keys[present[start]]
                total = best[start] + cost_of(cost, rows, span, layers,
                                              math.ceil(rows / limit))
                if total < best[end]:
                    best[end], cut[end] = total, start
        bands, end = [], len(present)
        while end:
            bands.append((present[cut[end]], present[end - 1]))
            end = cut[end]
        return best[-1], bands[::-1]

    best = [0.0] + [math.inf] * len(keys)
    cut: list[tuple[int, list]] = [(0, [])] * (len(keys) + 1)
    for end in range(1, len(keys) + 1):
        band = [0] * len(layer_keys)
        for start in range(end - 1, max(-1, end - 1 - MAX_POSITION_BAND), -1):
            band = [a + b for a, b in zip(band, counts[start], strict=True)]
            value, split = layer_bands(band, keys[start])
            if best[start] + value < best[end]:
                best[end], cut[end] = best[start] + value, (start, split)

    order = torch.argsort(positions * (n_layers + 1) + firsts, stable=True)
    chunks: list[Chunk] = []
    end = len(keys)
    bands = []
    while end:
        start, split = cut[end]
        bands.append((start, end, split))
        end = start
    for start, end, split in reversed(bands):
        low, high = keys[start], keys[end - 1]
        in_band = order[(positions[order] >= low) & (positions[order] <= high)]
        limit = max(1, max_rows(low))
        for first, last in split:
            lo, hi = layer_keys[first], layer_keys[last]
            rows = in_band[(firsts[in_band] >= lo) & (firsts[in_band] <= hi)]
            pieces = math.ceil(rows.numel() / limit)
            for piece in torch.tensor_split(rows, pieces):  # (rows fit at a later prefix too)
                chunks.append(Chunk(prefix=int(positions[piece].min()),
                                    first_layer=int(firsts[piece].min()), rows=piece))
    return chunks
