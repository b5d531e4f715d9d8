"""Two checkouts of the package side by side in one run: the public ``Tracer(...).trace()`` and
``attribute()`` timed on the same workloads, each repeat running the two trees in turn in fresh
processes (old, new, old, new, ...), so a drift in the machine's load hits both alike.

    python benchmarks/core_before_after.py --old /path/to/old/checkout [--repeats 3]

Workloads (public API only, so any commit runs them):
- ``trace tiny``: a residual trace of the Eiffel prompt, 10 seeds, on a random 8-layer Llama
  (hidden 64), where fixed per-call costs (checks, binding, planning) weigh most;
- ``trace smollm2``: the same on SmolLM2-135M-Instruct, 10 seeds;
- ``attribute smollm2``: a graph of a 32-token prompt on SmolLM2 with a synthetic CLT of 2,048
  features per layer (~20 firing per position), 300 feature rows.

Each child process loads its model once, warms up with one call, then times one call per
workload (``time.perf_counter``); the table gives each tree's median and the new/old ratio of
medians. ``--json`` writes every second measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("trace tiny", "trace smollm2", "attribute smollm2")


def child(workload: str, tree: Path) -> float:
    """Seconds of one timed call of ``workload`` with the package of ``tree`` (in this
    process)."""
    sys.path[:0] = [str(tree), str(tree / "benchmarks"), str(tree / "tests")]
    import torch

    import pyvene_causaltrace as pvct

    assert Path(pvct.__file__).resolve().parent == (tree / "pyvene_causaltrace").resolve()
    torch.manual_seed(0)
    prompt, subject = "The Eiffel Tower is in the city of", "The Eiffel Tower"
    if workload == "trace tiny":
        import transformers as tf
        from _support.models import make_tokenizer
        config = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256,
                                num_hidden_layers=8, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=256)
        model = tf.AutoModelForCausalLM.from_config(config).eval()
        tokenizer = make_tokenizer()
    else:
        model, tokenizer = pvct.load_model("smollm2-135m")
    if workload.startswith("trace"):
        def call():
            pvct.trace(model, tokenizer, prompt, subject, seeds=10, progress=False)
    else:
        from attribution_scale import prompt_of
        from synthetic_clt import synthetic_clt_for

        from pyvene_causaltrace.attribution import attribute
        long_prompt = prompt_of(tokenizer, 32)
        clt = synthetic_clt_for(model, tokenizer, 2048, 20, long_prompt)

        def call():
            attribute(model, tokenizer, clt, long_prompt, " Paris", max_feature_nodes=300,
                      batch_size=32)
    call()  # warm-up: lazy imports, first-use caches, the allocator
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", type=Path, help="the checkout to compare against")
    parser.add_argument("--new", type=Path, default=HERE.parent)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "TREE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]))))
        return
    workloads = args.workloads.split(",")
    seconds = {w: {"old": [], "new": []} for w in workloads}
    env = {**os.environ, "PYTHONPATH": ""}
    for repeat in range(args.repeats):
        for workload in workloads:
            for side in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                tree = (args.old if side == "old" else args.new).resolve()
                out = subprocess.run([sys.executable, __file__, "--child", workload, str(tree)],
                                     capture_output=True, text=True, env=env, check=True)
                value = json.loads(out.stdout.strip().splitlines()[-1])
                seconds[workload][side].append(value)
                print(f"repeat {repeat}: {workload} {side} {value:.3f} s", flush=True)
    print("\n| workload | old median s | new median s | new / old |\n|---|---|---|---|")
    for workload in workloads:
        old, new = (statistics.median(seconds[workload][s]) for s in ("old", "new"))
        print(f"| {workload} | {old:.3f} | {new:.3f} | {new / old:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"old": str(args.old), "new": str(args.new),
                                         "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
