"""The trace engine's chunk planner: :func:`plan_chunks` (vectorised) against
:func:`plan_chunks_reference` (the plain nested loops), side by side in one process.

Each case is a full residual trace's rows (every layer and position, each seed; a row's first
layer is its layer + 1) with the engine's CPU cost model and memory budget for a layer of
SmolLM2-135M's size and for the tiny random Llama of ``trace_speed.py``. Repeats alternate the
two planners, with garbage collection off while a planner runs (as :mod:`timeit` does); the
table gives median wall milliseconds (and the vectorised planner's median CPU milliseconds, which
other processes on a busy machine disturb less) and checks that both return the same chunks.

    python benchmarks/planner.py [--repeats 7] [--budget-mb 2048]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from pyvene_causaltrace.tracing.chunks import ChunkCost, plan_chunks, plan_chunks_reference

#: (hidden, MLP inner, heads, key-value heads, vocabulary) of the two layer sizes.
MODELS = {"SmolLM2-135M": (576, 1536, 9, 3, 49152), "tiny Llama": (64, 256, 4, 2, 512)}
#: (layers, positions, seeds): a 36-layer model on 11 tokens, 40 layers on 64, SmolLM2's 30 on 9.
SHAPES = [(36, 11, 10), (40, 64, 10), (30, 9, 10)]


def case(model: str, n_layers: int, seq_len: int, seeds: int, budget_mb: float):
    """The planner's inputs for a full residual trace, as :class:`TraceEngine` makes them."""
    hidden, inner, heads, kv_heads, vocab = MODELS[model]
    head_dim = hidden // heads
    params = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inner
    cost = ChunkCost.estimate("cpu", layer_bytes=4 * params, layer_flops=2 * params,
                              head_bytes=4 * vocab * hidden)

    def max_rows(prefix: int) -> int:  # TraceEngine.rows_per_chunk's formula, float32
        span = seq_len - prefix
        floats = (2 * n_layers * seq_len * kv_heads * head_dim + 8 * span * max(hidden, inner)
                  + 4 * span * hidden + 3 * vocab)
        return max(1, int(budget_mb * 2**20 // (4 * floats)))

    layer, position = torch.meshgrid(torch.arange(n_layers), torch.arange(seq_len),
                                     indexing="ij")
    positions = position.reshape(-1).repeat_interleave(seeds)
    firsts = (layer.reshape(-1) + 1).repeat_interleave(seeds)
    return positions, firsts, dict(n_layers=n_layers, seq_len=seq_len, max_rows=max_rows,
                                   cost=cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget-mb", type=float, default=2048.0)
    args = parser.parse_args()
    planners = {"reference": plan_chunks_reference, "vectorised": plan_chunks}
    cases = {(model, shape): case(model, *shape, args.budget_mb)
             for shape in SHAPES for model in MODELS}
    times = {key: {name: [] for name in planners} for key in cases}
    cpu = {key: [] for key in cases}
    plans = {}
    for _ in range(args.repeats):
        for key, (positions, firsts, settings) in cases.items():
            for name, planner in planners.items():
                gc.collect()
                gc.disable()
                start, start_cpu = time.perf_counter(), time.thread_time()
                plan = planner(positions, firsts, **settings)
                times[key][name].append(time.perf_counter() - start)
                if name == "vectorised":
                    cpu[key].append(time.thread_time() - start_cpu)
                gc.enable()
                plans[key, name] = len(plan), hash(tuple(
                    (c.prefix, c.first_layer, tuple(c.rows.tolist())) for c in plan))
    print("| layers × tokens × seeds | layer size | rows | chunks | reference ms | "
          "vectorised ms | speed-up | vectorised CPU ms | same chunks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (model, shape), (positions, _, _) in cases.items():
        ref, fast = (statistics.median(times[model, shape][n]) * 1e3 for n in planners)
        same = plans[(model, shape), "reference"] == plans[(model, shape), "vectorised"]
        print(f"| {' × '.join(map(str, shape))} | {model} | {positions.numel():,} | "
              f"{plans[(model, shape), 'vectorised'][0]} | {ref:.1f} | {fast:.2f} | "
              f"{ref / fast:.0f}× | {statistics.median(cpu[model, shape]) * 1e3:.2f} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
