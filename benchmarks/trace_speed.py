"""Full residual causal trace, side by side in one process, on SmolLM2 (the Eiffel prompt) and on a
tiny random Llama (8 layers, hidden 64: where fixed costs per forward and per layer dominate, the
CPU's stand-in for a GPU):

- ``rome``: ROME's method, one forward of batch S+1 per (layer, position) cell: row 0 clean,
  rows 1..S noised, a plain PyTorch hook copies row 0's state into the others;
- ``plain``: the same S x L x T rows as plain batched forwards with no intervention at all (the
  floor for computing every row in full);
- the engine three ways: full rows; the corrupted prefix reused (positions before the restored
  one from the KV cache); and the default, which also starts each row at its restored layer;
- ``loop`` (``--loop``): one batch-1 forward per row.

All compute only the last position's logits. Prints a table of seconds and ratios per model and
checks the engine against ROME's method on every cell.

    python benchmarks/trace_speed.py --seeds 10 [--models smollm2,tiny] [--loop]
"""

from __future__ import annotations

import argparse
import time

import torch

from pyvene_causaltrace.models import get_adapter, get_module, load_model
from pyvene_causaltrace.prompts import answer_token_id, tokenize_prompt
from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine
from pyvene_causaltrace.tracing.noise_scale import rome_sigma

PROMPT, SUBJECT, ANSWER = "The Eiffel Tower is in the city of", "The Eiffel Tower", " Paris"
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def recipe(seed, n, hidden, scale, sigma):
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((n, hidden), generator=g, dtype=torch.float32) * scale * sigma


def rome_method(model, ids, subject, seeds, scale, sigma, answer_id, cells):
    """One forward of batch S+1 per cell, plain hooks (ROME's trace_with_patch)."""
    adapter = get_adapter(model)
    hidden = adapter.hidden_size(model)
    noise = torch.stack([recipe(s, len(subject), hidden, scale, sigma) for s in seeds])
    embed = get_module(model, adapter.embed)
    batch = ids.repeat(len(seeds) + 1, 1)
    out = torch.empty(len(seeds), len(cells), dtype=torch.float64)

    def add_noise(_m, _a, output):
        output = output.clone()
        output[1:, subject] += noise.to(output.device, output.dtype)
        return output

    handle = embed.register_forward_hook(add_noise)
    try:
        for index, (layer, position) in enumerate(cells):
            block = get_module(model, adapter.module_path("block", layer))

            def patch(_m, _a, output, _p=position):
                h = output[0] if isinstance(output, tuple) else output
                h[1:, _p] = h[0, _p]
                return output

            h2 = block.register_forward_hook(patch)
            with torch.no_grad():
                logits = model(input_ids=batch, logits_to_keep=1).logits[1:, -1]
            h2.remove()
            out[:, index] = logits.double().softmax(-1)[:, answer_id]
    finally:
        handle.remove()
    return out


def plain_rows(model, ids, n_rows, chunk):
    with torch.no_grad():
        for start in range(0, n_rows, chunk):
            model(input_ids=ids.repeat(min(chunk, n_rows - start), 1), logits_to_keep=1)


def batch1_loop(model, ids, n_rows):
    with torch.no_grad():
        for _ in range(n_rows):
            model(input_ids=ids, logits_to_keep=1)


def setup(name):
    """(model, input ids, subject positions, sigma, answer id) of one benchmark model."""
    if name == "smollm2":
        model, tokenizer = load_model("smollm2-135m")
        prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
        return (model, prompt.input_ids, list(range(*prompt.subject_range)),
                rome_sigma(model, tokenizer, [SUBJECT]), answer_token_id(tokenizer, ANSWER))
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**TINY), dtype=torch.float32)
    ids = torch.randint(1, TINY["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    return model.eval(), ids, [1, 2, 3], 0.5, 7


ENGINES = {"engine_full": dict(reuse_prefix=False, replay_layers=False),
           "engine_prefix": dict(reuse_prefix=True, replay_layers=False),
           "engine": dict(reuse_prefix=True, replay_layers=True)}
NAMES = {"loop": "batch-1 loop", "rome": "(a) ROME: batch S+1 per cell",
         "plain": "(b) plain batched forwards", "engine_full": "engine, full rows",
         "engine_prefix": "engine, corrupted prefix reused",
         "engine": "engine, + rows start at restored layer"}


def bench(name, args):
    model, ids, subject, sigma, answer = setup(name)
    seeds = list(range(args.seeds))
    n_layers = get_adapter(model).n_layers(model)
    cells = [(layer, pos) for layer in range(n_layers) for pos in range(ids.shape[1])]
    n_rows = len(cells) * len(seeds)
    repeats = args.repeats if args.repeats else (1 if name == "smollm2" else 5)
    print(f"\n== {name}: {n_layers} layers x {ids.shape[1]} positions x {len(seeds)} seeds = "
          f"{n_rows} rows; torch threads {torch.get_num_threads()}; best of {repeats}")

    def engine(options):
        made = TraceEngine(model, ids, subject, seeds, args.scale, sigma, answer,
                           memory_budget_mb=args.budget_mb, **options)
        return made.run(KINDS["residual"], cells)

    chunk = TraceEngine(model, ids, subject, seeds, args.scale, sigma, answer,
                        memory_budget_mb=args.budget_mb).rows_per_chunk(0)
    methods = {"rome": lambda: rome_method(model, ids, subject, seeds, args.scale, sigma,
                                           answer, cells),
               "plain": lambda: plain_rows(model, ids, n_rows, chunk),
               **{key: (lambda o=options: engine(o)) for key, options in ENGINES.items()}}
    if args.loop:
        methods["loop"] = lambda: batch1_loop(model, ids, n_rows)
    seconds, values = {}, {}
    for _ in range(repeats):  # interleaved, so that drift hits every method alike
        for key, method in methods.items():
            start = time.perf_counter()
            values[key] = method()
            took = time.perf_counter() - start
            seconds[key] = min(seconds.get(key, took), took)
    for key in ENGINES:
        print(f"max |{key} - rome| over {values['rome'].numel()} cells: "
              f"{(values[key] - values['rome']).abs().max():.2e}")
    print(f"\n{'method':<40} {'seconds':>8} {'vs rome':>8} {'vs plain':>9}")
    for key in ("loop", "rome", "plain", *ENGINES):
        if key in seconds:
            t = seconds[key]
            print(f"{NAMES[key]:<40} {t:>8.3f} {t / seconds['rome']:>8.3f} "
                  f"{t / seconds['plain']:>9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,tiny")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--budget-mb", type=float, default=2048)
    parser.add_argument("--repeats", type=int, default=0, help="default: 1 SmolLM2, 5 tiny")
    parser.add_argument("--loop", action="store_true", help="also time the batch-1 loop")
    args = parser.parse_args()
    for name in args.models.split(","):
        bench(name, args)


if __name__ == "__main__":
    main()
