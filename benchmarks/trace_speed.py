"""Full residual causal trace, side by side in one process, on SmolLM2 (the Eiffel prompt) and on a
tiny random Llama (8 layers, hidden 64: where fixed costs per forward and per layer dominate, the
CPU's stand-in for a GPU):

- ``rome``: ROME's method, one forward of batch S+1 per (layer, position) cell: row 0 clean,
  rows 1..S noised, a plain PyTorch hook copies row 0's state into the others;
- ``plain``: the same S x L x T rows as plain batched forwards with no intervention at all (the
  floor for computing every row in full), at its own best rows per forward (swept first);
- the engine four ways: full rows; the corrupted prefix reused (positions before the restored
  one from the KV cache); rows also start at their restored layer; and the default, which also
  skips the rows a forward would only round;
- ``public``: the public ``Tracer(...).trace("residual")`` end to end — tokenising, sigma
  checks, the reference runs, planning and the result object included;
- ``loop`` (``--loop``): one batch-1 forward per row.

All compute only the last position's logits. Prints a table of seconds (min and median over
interleaved repeats) and ratios per model and checks every method against ROME's on every cell.

    python benchmarks/trace_speed.py --seeds 10 [--models smollm2,tiny] [--repeats 7] [--loop]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.models import get_adapter, get_module, load_model
from pyvene_causaltrace.prompts import answer_token_id, tokenize_prompt
from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine
from pyvene_causaltrace.tracing.noise_scale import rome_sigma
from pyvene_causaltrace.tracing.tracer import Tracer

PROMPT, SUBJECT, ANSWER = "The Eiffel Tower is in the city of", "The Eiffel Tower", " Paris"
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def recipe(seed, n, hidden, scale, sigma):
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((n, hidden), generator=g, dtype=torch.float32) * scale * sigma


def rome_method(model, ids, subject, seeds, scale, sigma, answer_id, cells):
    """One forward of batch S+1 per cell, plain hooks (ROME's trace_with_patch)."""
    adapter = get_adapter(model)
    hidden = bind(model).d_model
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


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences (as the test suite's): the public
    call needs text."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [PROMPT, "The Space Needle is in the city of Seattle", "Paris is the capital of "
              "France", "Miles Davis plays the trumpet", "Danielle Darrieux speaks French"] * 4
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tf.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>")


def setup(name):
    """(model, tokenizer, input ids, subject positions, sigma, answer text, answer id) of one
    benchmark model; both trace the Eiffel prompt."""
    if name == "smollm2":
        model, tokenizer = load_model("smollm2-135m")
        sigma, answer = rome_sigma(model, tokenizer, [SUBJECT]), ANSWER
    else:
        import transformers as tf

        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**TINY), dtype=torch.float32)
        model, tokenizer, sigma, answer = model.eval(), tiny_tokenizer(), 0.5, " city"
    prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
    return (model, tokenizer, prompt.input_ids, list(range(*prompt.subject_range)), sigma,
            answer, answer_token_id(tokenizer, answer))


CLOCK = time.perf_counter
ENGINES = {"engine_full": dict(reuse_prefix=False, replay_layers=False, skip_unchanged=False),
           "engine_prefix": dict(reuse_prefix=True, replay_layers=False, skip_unchanged=False),
           "engine_replay": dict(reuse_prefix=True, replay_layers=True, skip_unchanged=False),
           "engine": dict(reuse_prefix=True, replay_layers=True, skip_unchanged=True)}
NAMES = {"loop": "batch-1 loop", "rome": "(a) ROME: batch S+1 per cell",
         "plain": "(b) plain batched forwards, best batch", "engine_full": "engine, full rows",
         "engine_prefix": "engine, corrupted prefix reused",
         "engine_replay": "engine, + rows start at restored layer",
         "engine": "engine, + unchanged rows skipped",
         "public": "public trace() end to end"}


def floor_batch(model, ids, n_rows, batches, sample):
    """The plain forwards' best rows per forward, timed on ``sample`` rows each (best of 2)."""
    timings = {}
    for batch in batches:
        rows = min(n_rows, max(sample, 2 * batch))
        took = []
        for _ in range(2):
            start = CLOCK()
            plain_rows(model, ids, rows, batch)
            took.append((CLOCK() - start) / rows)
        timings[batch] = min(took)
    print("plain forwards, ms per row by rows per forward: " + ", ".join(
        f"{b}: {1e3 * t:.3f}" for b, t in timings.items()))
    return min(timings, key=timings.get)


