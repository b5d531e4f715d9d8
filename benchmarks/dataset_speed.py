"""Dataset throughput: facts per minute for a residual trace with 3 seeds, side by side with
ROME's method and the batch-1 loop on the same facts; how time per fact grows with prompt
length and with the memory budget; and that memory stays flat as the dataset grows.

    python benchmarks/dataset_speed.py                         # SmolLM2 on CPU (~15 min)
    python benchmarks/dataset_speed.py --synthetic llama1b --device cuda --skip-loop
        # a random-init model of Llama-3.2-1B's shape with a small BPE tokenizer (GPU check)

Parts (all on the first facts of known_1000, screened with ``known="none"`` so every model
sees the same prompts):

1. ``trace_dataset`` end to end on ``--facts`` facts: facts per minute.
2. Per fact, our engine vs ROME's method (one batch-(S+1) forward per (layer, position) cell,
   from ``benchmarks/trace_speed.py``) vs the batch-1 loop (``--loop-facts`` facts).
3. Seconds per fact by prompt length, and by ``memory_budget_mb``.
4. Peak resident memory of ``trace_dataset`` runs over growing numbers of facts (each in a
   fresh process), and the aggregator's Python heap over growing numbers of synthetic rows.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_trace import LLAMA_3_2_1B  # noqa: E402
from trace_speed import batch1_loop, rome_method  # noqa: E402

from pyvene_causaltrace.dataset import aggregate_rows, read_records, trace_dataset  # noqa: E402
from pyvene_causaltrace.tracing import Tracer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KNOWN = next(p for p in (ROOT.parent / "shared" / "data" / "known_1000.json",
                         ROOT / ".devdata" / "known_1000.json") if p.exists())
SYNTHETIC = {"llama1b": LLAMA_3_2_1B,
             "tiny": dict(vocab_size=8000, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16)}


def load(args):
    if not args.synthetic:
        from pyvene_causaltrace.models import load_model

        return load_model(args.model)
    import transformers as tf
    from synthetic_clt import known_facts_tokenizer

    tokenizer = known_facts_tokenizer()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    config = tf.LlamaConfig(**SYNTHETIC[args.synthetic])
    model = tf.LlamaForCausalLM(config).to(args.device, dtype).eval()
    model.pvct_source = f"random-init {args.synthetic} shape"
    return model, tokenizer


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - start, value


def per_fact(model, tokenizer, record, seeds, budget, method):
    tracer = Tracer(model, tokenizer, record.prompt, record.subject, answer=record.target,
                    seeds=seeds, scale=3.0, sigma=0.1, memory_budget_mb=budget)
    cells = tracer.cells()
    if method == "engine":
        return tracer.trace("residual", progress=False).restored_probs
    ids = tracer.prompt.input_ids.to(next(model.parameters()).device)
    if method == "rome":
        return rome_method(model, ids, tracer.noise_positions, seeds, 3.0, 0.1,
                           tracer.answer_id, cells)
    return batch1_loop(model, ids, len(cells) * len(seeds))


def peak_rss_mb(n_facts: int, args) -> float:
    """Peak RSS of a fresh process that runs ``trace_dataset`` over ``n_facts`` facts."""
    code = f"""
import resource, sys, tempfile
sys.argv = {[sys.argv[0], "--model", args.model]}
sys.path.insert(0, {str(Path(__file__).parent)!r})
import dataset_speed as b
from pyvene_causaltrace.dataset import read_records, trace_dataset
args = b.parse([*sys.argv[1:]])
model, tok = b.load(args)
records, _ = read_records(b.KNOWN)
trace_dataset(model, tok, records, out=tempfile.mkdtemp(), limit={n_facts}, kinds=["residual"],
              seeds=1, known="none", progress=False, n_boot=100)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip().splitlines()[-1])


