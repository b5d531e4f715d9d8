"""A bfloat16 graph against the float32 graph of the same prompt (issue 54, item 4), and two
``deterministic=True`` runs against each other, at Llama-3.2-1B's shape with
``synthetic_clt.py``'s random CLT (a random-init model: no weights travel to the GPU machine).

Writes JSON: each graph's seconds and peak device memory, :func:`graph_deviation` of the
bfloat16 graph from the float32 one (relative edge error, top-100 overlap by influence, both
closures), whether two plain runs and two deterministic runs are bit-identical (every row,
constant, activation and influence, ``torch.equal``) in each dtype, the deterministic runs'
seconds (the mode's cost) and any warning torch gave about an op without a deterministic
implementation.

    python benchmarks/bf16_deviation.py --device cuda --out bf16_deviation.json   # ~60 s, H100
    SMOKE=1 python benchmarks/bf16_deviation.py --device cpu --out /tmp/bf16.json  # tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

# before the first CUDA call: cuBLAS sizes its workspace once (deterministic mode needs this)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import synthetic_clt  # noqa: E402

from pyvene_causaltrace.attribution import attribute  # noqa: E402
from pyvene_causaltrace.attribution.compare import graph_deviation  # noqa: E402

PROMPT = "The Eiffel Tower is in the city of"


def _identical(a, b) -> bool:
    """Every row, constant, activation and influence of two graphs bit for bit."""
    rows = torch.arange(a.rows.n_rows)
    return (a.rows.n_rows == b.rows.n_rows and torch.equal(a.rows.nodes, b.rows.nodes)
            and torch.equal(a.rows.dense(rows), b.rows.dense(rows))
            and torch.equal(a.rows.constants, b.rows.constants)
            and torch.equal(a.activation, b.activation)
            and torch.equal(a.influence(), b.influence()))


def _graph(model, tokenizer, clt, device: str, **settings) -> tuple[object, dict]:
    """One graph, its seconds and peak device memory (MB; CUDA only)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = attribute(model, tokenizer, clt, PROMPT, check_closure=False, **settings)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
    notes = sorted({str(w.message)[:300] for w in caught if "determinis" in str(w.message)})
    return graph, {"seconds": round(seconds, 3), "peak_mb": peak,
                   "features": graph.n_features, "rows": graph.rows.n_rows,
                   "warnings": notes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, choices=sorted(synthetic_clt.SHAPES),
                        help="default llama1b, tiny with SMOKE=1")
    parser.add_argument("--features-per-position", type=float, default=12.0)
    parser.add_argument("--max-feature-nodes", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bf16_deviation.json"))
    args = parser.parse_args()
    shape = args.shape or ("tiny" if os.environ.get("SMOKE") == "1" else "llama1b")
    model, tokenizer, clt = synthetic_clt.synthetic_model_and_clt(
        shape, args.device, args.features_per_position, PROMPT)
    budget = {"max_feature_nodes": args.max_feature_nodes}
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu", "shape": shape, "prompt": PROMPT, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "graphs": {}, "identical": {}}
    made = {}
    for dtype in ("float32", "bfloat16"):
        for mode, deterministic in (("plain", False), ("deterministic", True)):
            for run in (1, 2):
                graph, facts = _graph(model, tokenizer, clt, args.device, compute_dtype=dtype,
                                      deterministic=deterministic, **budget)
                made[dtype, mode, run] = graph
                result["graphs"][f"{dtype} {mode} {run}"] = facts
            result["identical"][f"{dtype} {mode}"] = _identical(made[dtype, mode, 1],
                                                                made[dtype, mode, 2])
    result["deviation"] = graph_deviation(made["bfloat16", "plain", 1],
                                          made["float32", "plain", 1])
    result["dtype_metadata"] = made["bfloat16", "plain", 1].metadata["dtype"]
    args.out.write_text(json.dumps(result, indent=1))
    d = result["deviation"]
    print(f"{result['device']} {shape}: bf16 vs float32 edges {d['edges']['graph']:.3g} "
          f"(row median {d['edges']['row_median']:.3g}, max {d['edges']['row_max']:.3g}), "
          f"top-{d['top']} overlap {d['top_overlap']:.2f}, target {d['target']['relative']:.2%}"
          f", closure bf16 {max(d['closure']['graph']['target_row'], d['closure']['graph']['feature_rows']):.2e}"  # noqa: E501
          f" float32 {max(d['closure']['reference']['target_row'], d['closure']['reference']['feature_rows']):.2e}")  # noqa: E501
    for name, facts in result["graphs"].items():
        print(f"  {name}: {facts['seconds']} s, peak {facts['peak_mb']} MB, "
              f"{facts['features']} features, {len(facts['warnings'])} warnings")
    print("  identical:", result["identical"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