def bench(name, args):
    model, tokenizer, ids, subject, sigma, answer_text, answer = setup(name)
    seeds = list(range(args.seeds))
    n_layers = bind(model).n_layers
    cells = [(layer, pos) for layer in range(n_layers) for pos in range(ids.shape[1])]
    n_rows = len(cells) * len(seeds)
    repeats = args.repeats if args.repeats else (1 if name == "smollm2" else 5)
    print(f"\n== {name}: {n_layers} layers x {ids.shape[1]} positions x {len(seeds)} seeds = "
          f"{n_rows} rows; torch threads {torch.get_num_threads()}; {repeats} interleaved "
          f"repeats (min and median)")

    def engine(options):
        made = TraceEngine(model, ids, subject, seeds, args.scale, sigma, answer,
                           memory_budget_mb=args.budget_mb, **options)
        return made.run(KINDS["residual"], cells)

    def public():
        result = Tracer(model, tokenizer, PROMPT, SUBJECT, answer=answer_text, seeds=seeds,
                        scale=args.scale, sigma=sigma, memory_budget_mb=args.budget_mb
                        ).trace("residual", progress=False)
        return torch.from_numpy(result.restored_probs.reshape(len(seeds), -1))

    engine_chunk = TraceEngine(model, ids, subject, seeds, args.scale, sigma, answer,
                               memory_budget_mb=args.budget_mb).rows_per_chunk(0)
    batches = sorted({*(int(b) for b in args.floor_batches.split(",")), engine_chunk})
    chunk = floor_batch(model, ids, n_rows, batches, args.floor_sample)
    print(f"plain forwards run at {chunk} rows per forward (the engine's memory budget allows "
          f"{engine_chunk})")
    methods = {"rome": lambda: rome_method(model, ids, subject, seeds, args.scale, sigma,
                                           answer, cells),
               "plain": lambda: plain_rows(model, ids, n_rows, chunk),
               **{key: (lambda o=options: engine(o)) for key, options in ENGINES.items()
                  if key in args.engines.split(",")},
               "public": public}
    if args.skip_rome:
        del methods["rome"]
    if args.loop:
        methods["loop"] = lambda: batch1_loop(model, ids, n_rows)
    seconds, values = {}, {}
    for _ in range(repeats):  # interleaved, so that drift hits every method alike
        for key, method in methods.items():
            start = CLOCK()
            values[key] = method()
            seconds.setdefault(key, []).append(CLOCK() - start)
    anchor = next(key for key in ("rome", *ENGINES, "public") if key in values)
    for key in (*ENGINES, "public"):
        if key not in values or key == anchor:
            continue
        print(f"max |{key} - {anchor}| over {values[anchor].numel()} cells: "
              f"{(values[key] - values[anchor]).abs().max():.2e}")
    best = {key: min(took) for key, took in seconds.items()}
    median = {key: statistics.median(took) for key, took in seconds.items()}
    print(f"\n{'method':<40} {'min s':>8} {'median s':>9} {'vs rome':>8} {'vs plain':>9} "
          f"{'median vs plain':>16}")
    for key in ("loop", "rome", "plain", *ENGINES, "public"):
        if key in seconds:
            versus = f"{best[key] / best['rome']:>8.3f}" if "rome" in best else f"{'-':>8}"
            print(f"{NAMES[key]:<40} {best[key]:>8.3f} {median[key]:>9.3f} {versus} "
                  f"{best[key] / best['plain']:>9.3f} {median[key] / median['plain']:>16.3f}")
    return {"rows": n_rows, "plain_rows_per_forward": chunk, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2,tiny")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--budget-mb", type=float, default=2048)
    parser.add_argument("--repeats", type=int, default=0, help="default: 1 SmolLM2, 5 tiny")
    parser.add_argument("--loop", action="store_true", help="also time the batch-1 loop")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="engine variants to time: " + ", ".join(ENGINES))
    parser.add_argument("--skip-rome", action="store_true", help="leave out ROME's method")
    parser.add_argument("--floor-batches", default="16,32,64,128,256,512",
                        help="rows per plain forward tried for the floor (the best is kept)")
    parser.add_argument("--floor-sample", type=int, default=1024,
                        help="rows each floor batch size is timed on")
    parser.add_argument("--out", help="write the seconds as JSON here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (with --threads 1, a busy machine's "
                             "other work does not count)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    found = {name: bench(name, args) for name in args.models.split(",")}
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
