"""Attribution graphs of long prompts (issue 54 item 3): a 7,500-node graph of 2,048, 4,096 and
8,192-token prompts on Llama-3.2-1B's shape (random init) with the synthetic 16 x 32,768 CLT at
10 features per position (benchmarks/synthetic_clt.py): time, peak memory and closure per
length, each length in a fresh process.

    python benchmarks/long_prompts.py --device cuda --tokens 2048,4096,8192 --out long.json
    SMOKE=1 python benchmarks/long_prompts.py          # tiny shape, short prompts, the CPU

Peak memory is ``torch.cuda.max_memory_allocated`` above the loaded model and CLT on a GPU;
on the CPU it is the meter's (:mod:`pyvene_causaltrace.meter`: every tensor allocation the
profiler sees), split by phase, with the forward graph's parts (saved activations, decoder
rows of active features, attention patterns) from one extra replacement forward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SMOKE = os.environ.get("SMOKE") == "1"


def one(args) -> dict:
    import torch
    import transformers as tf
    from attribution_scale import ANSWER, prompt_of
    from synthetic_clt import SHAPES, known_facts_tokenizer, synthetic_clt_for

    from pyvene_causaltrace.attribution import MemoryCapError, ReplacementModel, attribute
    from pyvene_causaltrace.attribution.budget import forward_parts, row_bytes, store_bytes
    from pyvene_causaltrace.memory import device_bytes
    from pyvene_causaltrace.meter import metered

    device = torch.device(args.device)
    config_kwargs, n_features = SHAPES[args.shape]
    config_kwargs = {**config_kwargs, "max_position_embeddings": max(
        config_kwargs.get("max_position_embeddings", 0), args.tokens + 8)}
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config_kwargs)).to(device).eval()
    model.pvct_source = f"random-init {args.shape}"
    tokenizer = known_facts_tokenizer()
    clt = synthetic_clt_for(model, tokenizer, n_features, args.features_per_position,
                            prompt_of(tokenizer, 128), str(device))
    prompt = prompt_of(tokenizer, args.tokens)
    record = {"tokens": args.tokens, "shape": args.shape, "device": str(device),
              "budget": args.budget, "batch": args.batch, "memory_mb": args.memory_mb}
    if device.type == "cpu":  # the forward graph's parts, from one replacement forward
        replacement = ReplacementModel(model, tokenizer, clt)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with metered("cpu") as forward:
            run = replacement.run(ids)
            record["forward_graph"] = {
                "saved_mb": run.forward_bytes / 2**20,
                "decoder_rows_mb": run.decoder_bytes / 2**20,
                "attention_patterns_mb": run.pattern_bytes / 2**20,
                "active_features": run.n_features}
            # the planner's formulas (docs/attribution.md, "Memory on long prompts")
            parts = forward_parts(replacement.bound, clt, ids.shape[1],
                                  torch.bincount(run.feature_layer, minlength=run.n_layers))
            record["planned_mb"] = {
                **{k: v / 2**20 for k, v in parts.items()},
                "row": row_bytes(run) / 2**20,
                # the largest cones first: the bound for any order ranking may choose
                "store": store_bytes(run, args.budget, torch.argsort(
                    run.feature_layer * run.n_pos + run.feature_position, descending=True))
                / 2**20}
            del run
        record["forward_graph"]["live_peak_mb"] = forward.peak / 2**20
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    memory_mb = args.memory_mb
    if memory_mb is None and device.type == "cuda":  # the GPU's memory, as circuit-tracer's
        memory_mb = 0.97 * device_bytes(device) / 2**20
    memory = {} if memory_mb is None else {"memory_mb": memory_mb}
    record["memory_mb"] = memory_mb
    start = time.perf_counter()
    try:
        with metered("cpu") if device.type == "cpu" else contextlib.nullcontext() as report:
            graph = attribute(model, tokenizer, clt, prompt, ANSWER, max_feature_nodes=args.budget,
                              batch_size=args.batch, **memory)
    except MemoryCapError as error:
        return {**record, "error": str(error), "seconds": time.perf_counter() - start}
    if device.type == "cuda":
        torch.cuda.synchronize()
        record["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        record["peak_mb"] = report.peak / 2**20
        record["phases_mb"] = {name[5:]: {"start": p.start / 2**20, "peak": p.peak / 2**20,
                                          "transient": p.transient / 2**20, "count": p.count}
                               for name, p in report.phases.items()}
    closures = (graph.closures().abs() / graph.rows.targets.abs()).max()
    return {**record, "active_features": graph.n_features, "rows": graph.n_explored,
            "batch_used": graph.metadata["batch_size"], "seconds": graph.metadata["seconds"],
            "forward_mb": graph.metadata["forward_mb"], "rows_mb": graph.metadata["rows_mb"],
            "stored_entries": graph.rows.nnz, "target_closure": graph.closure.relative,
            "max_row_closure": float(closures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", default="64,128" if SMOKE else "2048,4096,8192")
    parser.add_argument("--shape", default="tiny" if SMOKE else "llama1b")
    parser.add_argument("--budget", type=int, default=50 if SMOKE else 7500)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--features-per-position", type=float, default=10.0)
    parser.add_argument("--memory-mb", type=float, default=None,
                        help="the planner's cap (default: 97%% of a GPU's memory; on the "
                        "CPU attribute()'s default)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.tokens = args.length
        print(json.dumps(one(args)))
        return
    results = []
    for tokens in args.tokens.split(","):
        cmd = [sys.executable, __file__, "--one", "--length", tokens, "--device", args.device,
               "--shape", args.shape, "--budget", str(args.budget),
               "--features-per-position", str(args.features_per_position)]
        cmd += [] if args.batch is None else ["--batch", str(args.batch)]
        cmd += [] if args.memory_mb is None else ["--memory-mb", str(args.memory_mb)]
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            results.append({"tokens": int(tokens), "exit": done.returncode,
                            "stderr": done.stderr[-2000:]})
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        if "error" in r:
            print(f"{tokens:>5} tokens: MemoryCapError: {r['error']}", flush=True)
            continue
        print(f"{tokens:>5} tokens: {r['active_features']:,} active, {r['rows']} rows (batch "
              f"{r['batch_used']}) in {r['seconds']['total']:.1f} s (forward "
              f"{r['seconds']['forward']:.1f}, ranking {r['seconds']['ranking']:.1f}), peak "
              f"+{r['peak_mb']:,.1f} MB, rows {r['rows_mb']:,.1f} MB, closure target "
              f"{r['target_closure']:.1e} rows {r['max_row_closure']:.1e}", flush=True)
        if "phases_mb" in r:
            print("       phases (MB at start / peak): " + ", ".join(
                f"{k} {v['start']:.1f}/{v['peak']:.1f}" for k, v in r["phases_mb"].items())
                + "; forward graph " + ", ".join(
                f"{k} {v:,.1f}" for k, v in r["forward_graph"].items()), flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
