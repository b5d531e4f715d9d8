"""Feature rows per second, the batched backward as it was (autograd through the splice's
writes for every leaf) against now (:mod:`pyvene_causaltrace.attribution.leaf_grads`: the
feature leaves' gradients from the error leaves'), side by side in one process on the setting of
``attribution_scale.py``: SmolLM2-135M, a synthetic CLT of 8,192 features per layer with ~50
firing per layer and position, a 32-token prompt, 2,000 feature rows.

    OMP_NUM_THREADS=1 python benchmarks/attribution_rows.py --repeats 1 --profile 6

Runs ``attribute`` with each path in turn (old, new, old, new, ...) and reports the rows'
seconds and rows/s of each run (``metadata["seconds"]``), then the largest difference between
the two paths' rows of the same nodes, and with ``--profile N`` seconds per batched backward of
32 random feature rows, the paths alternating batch by batch, and each path's top operators
(torch.profiler, self CPU time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from attribution_scale import ANSWER, prompt_of  # noqa: E402
from synthetic_clt import synthetic_clt_for  # noqa: E402

from pyvene_causaltrace.attribution import attribute, edges  # noqa: E402
from pyvene_causaltrace.attribution.replacement import replacement_forward  # noqa: E402
from pyvene_causaltrace.bound import bind  # noqa: E402
from pyvene_causaltrace.models import load_model  # noqa: E402


def autograd_leaf_grads(run, outputs, seeds):
    """The path before issue 27: autograd on every leaf, features included."""
    return torch.autograd.grad(outputs, run.inputs(), seeds, retain_graph=True,
                               allow_unused=True, is_grads_batched=True)


@contextlib.contextmanager
def path(name: str):
    """Inside the block the batched rows take the ``"old"`` or ``"new"`` path."""
    saved = edges.leaf_grads
    if name == "old":
        edges.leaf_grads = autograd_leaf_grads
    try:
        yield
    finally:
        edges.leaf_grads = saved


def dense_rows(graph) -> dict[int, torch.Tensor]:
    store = graph.rows
    nodes = store.nodes.tolist()
    return dict(zip(nodes, store.dense(list(range(len(nodes)))), strict=True))


def compare(old, new) -> dict:
    """The largest |new - old| over the rows both graphs computed (features and logits)."""
    a, b = dense_rows(old), dense_rows(new)
    common = sorted(set(a) & set(b))
    diff = max(float((a[n] - b[n]).abs().max()) for n in common)
    scale = max(float(a[n].abs().max()) for n in common)
    rel = max(float(((a[n] - b[n]).abs() / a[n].abs().sum()).max()) for n in common)
    big = sum(int(((a[n] - b[n]).abs() > 1e-6).sum()) for n in common)
    entries = sum(int((a[n] != 0).sum()) for n in common)
    ca, cb = old.rows.constants, new.rows.constants
    where_a = {n: i for i, n in enumerate(old.rows.nodes.tolist())}
    where_b = {n: i for i, n in enumerate(new.rows.nodes.tolist())}
    const = max(abs(float(ca[where_a[n]] - cb[where_b[n]])) for n in common)
    return {"common_rows": len(common), "only_old": len(set(a) - set(b)),
            "only_new": len(set(b) - set(a)), "max_abs_diff": diff, "max_abs_entry": scale,
            "max_diff_over_row_l1": rel, "entries_over_1e-6": big, "entries": entries,
            "max_constant_diff": const}


def per_batch(model, clt, ids, n_batches: int) -> dict:
    """Seconds per batched backward of 32 random feature rows, the two paths alternating batch
    by batch (robust to a machine whose load drifts), then each path's top operators over
    ``n_batches`` backwards under torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run = replacement_forward(bind(model), clt, ids)
    order = torch.randperm(run.n_features, generator=torch.Generator().manual_seed(1))
    batches = [order[32 * i:32 * (i + 1)] for i in range(n_batches)]
    seconds: dict[str, list[float]] = {"old": [], "new": []}
    for name in ("old", "new"):  # warm
        with path(name):
            edges.feature_rows(run, batches[0])
    for index in batches:
        for name in ("old", "new"):
            with path(name):
                start = time.perf_counter()
                edges.feature_rows(run, index)
                seconds[name].append(time.perf_counter() - start)
    out = {}
    for name in ("old", "new"):
        with path(name), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for index in batches:
                edges.feature_rows(run, index)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
        median = sorted(seconds[name])[len(seconds[name]) // 2]
        out[name] = {"seconds": seconds[name], "median_s": median,
                     "top": [(e.key, round(100 * e.self_cpu_time_total / total, 1))
                             for e in top]}
        print(f"{name}: median {1000 * median:.0f} ms per backward of 32 rows "
              f"({', '.join(f'{1000 * x:.0f}' for x in seconds[name])}); profile: "
              + ", ".join(f"{k} {p}%" for k, p in out[name]["top"]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then N batches of each path alternating, and their profiles")
    parser.add_argument("--skip-attribute", action="store_true",
                        help="only the per-batch comparison (--profile)")
    parser.add_argument("--memory-mb", type=float, default=16000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    clt = synthetic_clt_for(model, tokenizer, 8192, 50.0, prompt_of(tokenizer, 128),
                            source="synthetic smollm2 CLT")
    prompt = prompt_of(tokenizer, args.tokens)
    record = {"tokens": args.tokens, "budget": args.budget, "threads": torch.get_num_threads(),
              "load_before": os.getloadavg(), "runs": []}
    graphs = {}
    for repeat in range(0 if args.skip_attribute else args.repeats):
        for name in ("old", "new"):
            with path(name):
                graph = attribute(model, tokenizer, clt, prompt, ANSWER,
                                  max_feature_nodes=args.budget, memory_mb=args.memory_mb)
            s = graph.metadata["seconds"]
            rate = graph.n_explored / s["rows"]
            record["runs"].append({"path": name, "repeat": repeat, "seconds": s,
                                   "rows": graph.n_explored, "rows_per_s": rate,
                                   "load": os.getloadavg()})
            print(f"{name} #{repeat}: {graph.n_explored} rows, total {s['total']:.1f} s "
                  f"(forward {s['forward']:.1f}, ranking {s['ranking']:.1f}, rows "
                  f"{s['rows']:.1f}): {rate:.1f} rows/s; load {os.getloadavg()[0]:.2f}",
                  flush=True)
            graphs.setdefault(name, graph)
    if graphs:
        record["compare"] = compare(graphs["old"], graphs["new"])
        print("rows old vs new:", json.dumps(record["compare"]), flush=True)
        graphs.clear()
    if args.profile:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        record["per_batch"] = per_batch(model, clt, ids, args.profile)
    record["load_after"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
