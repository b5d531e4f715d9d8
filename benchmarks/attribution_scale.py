"""Attribution at published-transcoder density on long prompts: SmolLM2-135M with a synthetic
CLT (8,192 features per layer, thresholds calibrated so ~50 fire per layer and position — what
GemmaScope-style transcoders and the mntss CLTs fire), prompts of 32, 128 and 512 tokens,
feature-node budgets of 2,000 and 7,500.

    python benchmarks/attribution_scale.py --out benchmarks/results/attribution_scale_cpu.json

Each (length, budget) runs in a fresh process: seconds (forward, ranking, rows), rows/s, peak
RSS above the loaded model, the stored rows' size, and how the target splits between features
with rows, unexplored features, errors, tokens and constants; then pruning and the export. A
configuration that cannot fit ``--memory-mb`` reports the ``MemoryCapError`` it gets instead of
dying.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Our own text (facts of the kind known_1000 holds), repeated to the length wanted.
PARAGRAPH = (
    "Miles Davis was a jazz trumpeter who recorded Kind of Blue in New York. The Louvre is a "
    "museum in Paris that holds the Mona Lisa. Toyota is a car maker based in Japan, and "
    "Honda builds motorcycles there too. The Amazon river flows through Brazil into the "
    "Atlantic Ocean. Danielle Darrieux was a French actress whose mother tongue was French. "
    "The Space Needle stands in Seattle, a city in the state of Washington. Apple designs "
    "the iPhone in California, and Samsung makes phones in Korea. ")
QUESTION = " The Eiffel Tower is in the city of"
ANSWER = " Paris"


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_of(tokenizer, n_tokens: int) -> str:
    """A prompt of exactly ``n_tokens`` tokens ending with the Eiffel question."""
    tail = len(tokenizer(QUESTION)["input_ids"])
    text = PARAGRAPH * (n_tokens // 40 + 2)
    ids = tokenizer(text)["input_ids"][:n_tokens - tail]
    prompt = tokenizer.decode(ids) + QUESTION
    got = len(tokenizer(prompt)["input_ids"])
    if got != n_tokens:  # re-tokenisation at the seam can merge or split one piece
        ids = ids[:len(ids) - (got - n_tokens)]
        prompt = tokenizer.decode(ids) + QUESTION
    return prompt


def one(args) -> dict:
    import torch
    from synthetic_clt import synthetic_clt_for

    from pyvene_causaltrace.attribution import MemoryCapError, attribute
    from pyvene_causaltrace.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    clt = synthetic_clt_for(model, tokenizer, args.features, args.features_per_position,
                            prompt_of(tokenizer, 128), source="synthetic smollm2 CLT")
    prompt = prompt_of(tokenizer, args.tokens)
    base = rss_mb()
    record = {"tokens": args.tokens, "budget": args.budget, "memory_mb": args.memory_mb,
              "model_and_clt_mb": base}
    start = time.perf_counter()
    try:
        graph = attribute(model, tokenizer, clt, prompt, ANSWER,
                          max_feature_nodes=args.budget, memory_mb=args.memory_mb)
    except MemoryCapError as error:
        return {**record, "error": str(error), "seconds": time.perf_counter() - start,
                "peak_extra_mb": rss_mb() - base}
    seconds = graph.metadata["seconds"]
    rows = graph.n_explored
    parts = graph.decomposition()
    start_read = time.perf_counter()
    pruned = graph.prune()
    prune_s = time.perf_counter() - start_read
    out = Path(args.scratch) / f"graph-{args.tokens}-{args.budget}.json"
    start_read = time.perf_counter()
    graph.to_json(out)
    export_s = time.perf_counter() - start_read
    size_mb = out.stat().st_size / 2**20
    out.unlink()
    return {**record, "active_features": graph.n_features,
            "features_per_layer_position": graph.n_features / (graph.n_layers
                                                               * (graph.n_pos - 1)),
            "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds["rows"],
            "peak_extra_mb": rss_mb() - base, "forward_mb": graph.metadata["forward_mb"],
            "stored_rows_mb": graph.metadata["rows_mb"], "stored_entries": graph.rows.nnz,
            "target": parts["target"],
            "share": {k: parts[k] / parts["target"]
                      for k in ("features", "unexplored", "errors", "tokens", "constants")},
            "max_row_closure": float((graph.closures().abs()
                                      / graph.rows.targets.abs()).max()),
            "pruned_nodes": pruned.n_nodes, "pruned_edges": pruned.n_edges,
            "prune_s": prune_s, "export_s": export_s, "json_mb": size_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="32,128,512")
    parser.add_argument("--budgets", default="2000,7500")
    parser.add_argument("--memory-mb", type=float, default=16000)
    parser.add_argument("--features", type=int, default=8192)
    parser.add_argument("--features-per-position", type=float, default=50.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=2000, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default="/tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    results = []
    for tokens in args.lengths.split(","):
        for budget in args.budgets.split(","):
            cmd = [sys.executable, __file__, "--one", "--tokens", tokens, "--budget", budget,
                   "--memory-mb", str(args.memory_mb), "--features", str(args.features),
                   "--features-per-position", str(args.features_per_position)]
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{tokens} tokens, budget {budget}: exit {done.returncode}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            if "error" in r:
                print(f"{tokens:>4} tok budget {budget:>5}: MemoryCapError: {r['error']}",
                      flush=True)
                continue
            s = r["share"]
            print(f"{tokens:>4} tok budget {budget:>5}: {r['active_features']:>7} active "
                  f"({r['features_per_layer_position']:.1f}/layer/pos), {r['rows']} rows in "
                  f"{r['seconds']['total']:.0f} s (forward {r['seconds']['forward']:.0f}, "
                  f"ranking {r['seconds']['ranking']:.0f}, rows {r['seconds']['rows']:.0f}; "
                  f"{r['rows_per_s']:.1f} rows/s), peak +{r['peak_extra_mb']:,.0f} MB, rows "
                  f"{r['stored_rows_mb']:,.0f} MB; target {r['target']:.3f}: rows "
                  f"{s['features']:+.3f} unexplored {s['unexplored']:+.3f} errors "
                  f"{s['errors']:+.3f} tokens {s['tokens']:+.3f}; closure "
                  f"{r['max_row_closure']:.1e}; pruned {r['pruned_nodes']} nodes "
                  f"{r['pruned_edges']} edges ({r['prune_s']:.1f} s), JSON "
                  f"{r['json_mb']:.1f} MB", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
