"""Kernel launches per chunk of a residual trace, on the CPU: the aten ops the trace engine
dispatches per chunk forward against a plain forward of the same batch (each non-view op is at
least one kernel launch on CUDA), split by where they come from; and the time split of the
public ``trace()`` (the model's forwards, our Python, the plain floor).

    python benchmarks/trace_launches.py                       # ops: tiny, llama1b; times
    python benchmarks/trace_launches.py --shapes tiny,llama1b,smollm2,qwen3_8b --no-times
    python benchmarks/trace_launches.py --device cuda --times-only --time-models llama1b
    SMOKE=1 python benchmarks/trace_launches.py               # tiny shapes, a few seconds

Origins (``tests/_support/ops.py``): the model's own (transformers' modules, its KV cache) and
ours (``restore``: restore and freeze interventions; ``noise``; ``readout``: P(answer) from the
logits; ``replay``: stored rows of lower layers; ``hooks``: the applier; ``chunk``: the
engine's per-chunk masks and gathers); ``between``: the engine's work outside chunk forwards
(planning included). ``launches`` leaves out view ops (no kernel). On the CPU the restore's
emptiness check (``any`` and its read, 2 per restored layer) runs; on a GPU it does not.
Op counts do not depend on the width, so a real shape's layers and heads are built at
``--width`` (the script checks that twice the width counts the same), its chunks planned as the
engine plans them at the real width in bf16 on a GPU (``--budget-mb``, as gpu_trace.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import transformers as tf

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]

from _support.ops import OURS, OpCounter, per_chunk, plain_forward  # noqa: E402

from pyvene_causaltrace.tracing.chunks import ChunkCost  # noqa: E402
from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine  # noqa: E402

SMOKE = os.environ.get("SMOKE") == "1"
LLAMA = dict(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             tie_word_embeddings=True)  # Llama-3.2-1B's layers and heads
SHAPES = {
    "tiny": (tf.LlamaConfig, dict(num_hidden_layers=8, num_attention_heads=4,
                                  num_key_value_heads=2)),  # trace_speed.py's tiny Llama
    "llama1b": (tf.LlamaConfig, LLAMA),
    "smollm2": (tf.LlamaConfig, dict(num_hidden_layers=30, num_attention_heads=9,
                                     num_key_value_heads=3, tie_word_embeddings=True)),
    "qwen3_8b": (tf.Qwen3Config, dict(num_hidden_layers=36, num_attention_heads=32,
                                      num_key_value_heads=8, tie_word_embeddings=False)),
}
def model_of(shape: str, width: int, vocab: int):
    """Random-init model of ``shape``'s layers and heads at ``width`` (head_dim width / heads,
    at least 2; MLP 2x width)."""
    config_class, fields = SHAPES[shape]
    heads = fields["num_attention_heads"]
    head_dim = 2 * max(1, width // (2 * heads))  # even: rotary embeddings
    config = config_class(vocab_size=vocab, hidden_size=head_dim * heads,
                          intermediate_size=2 * head_dim * heads, head_dim=head_dim,
                          max_position_embeddings=256, **fields)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def real_plan(shape: str, tokens: int, budget_mb: float):
    """(cost, rows per chunk) the engine would plan with at ``shape``'s real width in bf16 on a
    GPU (gpu_trace.py's shapes; built on the meta device), so that every width plans alike."""
    import gpu_trace  # its real shapes; it imports transformers' configs on load

    name = {"tiny": None, "smollm2": None}.get(shape, shape)
    if name is None:  # trace_speed.py's tiny and SmolLM2-135M's width
        config_class, fields = SHAPES[shape]
        width = {"tiny": (64, 256, 512, 16), "smollm2": (576, 1536, 49152, 64)}[shape]
        config = config_class(hidden_size=width[0], intermediate_size=width[1],
                              vocab_size=width[2], head_dim=width[3], **fields)
    else:
        config_class, fields = gpu_trace.SHAPES[name]
        config = config_class(**fields)
    with torch.device("meta"):
        real = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layer = list(real.model.layers[0].parameters())
    head = real.get_output_embeddings().weight
    cost = ChunkCost.estimate("cuda", layer_bytes=sum(p.numel() * 2 for p in layer),
                              layer_flops=2 * sum(p.numel() for p in layer),
                              head_bytes=head.numel() * 2)
    shape_ = types.SimpleNamespace(
        bound=types.SimpleNamespace(d_model=config.hidden_size, d_mlp=config.intermediate_size,
                                    vocab_size=config.vocab_size),
        _kv=[(torch.empty(1, config.num_key_value_heads, 0, config.head_dim, device="meta"),
              None)],
        n_layers=config.num_hidden_layers, seq_len=tokens, memory_budget_mb=budget_mb)
    return cost, lambda prefix: TraceEngine.rows_per_chunk(shape_, prefix)


def count_trace(model, ids, subject, seeds, plan=None, answer=7) -> dict:
    """Ops of one residual engine run: per chunk forward (model / ours by origin), between
    chunks, and one plain forward of each chunk's batch. ``plan``: (cost, rows per chunk) to
    plan with instead of the engine's own."""
    engine = TraceEngine(model, ids, subject, seeds, 3.0, 0.5, answer)
    if plan is not None:
        engine.cost, engine.rows_per_chunk = plan
    cells = [(layer, pos) for layer in range(engine.n_layers) for pos in range(ids.shape[1])]
    with OpCounter() as whole:
        chunks = [{"rows": chunk.rows.numel(), "prefix": chunk.prefix,
                   "first_layer": chunk.first_layer, "counts": counter.counts}
                  for chunk, counter in per_chunk(engine, KINDS["residual"], cells)]
    plain = {n: plain_forward(model, ids, n).counts  # (the run's hooks are off now)
             for n in sorted({chunk["rows"] for chunk in chunks})}
    total = collections.Counter()
    for chunk in chunks:
        total.update(chunk["counts"])
    between = whole.counts - total
    n_chunks = len(chunks)

    def average(counts, launch=None, origins=None):
        return sum(v for (o, is_launch), v in counts.items()
                   if (launch is None or is_launch == launch)
                   and (origins is None or o in origins)) / max(1, n_chunks)

    plain_counts = {n: sum(v for (_, launch), v in c.items() if launch) for n, c in plain.items()}
    plain_ops = {n: sum(c.values()) for n, c in plain.items()}
    rows = sum(chunk["rows"] for chunk in chunks)
    found = {
        "layers": engine.n_layers, "tokens": int(ids.shape[1]), "seeds": len(seeds),
        "rows_forwarded": rows, "chunks": n_chunks,
        "per_chunk": {
            origin_: {"ops": average(total, None, (origin_,)),
                      "launches": average(total, True, (origin_,))}
            for origin_ in ("model", *OURS, "other")},
        "ours_per_chunk": {"ops": average(total, None, OURS),
                           "launches": average(total, True, OURS)},
        "between_per_chunk": {"ops": average(between), "launches": average(between, True)},
        "plain_forward": {"ops": max(plain_ops.values()), "launches": max(plain_counts.values()),
                          "same_at_every_batch": len(set(plain_counts.values())) == 1},
    }
    found["ours_per_chunk_per_layer"] = {
        key: value / engine.n_layers for key, value in found["ours_per_chunk"].items()}
    found["engine_launches"] = (sum(v for (o, launch), v in whole.counts.items() if launch))
    # the floor: every row (skipped ones too) as plain forwards at the engine's rows per forward
    found["floor_forwards"] = -(-len(cells) * len(seeds) // engine.rows_per_chunk(0))
    return found


def print_counts(name: str, found: dict) -> None:
    print(f"\n== {name}: {found['layers']} layers x {found['tokens']} tokens x {found['seeds']} "
          f"seeds: {found['rows_forwarded']} rows forwarded in {found['chunks']} chunks")
    print(f"{'per chunk forward':<28} {'aten ops':>9} {'launches':>9}")
    for origin_, value in found["per_chunk"].items():
        if value["ops"]:
            print(f"  {origin_:<26} {value['ops']:>9.1f} {value['launches']:>9.1f}")
    ours, layer = found["ours_per_chunk"], found["ours_per_chunk_per_layer"]
    print(f"{'ours, per chunk':<28} {ours['ops']:>9.1f} {ours['launches']:>9.1f}")
    print(f"{'ours, per chunk and layer':<28} {layer['ops']:>9.2f} {layer['launches']:>9.2f}")
    between = found["between_per_chunk"]
    print(f"{'between chunks, per chunk':<28} {between['ops']:>9.1f} {between['launches']:>9.1f}")
    plain = found["plain_forward"]
    print(f"{'plain forward (same batch)':<28} {plain['ops']:>9} {plain['launches']:>9}"
          f"{'' if plain['same_at_every_batch'] else '  (differs by batch: max shown)'}")
    engine_launches = found["engine_launches"]
    floor = plain["launches"] * found["chunks"]
    floor_launches = plain["launches"] * found["floor_forwards"]
    print(f"launches in the whole engine run {engine_launches}; as many plain forwards as "
          f"chunks {floor} ({engine_launches / floor:.2f}x); the floor's "
          f"{found['floor_forwards']} forwards {floor_launches} "
          f"({engine_launches / floor_launches:.2f}x)")


def ops(args) -> dict:
    found = {}
    tokens, seeds = (7, [0, 1]) if SMOKE else (args.tokens, list(range(args.seeds)))
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        widths = (args.width, 2 * args.width)
        ids = torch.randint(args.vocab, (1, tokens), generator=generator)
        per_width = []
        for width in widths:
            model = model_of(shape, width, args.vocab)
            plan = real_plan(shape, tokens, args.budget_mb)
            per_width.append(count_trace(model, ids, list(range(1, 4)), seeds, plan))
        a, b = per_width
        same = (a["per_chunk"], a["plain_forward"]) == (b["per_chunk"], b["plain_forward"])
        print_counts(f"{shape} at width {widths[0]}", a)
        print(f"width {widths[1]} gives the same counts per chunk: {same}")
        found[shape] = {**a, "same_at_double_width": same}
    return found


def timed_model(name: str, device: str):
    """(model, tokenizer, prompt, subject, answer) for the time split."""
    from trace_speed import ANSWER, PROMPT, SUBJECT, setup, tiny_tokenizer  # the timed models

    if name == "smollm2":
        from pyvene_causaltrace.models import load_model  # SmolLM2 only: the bundled weights

        model, tokenizer = load_model("smollm2-135m")
        return model.to(device), tokenizer, PROMPT, SUBJECT, ANSWER
    if name == "tiny":
        model = setup("tiny")[0]
        return model.to(device), tiny_tokenizer(), PROMPT, SUBJECT, " city"
    import gpu_trace  # the real shapes, built at full width on the device

    config_class, shape = gpu_trace.SHAPES[name]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config_class(**shape), dtype=dtype).eval()
    return model, tiny_tokenizer(), PROMPT, SUBJECT, " city"


def time_split(name: str, args) -> dict:
    """Seconds of the public ``trace()`` split into the model's forwards (chunks, reference
    runs), our hooks inside them, and the rest (our Python: planning, masks, readouts); and the
    plain floor: the same rows as plain forwards at its best batch. On the CPU the clock is
    this process's CPU time (run with one torch thread: a busy machine's other work does not
    count); on CUDA wall time between synchronizations."""
    from trace_speed import plain_rows  # the floor as trace_speed.py runs it

    from pyvene_causaltrace import applier, trace  # the public call, and its hook runner timed

    cuda = args.device.startswith("cuda")
    clock = time.perf_counter if cuda else time.process_time
    model, tokenizer, prompt, subject, answer = timed_model(name, args.device)
    seeds = 2 if SMOKE else args.seeds

    def sync():
        if cuda:
            torch.cuda.synchronize()

    spent = collections.Counter()
    own_call, own_run = type(model).__call__, applier._Applier._run

    def model_call(self, *a, **k):
        sync()
        start = clock()
        try:
            return own_call(self, *a, **k)
        finally:
            sync()
            spent["forward"] += clock() - start

    def hook_run(hook, value, call):
        start = clock()
        try:
            return own_run(hook, value, call)
        finally:
            spent["hooks"] += clock() - start

    def public():
        return trace(model, tokenizer, prompt, subject, answer=answer, seeds=seeds,
                     progress=False)

    result = public()  # warm-up
    n_rows = result.restored_probs.size
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(args.device)
    repeats = 1 if SMOKE else args.repeats
    batches = [int(b) for b in args.floor_batches.split(",")]
    floor = {}
    for batch in batches:
        sync()
        start = clock()
        plain_rows(model, ids, n_rows, batch)
        sync()
        floor[batch] = clock() - start
    best = min(floor, key=floor.get)
    runs = []
    for _ in range(repeats):
        spent.clear()
        type(model).__call__, applier._Applier._run = model_call, staticmethod(hook_run)
        try:
            sync()
            start = clock()
            public()
            sync()
            total = clock() - start
        finally:
            type(model).__call__, applier._Applier._run = own_call, staticmethod(own_run)
        sync()
        start = clock()
        plain_rows(model, ids, n_rows, best)
        sync()
        plain = clock() - start
        runs.append({"trace": total, "forwards": spent["forward"], "hooks": spent["hooks"],
                     "plain": plain})
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    engine_model = median["forwards"] - median["hooks"]
    python = median["trace"] - engine_model
    print(f"\n== time split, {name} on {args.device}: {n_rows} rows, {seeds} seeds, median of "
          f"{repeats}; floor at {best} rows per forward")
    ratio = median["trace"] / median["plain"]
    print(f"  public trace()            {median['trace']:.4f} s ({ratio:.3f}x the floor)")
    print(f"  model forwards inside it  {engine_model:.4f} s (our hooks taken out)")
    print(f"  our Python                {python:.4f} s (hooks {median['hooks']:.4f} s; planning, "
          "masks, readouts, reference runs' bookkeeping)")
    print(f"  plain floor               {median['plain']:.4f} s")
    return {"rows": n_rows, "floor_batch": best, "median_s": median, "runs": runs,
            "model_s": engine_model, "python_s": python,
            "trace_vs_floor": median["trace"] / median["plain"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="tiny,llama1b")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=11)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget-mb", type=float, default=16384,
                        help="the memory budget the real shapes' chunks are planned with")
    parser.add_argument("--time-models", default="tiny,smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor-batches", default="64,128,256,512")
    parser.add_argument("--no-times", action="store_true")
    parser.add_argument("--times-only", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if SMOKE:
        args.shapes, args.time_models, args.floor_batches = "tiny", "tiny", "64"
    found = {}
    if not args.times_only:
        found["ops"] = ops(args)
    if not args.no_times:
        found["times"] = {name: time_split(name, args) for name in args.time_models.split(",")}
    print(json.dumps(found, default=str))
    if args.json:
        args.json.write_text(json.dumps(found, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
