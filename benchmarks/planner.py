"""The trace engine's chunk planner: :func:`plan_chunks` (vectorised) against
:func:`plan_chunks_reference` (the plain nested loops, the tests' oracle in
``tests/_support/chunks_reference.py``), side by side in one process.

Each case is a full residual trace's rows (every layer and position, each seed; a row's first
layer is its layer + 1) with the engine's CPU cost model and memory budget for a layer of
SmolLM2-135M's size and for the tiny random Llama of ``trace_speed.py``. Repeats alternate the
two planners, with garbage collection off while a planner runs (as :mod:`timeit` does); the
table gives median wall milliseconds (and the vectorised planner's median CPU milliseconds, which
other processes on a busy machine disturb less) and checks that both return the same chunks.
The last columns plan the same rows by position alone (``replay_layers=False``), as the engine
does whenever its ragged rows are on (the default: each row starts at its own layer inside a
chunk, so chunks only band positions), checked against the reference planning alike.

    python benchmarks/planner.py [--repeats 7] [--budget-mb 2048] [--against REV]

``--against REV`` also runs ``plan_chunks`` as it was at git revision ``REV`` (its
``tracing/chunks.py`` loaded beside this one), interleaved with the others: on a machine whose
load changes from minute to minute, the ratio of the two is steadier than either time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pyvene_causaltrace.tracing.chunks import ChunkCost, plan_chunks

# The reference planner is a test oracle and lives with the tests, not in the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _support.chunks_reference import plan_chunks_reference  # noqa: E402

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


def planner_at(revision: str):
    """``plan_chunks`` of ``tracing/chunks.py`` at a git revision."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{revision}:pyvene_causaltrace/tracing/chunks.py"],
                            cwd=root, check=True, capture_output=True, text=True).stdout
    source = source.replace("from ..errors import", "from pyvene_causaltrace.errors import")
    path = Path(tempfile.mkdtemp()) / "chunks_at_revision.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("chunks_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.plan_chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget-mb", type=float, default=2048.0)
    parser.add_argument("--against", default=None, help="a git revision's plan_chunks too")
    args = parser.parse_args()
    planners = {"reference": plan_chunks_reference, "vectorised": plan_chunks,
                "positions reference": functools.partial(plan_chunks_reference,
                                                         replay_layers=False),
                "positions": functools.partial(plan_chunks, replay_layers=False)}
    if args.against:
        planners[args.against] = planner_at(args.against)
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
    against = f" {args.against} ms | vectorised / {args.against} |" if args.against else ""
    print("| layers × tokens × seeds | layer size | rows | chunks | reference ms | "
          f"vectorised ms | speed-up | vectorised CPU ms |{against} same chunks | "
          "positions only: chunks | reference ms | vectorised ms | same chunks |")
    print("|---|---|---|---|---|---|---|---|" + "---|---|" * bool(args.against)
          + "---|---|---|---|---|")
    for (model, shape), (positions, _, _) in cases.items():
        ref, fast = (statistics.median(times[model, shape][n]) * 1e3
                     for n in ("reference", "vectorised"))
        same = all(plans[(model, shape), "reference"] == plans[(model, shape), n]
                   for n in planners if not n.startswith("positions"))
        by_position = (plans[(model, shape), "positions"]
                       == plans[(model, shape), "positions reference"])
        position_ms = [statistics.median(times[model, shape][n]) * 1e3
                       for n in ("positions reference", "positions")]
        then = ""
        if args.against:
            old = statistics.median(times[model, shape][args.against]) * 1e3
            then = f" {old:.2f} | {fast / old:.2f} |"
        print(f"| {' × '.join(map(str, shape))} | {model} | {positions.numel():,} | "
              f"{plans[(model, shape), 'vectorised'][0]} | {ref:.1f} | {fast:.2f} | "
              f"{ref / fast:.0f}× | {statistics.median(cpu[model, shape]) * 1e3:.2f} |{then} "
              f"{'yes' if same else 'NO'} | {plans[(model, shape), 'positions'][0]} | "
              f"{position_ms[0]:.1f} | {position_ms[1]:.2f} | {'yes' if by_position else 'NO'} |")


if __name__ == "__main__":
    main()
