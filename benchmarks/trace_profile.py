"""Where a full residual trace spends its time: ``torch.profiler`` over one engine run (reference
runs included) on the tiny Llama and on SmolLM2 of ``trace_speed.py``, top operators by self
CPU time, plus the share of the run spent outside the model's own modules.

    python benchmarks/trace_profile.py [--models tiny,smollm2] [--seeds 10] [--rows 12]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from trace_speed import setup  # noqa: E402

from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine  # noqa: E402


def profiled(name: str, seeds: int):
    """(seconds, profiler) of one full residual trace of benchmark model ``name``."""
    model, _tokenizer, ids, subject, sigma, _answer_text, answer = setup(name)
    cells = [(layer, pos) for layer in range(model.config.num_hidden_layers)
             for pos in range(ids.shape[1])]

    def run():
        engine = TraceEngine(model, ids, subject, list(range(seeds)), 3.0, sigma, answer)
        return engine.run(KINDS["residual"], cells)

    run()  # warm-up
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return len(cells) * seeds, time.perf_counter() - start, prof


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--rows", type=int, default=12, help="operators to list")
    args = parser.parse_args()
    for name in args.models.split(","):
        n_rows, took, prof = profiled(name, args.seeds)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n== {name}: {n_rows} rows, {took:.3f} s under the profiler")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        compute = sum(e.self_cpu_time_total for e in events
                      if e.key.startswith(("aten::addmm", "aten::mm", "aten::bmm",
                                           "aten::_scaled_dot_product", "aten::linear",
                                           "aten::matmul")))
        print(f"matrix products and attention: {compute / total:.0%} of self CPU time")


if __name__ == "__main__":
    main()
