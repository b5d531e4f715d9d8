"""Full residual causal trace on SmolLM2 (Eiffel prompt), side by side in one run:

- ``rome``: ROME's method, one forward of batch S+1 per (layer, position) cell: row 0 clean,
  rows 1..S noised, a plain PyTorch hook copies row 0's state into the others;
- ``plain``: the same S x L x T rows as plain batched forwards with no intervention at all;
- ``engine``: our batched engine (registered pyvene interventions, per-row masks), with and
  without reusing the corrupted prefix's keys and values;
- ``loop`` (``--loop``): one batch-1 forward per row.

All compute only the last position's logits. Prints a table of seconds and ratios and checks the
engine against ROME's method on every cell.

    python benchmarks/trace_speed.py --seeds 10
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


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--budget-mb", type=float, default=2048)
    parser.add_argument("--loop", action="store_true", help="also time the batch-1 loop")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
    subject = list(range(*prompt.subject_range))
    answer = answer_token_id(tokenizer, ANSWER)
    sigma = rome_sigma(model, tokenizer, [SUBJECT])
    seeds = list(range(args.seeds))
    n_layers = model.config.num_hidden_layers
    cells = [(layer, pos) for layer in range(n_layers) for pos in range(prompt.seq_len)]
    n_rows = len(cells) * len(seeds)
    print(f"torch threads {torch.get_num_threads()}; {n_layers} layers x {prompt.seq_len} "
          f"positions x {len(seeds)} seeds = {n_rows} rows")

    results = {}
    results["rome"], rome = timed(lambda: rome_method(
        model, prompt.input_ids, subject, seeds, args.scale, sigma, answer, cells))
    engine_reuse = TraceEngine(model, prompt.input_ids, subject, seeds, args.scale, sigma, answer,
                               memory_budget_mb=args.budget_mb)
    chunk = engine_reuse.rows_per_chunk(0)
    results["plain"], _ = timed(lambda: plain_rows(model, prompt.input_ids, n_rows, chunk))

    def engine_run(reuse):
        engine = TraceEngine(model, prompt.input_ids, subject, seeds, args.scale, sigma, answer,
                             memory_budget_mb=args.budget_mb, reuse_prefix=reuse)
        return engine.run(KINDS["residual"], cells)

    results["engine"], fast = timed(lambda: engine_run(True))
    results["engine_no_reuse"], slow = timed(lambda: engine_run(False))
    if args.loop:
        results["loop"], _ = timed(lambda: batch1_loop(model, prompt.input_ids, n_rows))

    print(f"\nmax |engine - rome| over {rome.numel()} cells: {(fast - rome).abs().max():.2e}; "
          f"without prefix reuse: {(slow - rome).abs().max():.2e}")
    print(f"\n{'method':<34} {'seconds':>8} {'vs rome':>8} {'vs plain':>9}")
    names = {"loop": "batch-1 loop", "rome": "(a) ROME: batch S+1 per cell",
             "plain": "(b) plain batched forwards", "engine_no_reuse": "engine, full rows",
             "engine": "engine, corrupted prefix reused"}
    for key in ("loop", "rome", "plain", "engine_no_reuse", "engine"):
        if key in results:
            t = results[key]
            print(f"{names[key]:<34} {t:>8.2f} {t / results['rome']:>8.3f} "
                  f"{t / results['plain']:>9.3f}")


if __name__ == "__main__":
    main()
