"""The trace engine's own ops per chunk forward, the CPU's count of what would be kernel launches
on a GPU (``tests/_support/ops.py``; ``benchmarks/trace_launches.py`` prints the whole table):
a change that adds launches per chunk or per layer fails here. Each chunk's masks, keys and
values, stored rows and frozen values are made in one op for all its layers; per layer there
remain each restore's or freeze's ``where`` (on the CPU also its emptiness check, ``any`` and
its read) and a ragged block's ``cat`` of the rows joining it. Before these were fused the
counts were 31 + 11 per layer (residual), 41 + 9 (mlp), 35 + 15 (severed-attn)."""

from __future__ import annotations

import pytest
import torch
from _support.models import make_tiny_model
from _support.ops import OURS, per_chunk, plain_forward

from pyvene_causaltrace.tracing.chunks import ChunkCost
from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine

#: kind -> (our launches per chunk at 2 layers, our launches per extra layer), as reached
PINNED = {"residual": (22, 4), "mlp": (27, 3), "severed-attn": (28, 7)}
SEQ = 7


def _launches(kind: str, n_layers: int) -> tuple[int, int]:
    """(our launches, a plain forward's launches) in the one chunk of a trace of every cell."""
    model = make_tiny_model("llama", n_layers=n_layers)
    ids = torch.arange(10, 10 + SEQ)[None]
    engine = TraceEngine(model, ids, [1, 2, 3], [0, 1], 3.0, 0.5, 11)
    engine.cost = ChunkCost(1e9, 1e9)  # forwards cost most: one chunk
    cells = [(layer, pos) for layer in range(n_layers) for pos in range(SEQ)]
    (chunk, counter), = per_chunk(engine, KINDS[kind], cells)
    assert chunk.prefix == 1  # position 0 is before the noise: rows start after it
    return counter.launches(OURS), plain_forward(model, ids, chunk.rows.numel()).launches()


@pytest.mark.parametrize("kind", sorted(PINNED))
def test_our_launches_per_chunk_and_layer_stay_pinned(kind):
    (two, plain_two), (four, plain_four) = _launches(kind, 2), _launches(kind, 4)
    at_two, per_layer = PINNED[kind]
    plain_per_layer = (plain_four - plain_two) / 2
    seen = (f"{kind}: ours {two} at 2 layers, {(four - two) / 2:g} per layer; a plain forward "
            f"{plain_two} at 2 layers, {plain_per_layer:g} per layer")
    assert two <= at_two, seen
    assert (four - two) / 2 <= per_layer, seen
    assert per_layer < plain_per_layer / 4, seen  # the model's own launches dominate a layer