def aggregator_heap_mb(n_facts: int, n_layers: int = 30, n_tokens: int = 12) -> float:
    rng = np.random.default_rng(0)

    def rows():
        for f in range(n_facts):
            for seed in range(3):
                yield {"index": f, "fact": str(f), "kind": "residual", "seed": seed,
                       "subject_range": [0, 3], "clean": 0.5, "corrupt": 0.1,
                       "restored": rng.random((n_layers, n_tokens)).tolist()}

    tracemalloc.start()
    aggregate_rows(rows(), kinds=["residual"], n_boot=200)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                        help="a random-init model of this shape instead of --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--facts", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--compare-facts", type=int, default=3)
    parser.add_argument("--loop-facts", type=int, default=1)
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--end-to-end-only", action="store_true",
                        help="part 1 only (e.g. to compare two versions of the package)")
    parser.add_argument("--budgets", default="256,1024,4096")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    model, tokenizer = load(args)
    device = next(model.parameters()).device
    records, _ = read_records(KNOWN)
    seeds = list(range(args.seeds))
    budget = 16384.0 if str(device).startswith("cuda") else 2048.0
    report: dict = {"model": getattr(model, "pvct_source", args.model), "device": str(device),
                    "seeds": args.seeds}

    # 1. end to end
    with tempfile.TemporaryDirectory() as out:
        seconds, _ = timed(lambda: trace_dataset(
            model, tokenizer, records, out=out, limit=args.facts, kinds=["residual"],
            seeds=seeds, known="none", progress=False, memory_budget_mb=budget, n_boot=200),
            device)
    report["end_to_end"] = {"facts": args.facts, "seconds": seconds,
                            "facts_per_minute": 60 * args.facts / seconds}
    print(f"trace_dataset, residual, {args.seeds} seeds: {args.facts} facts in {seconds:.1f} s "
          f"= {60 * args.facts / seconds:.2f} facts/min")
    if args.end_to_end_only:
        return

    # 2. engine vs ROME's method vs batch-1 loop, same facts
    methods = ["engine", "rome"] + ([] if args.skip_loop else ["loop"])
    sample = records[:args.compare_facts]
    rows, probs = [], {}
    for method in methods:
        chosen = sample[:args.loop_facts] if method == "loop" else sample
        total = 0.0
        for record in chosen:
            t, value = timed(
                lambda r=record, m=method: per_fact(model, tokenizer, r, seeds, budget, m),
                device)
            probs.setdefault(method, []).append(value)
            total += t
        rows.append((method, len(chosen), total / len(chosen)))
    diff = max(float((torch.as_tensor(e).reshape(len(seeds), -1).double()
                      - r.double().cpu()).abs().max())
               for e, r in zip(probs["engine"], probs["rome"], strict=True))
    print(f"engine vs ROME's method on {len(sample)} facts: max |P difference| {diff:.2e}")
    report["engine_vs_rome_max_abs"] = diff
    engine_s = rows[0][2]
    print(f"\n{'method':<10} {'facts':>5} {'s/fact':>8} {'vs engine':>9}")
    for method, n, s in rows:
        print(f"{method:<10} {n:>5} {s:>8.2f} {s / engine_s:>8.2f}x")
    report["per_fact"] = [{"method": m, "facts": n, "seconds_per_fact": s} for m, n, s in rows]

    # 3. prompt length and memory budget
    by_length: dict[int, list[float]] = {}
    for record in records[:args.facts]:
        tracer = Tracer(model, tokenizer, record.prompt, record.subject, answer=record.target,
                        seeds=seeds, scale=3.0, sigma=0.1, memory_budget_mb=budget)
        t, _ = timed(lambda tr=tracer: tr.trace("residual", progress=False), device)
        by_length.setdefault(tracer.prompt.seq_len, []).append(t)
    print(f"\n{'tokens':>6} {'facts':>5} {'s/fact':>8}")
    for n_tok in sorted(by_length):
        print(f"{n_tok:>6} {len(by_length[n_tok]):>5} {np.mean(by_length[n_tok]):>8.2f}")
    report["by_length"] = {k: float(np.mean(v)) for k, v in sorted(by_length.items())}
    budgets = [float(b) for b in args.budgets.split(",")]
    print(f"\n{'budget MB':>9} {'s/fact':>8}")
    report["by_budget"] = {}
    for b in budgets:
        t = np.mean([timed(lambda r=r, b=b: per_fact(model, tokenizer, r, seeds, b, "engine"),
                           device)[0] for r in sample])
        report["by_budget"][b] = float(t)
        print(f"{b:>9.0f} {t:>8.2f}")

    # 4. memory as the dataset grows
    if not args.skip_memory:
        print(f"\n{'facts':>6} {'peak RSS MB':>11}   (trace_dataset, fresh process)")
        report["rss"] = {}
        for n in (2, 8, 32):
            rss = peak_rss_mb(n, args)
            report["rss"][n] = rss
            print(f"{n:>6} {rss:>11.0f}")
        print(f"\n{'facts':>6} {'heap MB':>8}   (aggregating 3 seeds x 30 layers x 12 tokens)")
        report["aggregator_heap"] = {}
        for n in (100, 1000, 5000):
            heap = aggregator_heap_mb(n)
            report["aggregator_heap"][n] = heap
            print(f"{n:>6} {heap:>8.1f}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"(this process's peak RSS {rss:.0f} MB)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
