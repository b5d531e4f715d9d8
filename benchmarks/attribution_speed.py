"""Adjacency rows: milliseconds per row and peak memory, batched gradient seeds vs the
per-node loop, side by side on the same prompt and the same rows.

    python benchmarks/attribution_speed.py                       # SmolLM2, CPU (~5 min)
    python benchmarks/attribution_speed.py --synthetic llama1b --device cuda
        # random-init Llama-3.2-1B shape + random CLT of the real shape, ~12 features/position
    --prompts p64,p256: prompts of 64 and 256 tokens (benchmarks/attribution_scale.py's text)

Each method runs in a fresh process (so peak memory is its own): build the local replacement
model once, then every feature row either one backward per node (the loop), ``B`` rows per
backward (``torch.autograd.grad(..., is_grads_batched=True)``: one forward graph, batched
seeds), or circuit-tracer's way (``replicated``: the prompt copied into a batch of ``B`` rows,
one forward, then one backward per ``B`` feature rows, each batch row seeded with its own
target). Memory is reported as the peak above the process's state after the forward (RSS on
CPU, ``max_memory_allocated`` on GPU); the forward graph's own size and the memory cap's
estimate are printed beside it. Rows are compared with the loop's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = {
    "eiffel": "The Eiffel Tower is in the city of",
    "long": "The Eiffel Tower, which was built for the 1889 World's Fair and is visited by "
            "millions every year, is in the city of",
}
FITTED = Path(os.path.expanduser(
    "~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16"))


def prompt_text(tokenizer, name: str) -> str:
    """A named prompt, or ``p<N>``: a prompt of N tokens ending with the Eiffel question."""
    if name in PROMPTS:
        return PROMPTS[name]
    from attribution_scale import prompt_of

    return prompt_of(tokenizer, int(name.removeprefix("p")))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def load(args):
    from pyvene_causaltrace.transcoders import load_from_disk

    if args.synthetic:
        from synthetic_clt import synthetic_model_and_clt

        return synthetic_model_and_clt(args.synthetic, args.device, args.features_per_position)
    from pyvene_causaltrace.models import load_model

    model, tokenizer = load_model("smollm2-135m", device=args.device)
    if not FITTED.exists():
        raise SystemExit("run examples/fit_smollm2_clt.py first (or pass --synthetic)")
    return model, tokenizer, load_from_disk(str(FITTED), device=args.device)


def replicated_rows(model, clt, ids, run, index: torch.Tensor, size: int) -> torch.Tensor:
    """circuit-tracer's method: ``size`` copies of the prompt in one forward; each backward
    seeds copy ``b`` with the ``b``-th target's encoder row. Returns the rows of ``index`` (node
    order and leaf values of the batch-1 ``run``)."""
    from pyvene_causaltrace.attribution.edges import edges_from_grads
    from pyvene_causaltrace.attribution.replacement import run_local_replacement

    rep = run_local_replacement(model, clt, ids.expand(size, -1).contiguous())
    if rep.n_features != size * run.n_features:
        raise RuntimeError("the copies activate different features (batch-shape rounding)")
    inputs = rep.node_inputs()
    out = []
    for start in range(0, len(index), size):
        nodes = index[start:start + size]
        layers = run.feature_layer[nodes]
        outputs, seeds = [], []
        for layer in layers.unique().tolist():
            state = rep.encoder_inputs[layer]  # [size, P, D]
            seed = torch.zeros_like(state)
            rows = (layers == layer).nonzero().squeeze(-1)
            seed[rows, run.feature_position[nodes[rows]]] = \
                run.encoder_rows[nodes[rows]].to(state.dtype)
            outputs.append(state)
            seeds.append(seed)
        grads = torch.autograd.grad(outputs, inputs, seeds, retain_graph=True, allow_unused=True)
        # copy b's gradients, shaped as a batch of gradients on the batch-1 run's leaves
        batched = [None if g is None else g.reshape(size, *x.shape)
                   for x, g in zip(run.node_inputs(), grads, strict=True)]
        batched += [None] * (len(run.inputs()) - len(batched))  # constants: not compared
        out.append(edges_from_grads(run, batched, batch=size)[0][:len(nodes)].float().cpu())
    return torch.cat(out)


def _row_index(n_features: int, rows: int | None) -> torch.Tensor:
    """All feature rows, or ``rows`` of them spread evenly over the node order (layers)."""
    n = n_features if rows is None else min(rows, n_features)
    return torch.linspace(0, n_features - 1, n).round().long().unique()


def _measure(compute, cuda: bool) -> tuple[torch.Tensor, float, float]:
    """``(compute(), seconds, peak MB above the memory in use before it)``."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = current_rss_mb()
    start = time.perf_counter()
    value = compute()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb()) - base
    return value, seconds, peak


