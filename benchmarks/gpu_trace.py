"""GPU timing of a full residual trace on a random-init model of a real shape (bf16, 11 tokens,
10 seeds), side by side: the seed's style (one forward per (layer, seed) with the positions as
the batch), the plain batched floor (the same rows as plain forwards, no intervention), and the
engine with and without starting rows at their restored layer. Installs nothing, needs no
network.

    python benchmarks/gpu_trace.py                       # Llama-3.2-1B's shape, on a CUDA machine
    python benchmarks/gpu_trace.py --shape qwen3_8b --skip-seed-style
    python benchmarks/gpu_trace.py --shape tiny --device cpu   # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
from trace_speed import plain_rows  # noqa: E402  (the trace's rows as plain batched forwards)

from pyvene_causaltrace.models import get_adapter, get_module  # noqa: E402
from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine  # noqa: E402

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                    max_position_embeddings=4096)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=4096)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def recipe(seed, n, hidden, scale, sigma):
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((n, hidden), generator=g, dtype=torch.float32) * scale * sigma


def seed_style(model, ids, subject, seeds, scale, sigma, answer):
    """One forward per (layer, seed): batch = positions, row t restores position t."""
    adapter = get_adapter(model)
    n_layers, seq = adapter.n_layers(model), ids.shape[1]
    clean = {}
    handles = [get_module(model, adapter.module_path("block", layer)).register_forward_hook(
        lambda _m, _a, out, _l=layer: clean.__setitem__(_l, (out[0] if isinstance(out, tuple)
                                                             else out).detach()))
        for layer in range(n_layers)]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    embed = get_module(model, adapter.embed)
    out = torch.empty(len(seeds), n_layers, seq)
    rows = torch.arange(seq)
    for s, seed in enumerate(seeds):
        noise = recipe(seed, len(subject), adapter.hidden_size(model), scale, sigma).to(
            ids.device, embed.weight.dtype)

        def add(_m, _a, output, _noise=noise):
            output = output.clone()
            output[:, subject] += _noise
            return output

        h = embed.register_forward_hook(add)
        for layer in range(n_layers):
            def patch(_m, _a, output, _l=layer):
                hidden = output[0] if isinstance(output, tuple) else output
                hidden[rows, rows] = clean[_l][0, rows]
                return output

            h2 = get_module(model, adapter.module_path("block", layer)).register_forward_hook(patch)
            with torch.no_grad():
                logits = model(input_ids=ids.repeat(seq, 1), logits_to_keep=1).logits[:, -1]
            h2.remove()
            out[s, layer] = logits.float().softmax(-1)[:, answer].cpu()
        h.remove()
    return out


SHAPES = {"llama1b": (tf.LlamaConfig, LLAMA_3_2_1B), "qwen3_8b": (tf.Qwen3Config, QWEN3_8B),
          "tiny": (tf.LlamaConfig, TINY)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--skip-seed-style", action="store_true")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=11)
    parser.add_argument("--budget-mb", type=float, default=16384)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    config_class, shape = SHAPES[args.shape]
    config = config_class(**shape)
    with torch.device(args.device):  # an 8B model is initialised where it runs
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=args.device)
    subject, seeds, answer = [1, 2, 3, 4], list(range(args.seeds)), 7
    with torch.no_grad():
        sigma = float(model.model.embed_tokens(ids[:, subject]).float().std())
    cells = [(layer, pos) for layer in range(config.num_hidden_layers)
             for pos in range(args.tokens)]
    n_rows = len(cells) * len(seeds)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(fn, repeats=3):
        fn()  # warm-up
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            value = fn()
        sync()
        return (time.perf_counter() - start) / repeats, value

    def engine_run(replay):
        engine = TraceEngine(model, ids, subject, seeds, 3.0, sigma, answer,
                             memory_budget_mb=args.budget_mb, replay_layers=replay)
        return engine.run(KINDS["residual"], cells)

    chunk = TraceEngine(model, ids, subject, seeds[:1], 3.0, sigma, answer,
                        memory_budget_mb=args.budget_mb).rows_per_chunk(0)
    times = {"plain": timed(lambda: plain_rows(model, ids, n_rows, chunk))[0]}
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times["engine"], engine_probs = timed(lambda: engine_run(True))
    peak = (torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda")
            else float("nan"))
    times["engine_prefix"], prefix_probs = timed(lambda: engine_run(False))
    names = {"seed": "seed style: forward per (layer, seed)",
             "plain": "plain batched forwards (the floor)",
             "engine_prefix": "engine, corrupted prefix reused",
             "engine": "engine, + rows start at restored layer"}
    print(f"{args.shape}: {config.num_hidden_layers} layers x {args.tokens} tokens x "
          f"{len(seeds)} seeds = {n_rows} rows, {dtype}, {args.device}")
    diff = f"engine vs prefix-only max |dP| {(engine_probs - prefix_probs).abs().max():.2e}"
    if not args.skip_seed_style:
        times["seed"], seed_probs = timed(
            lambda: seed_style(model, ids, subject, seeds, 3.0, sigma, answer))
        diff += (", vs seed style "
                 f"{(engine_probs.float().reshape(seed_probs.shape) - seed_probs).abs().max():.2e}")
    print(f"{'method':<44} {'seconds':>8} {'vs plain':>9}")
    for key in ("seed", "plain", "engine_prefix", "engine"):
        if key in times:
            print(f"{names[key]:<44} {times[key]:>8.3f} {times[key] / times['plain']:>9.3f}")
    print(f"peak GPU memory (engine) {peak:.2f} GiB; {diff}")


if __name__ == "__main__":
    main()
