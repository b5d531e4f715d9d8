"""GPU timing of a full residual trace on a random-init model of a real shape (bf16, 10 seeds),
side by side: the public ``trace()`` end to end (tokenizing, the clean and corrupted runs and
every row, as a user calls it; a BPE tokenizer trained on known_1000's facts, a fact whose
prompt has ``--tokens`` tokens), the plain batched floor (the same rows as plain forwards, no
intervention, in the engine's rows per forward), the engine alone with and without starting rows
at their restored layer, and optionally the seed's style (one forward per (layer, seed), the
positions as the batch). Installs nothing, needs no network; ``--json`` writes the numbers.

    python benchmarks/gpu_trace.py                       # Llama-3.2-1B's shape, on a CUDA machine
    python benchmarks/gpu_trace.py --shape qwen3_8b
    python benchmarks/gpu_trace.py --shape tiny --device cpu   # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
from trace_speed import plain_rows  # noqa: E402  (the trace's rows as plain batched forwards)

from pyvene_causaltrace import trace  # noqa: E402  (the public function)
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.models import get_adapter, get_module  # noqa: E402
from pyvene_causaltrace.prompts import tokenize_prompt  # noqa: E402
from pyvene_causaltrace.tracing.engine import KINDS, TraceEngine  # noqa: E402

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                    max_position_embeddings=4096)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=4096)
TINY = dict(vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def recipe(seed, n, hidden, scale, sigma):
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((n, hidden), generator=g, dtype=torch.float32) * scale * sigma


def seed_style(model, ids, subject, seeds, scale, sigma, answer):
    """One forward per (layer, seed): batch = positions, row t restores position t."""
    adapter = get_adapter(model)
    n_layers, seq = bind(model).n_layers, ids.shape[1]
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
        noise = recipe(seed, len(subject), bind(model).d_model, scale, sigma).to(
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


def known_facts() -> list[dict]:
    """known_1000's records (../shared/data here, .devdata/ on the GPU machine)."""
    root = Path(__file__).resolve().parents[1]
    path = next(p for p in (root.parent / "shared" / "data" / "known_1000.json",
                            root / ".devdata" / "known_1000.json") if p.exists())
    return json.loads(path.read_text())


def fact_of_length(tokenizer, n_tokens: int):
    """The first known_1000 fact whose prompt has ``n_tokens`` tokens (else the nearest)."""
    best = None
    for record in known_facts():
        n = tokenize_prompt(tokenizer, record["prompt"], record["subject"]).seq_len
        if best is None or abs(n - n_tokens) < abs(best[0] - n_tokens):
            best = (n, record)
        if n == n_tokens:
            break
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--seed-style", action="store_true",
                        help="also time one forward per (layer, seed) (slow)")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=11)
    parser.add_argument("--budget-mb", type=float, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    from synthetic_clt import known_facts_tokenizer

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    config_class, shape = SHAPES[args.shape]
    config = config_class(**shape)
    start = time.perf_counter()
    with torch.device(args.device):  # an 8B model is initialised where it runs
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    tokenizer = known_facts_tokenizer()
    record = fact_of_length(tokenizer, args.tokens)
    setup = time.perf_counter() - start
    prompt = tokenize_prompt(tokenizer, record["prompt"], record["subject"])
    ids = prompt.input_ids.to(args.device)
    subject, seeds = list(range(*prompt.subject_range)), list(range(args.seeds))
    answer = int(tokenizer(" " + record["attribute"])["input_ids"][0])
    with torch.no_grad():
        sigma = float(model.get_input_embeddings()(ids[:, subject]).float().std())
    n_tokens = ids.shape[1]
    cells = [(layer, pos) for layer in range(config.num_hidden_layers)
             for pos in range(n_tokens)]
    n_rows = len(cells) * len(seeds)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        """Median seconds of ``repeats`` calls after a warm-up, and the last value."""
        fn()
        times = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            value = fn()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times), value

    def engine_run(replay):
        engine = TraceEngine(model, ids, subject, seeds, 3.0, sigma, answer,
                             memory_budget_mb=args.budget_mb, replay_layers=replay)
        return engine.run(KINDS["residual"], cells)

    def public():
        return trace(model, tokenizer, record["prompt"], record["subject"],
                     answer=" " + record["attribute"], seeds=args.seeds,
                     memory_budget_mb=args.budget_mb, progress=False)

    chunk = TraceEngine(model, ids, subject, seeds[:1], 3.0, sigma, answer,
                        memory_budget_mb=args.budget_mb).rows_per_chunk(0)
    times = {"plain": timed(lambda: plain_rows(model, ids, n_rows, chunk))[0]}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times["public"], result = timed(public)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    times["engine"], engine_probs = timed(lambda: engine_run(True))
    times["engine_prefix"], prefix_probs = timed(lambda: engine_run(False))
    names = {"seed": "seed style: forward per (layer, seed)",
             "plain": "plain batched forwards (the floor)",
             "public": "trace() end to end (public API)",
             "engine_prefix": "engine, corrupted prefix reused",
             "engine": "engine, + rows start at restored layer"}
    print(f"{args.shape}: {config.num_hidden_layers} layers x {n_tokens} tokens x "
          f"{len(seeds)} seeds = {n_rows} rows, {dtype}, {args.device}; {chunk} rows per "
          f"forward; model and tokenizer made in {setup:.1f} s; fact {record['prompt']!r}")
    diff = f"engine vs prefix-only max |dP| {(engine_probs - prefix_probs).abs().max():.2e}"
    if args.seed_style:
        times["seed"], seed_probs = timed(
            lambda: seed_style(model, ids, subject, seeds, 3.0, sigma, answer))
        diff += (", vs seed style "
                 f"{(engine_probs.float().reshape(seed_probs.shape) - seed_probs).abs().max():.2e}")
    print(f"{'method':<44} {'seconds':>8} {'vs plain':>9}")
    for key in ("seed", "plain", "public", "engine_prefix", "engine"):
        if key in times:
            print(f"{names[key]:<44} {times[key]:>8.3f} {times[key] / times['plain']:>9.3f}")
    print(f"peak GPU memory (trace()) {peak:.2f} GiB; {diff}; trace() restored P in "
          f"[{result.restored_probs.min():.3g}, {result.restored_probs.max():.3g}]")
    if args.json:
        args.json.write_text(json.dumps({
            "shape": args.shape, "layers": config.num_hidden_layers, "tokens": n_tokens,
            "seeds": len(seeds), "rows": n_rows, "rows_per_forward": chunk,
            "device": args.device, "dtype": str(dtype), "seconds": times,
            "public_vs_plain": times["public"] / times["plain"],
            "peak_gib": peak if cuda else None}, indent=1))


if __name__ == "__main__":
    main()