def one(args) -> dict:
    """One method in this process; returns its JSON record."""
    from pyvene_causaltrace.attribution.budget import batch_size_for
    from pyvene_causaltrace.attribution.edges import batches, feature_rows, feature_rows_loop
    from pyvene_causaltrace.attribution.replacement import run_local_replacement

    model, tokenizer, clt = load(args)
    ids = tokenizer(prompt_text(tokenizer, args.prompt), return_tensors="pt")["input_ids"]
    ids = ids.to(args.device)
    run = run_local_replacement(model, clt, ids)
    index = _row_index(run.n_features, args.rows).to(run.feature_layer.device)
    record = {"method": args.method, "prompt": args.prompt, "tokens": int(ids.shape[1]),
              "features": run.n_features, "rows": len(index), "device": args.device,
              "forward_graph_mb": run.forward_bytes / 2**20}
    if args.method == "replicated":  # circuit-tracer's: its own forward of batch B
        size = args.batch
        record["note"] = "peak includes its own batch-B forward"

        def compute():
            return replicated_rows(model, clt, ids, run, index, size)
    else:
        if args.method == "loop":
            size = 1
        elif args.memory_mb:
            size = batch_size_for(run, args.memory_mb)
        else:
            size = args.batch
        method = feature_rows_loop if args.method == "loop" else feature_rows

        def compute():
            return torch.cat([method(run, chunk)[0].cpu() for chunk in batches(index, size)])
    rows, seconds, peak = _measure(compute, args.device.startswith("cuda"))
    if args.save:
        torch.save(rows, args.save)
    return {**record, "batch": size, "ms_per_row": 1000 * seconds / len(index),
            "seconds": seconds, "peak_extra_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--synthetic", default=None, help="llama1b | tiny: random model + CLT")
    parser.add_argument("--features-per-position", type=float, default=12.0)
    parser.add_argument("--prompts", default="eiffel,long")
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--memory-caps", default="1024", help="MB; batch from the cap's estimate")
    parser.add_argument("--replicated", default="32",
                        help="batch sizes for circuit-tracer's replicated forward ('' = none)")
    parser.add_argument("--rows", type=int, default=None, help="feature rows (default: all)")
    parser.add_argument("--skip-loop", action="store_true",
                        help="no one-backward-per-node reference (rows compared with the first)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    # one-method mode (used by the driver)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="batched", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--memory-mb", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", default="eiffel", help=argparse.SUPPRESS)
    parser.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return

    common = ["--device", args.device, "--features-per-position",
              str(args.features_per_position)]
    if args.synthetic:
        common += ["--synthetic", args.synthetic]
    if args.rows:
        common += ["--rows", str(args.rows)]
    results = []
    tmp = Path(tempfile.mkdtemp())
    for prompt in args.prompts.split(","):
        runs = [] if args.skip_loop else [("loop", ["--method", "loop"])]
        runs += [(f"batched B={b}", ["--batch", b]) for b in args.batches.split(",") if b]
        runs += [(f"batched cap {c} MB", ["--memory-mb", c]) for c in args.memory_caps.split(",")
                 if c]
        runs += [(f"replicated B={b}", ["--method", "replicated", "--batch", b])
                 for b in args.replicated.split(",") if b]
        reference = None
        for label, extra in runs:
            save = tmp / f"{prompt}-{len(results)}.pt"
            cmd = [sys.executable, __file__, "--one", "--prompt", prompt, "--save", str(save),
                   *common, *extra]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            result = json.loads(line.strip().splitlines()[-1])
            rows = torch.load(save)
            reference = rows if reference is None else reference
            result["label"] = label
            result["max_abs_diff_vs_loop"] = float((rows - reference).abs().max())  # or first
            results.append(result)
            print(f"{prompt:>6} {result['tokens']:>3} tok {result['features']:>5} feat  "
                  f"{label:<20} {result['ms_per_row']:8.2f} ms/row  peak +"
                  f"{result['peak_extra_mb']:8.1f} MB  (forward graph "
                  f"{result['forward_graph_mb']:.0f} MB)  |diff| "
                  f"{result['max_abs_diff_vs_loop']:.1e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
