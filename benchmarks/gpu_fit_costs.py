"""Fit the chunk planner's device constants (``tracing/chunks.py: DEVICE_SPEEDS``) to timed
forwards, and print the line to paste in.

The planner's cost model (:meth:`ChunkCost.estimate`): a forward of ``n`` rows of ``span``
positions through ``k`` layers, each of ``layer_bytes`` weight bytes and ``layer_flops`` FLOPs per
token, with an unembedding of ``head_bytes``, takes

    forward_overhead + head_bytes / bandwidth
        + k * (layer_overhead + layer_bytes / bandwidth + n * span * layer_flops / flops)

seconds: linear in (forward_overhead, 1 / bandwidth, layer_overhead, 1 / flops). This script times
plain forwards (no cache, last position's logits only, as the engine's) of random-init models of
several shapes over a grid of ``k`` (the model's first ``k`` layers), ``n`` and ``span``, and fits
the four by non-negative least squares on relative errors (every forward counts alike, fast or
slow). Two shapes of different layer and head sizes are needed to tell the fixed overheads from
the bandwidth. The planner only uses the constants' ratios (``ChunkCost`` in units of one token
through one layer), so the table also prints each shape's ``ChunkCost`` now and fitted.

    python benchmarks/gpu_fit_costs.py --device cuda --shapes llama1b,qwen3_8b --json fit.json
    python benchmarks/gpu_fit_costs.py --device cpu --shapes tiny,tiny_wide   # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
from gpu_trace import SHAPES as TRACE_SHAPES  # noqa: E402

from pyvene_causaltrace.tracing.chunks import DEVICE_SPEEDS, ChunkCost  # noqa: E402

SHAPES = {**TRACE_SHAPES,
          "tiny_wide": (tf.LlamaConfig, dict(vocab_size=8000, hidden_size=256,
                                             intermediate_size=1024, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=64))}


def sizes(model) -> tuple[float, float, float]:
    """``(layer_bytes, layer_flops, head_bytes)`` as the engine measures them."""
    weights = list(model.model.layers[0].parameters())
    head = model.get_output_embeddings().weight
    return (float(sum(p.numel() * p.element_size() for p in weights)),
            2.0 * sum(p.numel() for p in weights), float(head.numel() * head.element_size()))


def time_forwards(model, device: str, grid, repeats: int) -> list[dict]:
    """Median seconds of a plain forward at each ``(k, n, span)`` of ``grid``."""
    layers = model.model.layers
    cuda = device.startswith("cuda")
    out = []
    for k, n, span in grid:
        model.model.layers = layers[:k]
        ids = torch.randint(0, model.config.vocab_size, (n, span), device=device)
        times = []
        with torch.inference_mode():
            for rep in range(repeats + 1):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
                if cuda:
                    torch.cuda.synchronize()
                if rep:  # the first is a warm-up
                    times.append(time.perf_counter() - start)
        out.append({"k": k, "n": n, "span": span, "seconds": statistics.median(times)})
    model.model.layers = layers
    return out


def fit(points: list[dict]) -> tuple[dict, np.ndarray]:
    """Non-negative least squares on relative errors; returns the constants and each point's
    predicted seconds."""
    x = np.array([[1.0, p["head_bytes"] + p["k"] * p["layer_bytes"], p["k"],
                   p["k"] * p["n"] * p["span"] * p["layer_flops"]] for p in points])
    y = np.array([p["seconds"] for p in points])
    try:
        from scipy.optimize import nnls

        coef = nnls(x / y[:, None], np.ones(len(y)))[0]
    except ImportError:  # (scipy is on the GPU machine; plain least squares, clipped, here)
        coef = np.clip(np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)[0], 0, None)
    forward_overhead, inv_bandwidth, layer_overhead, inv_flops = coef
    constants = {"layer_overhead": layer_overhead, "forward_overhead": forward_overhead,
                 "bandwidth": 1 / inv_bandwidth if inv_bandwidth > 0 else float("inf"),
                 "flops": 1 / inv_flops if inv_flops > 0 else float("inf")}
    return constants, x @ coef


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="llama1b,qwen3_8b")
    parser.add_argument("--batches", default="1,16,128,512")
    parser.add_argument("--spans", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=8192,
                        help="largest n x span timed (per forward)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    points, shapes = [], {}
    for shape in args.shapes.split(","):
        config_class, kwargs = SHAPES[shape]
        torch.manual_seed(0)
        with torch.device(args.device):
            model = tf.AutoModelForCausalLM.from_config(config_class(**kwargs),
                                                        dtype=dtype).eval()
        n_layers = model.config.num_hidden_layers
        layer_bytes, layer_flops, head_bytes = sizes(model)
        shapes[shape] = {"layer_bytes": layer_bytes, "layer_flops": layer_flops,
                         "head_bytes": head_bytes, "layers": n_layers}
        ks = sorted({max(1, n_layers // 4), max(1, n_layers // 2), n_layers})
        grid = [(k, n, s) for k, n, s in itertools.product(
            ks, map(int, args.batches.split(",")), map(int, args.spans.split(",")))
            if n * s <= args.max_tokens]
        start = time.perf_counter()
        for p in time_forwards(model, args.device, grid, args.repeats):
            points.append({"shape": shape, **shapes[shape], **p})
        print(f"{shape}: {len(grid)} forwards timed in {time.perf_counter() - start:.1f} s "
              f"(layer {layer_bytes / 2**20:.0f} MB, head {head_bytes / 2**20:.0f} MB)")
        del model
        if cuda:
            torch.cuda.empty_cache()
    constants, predicted = fit(points)
    errors = np.abs(predicted / np.array([p["seconds"] for p in points]) - 1)
    print(f"fit over {len(points)} forwards: relative error median {np.median(errors):.1%}, "
          f"max {errors.max():.1%}")
    device_type = "cuda" if cuda else "cpu"
    old = DEVICE_SPEEDS[device_type]
    print(f"{'constant':<18} {'now':>10} {'fitted':>10}")
    for name, value in constants.items():
        print(f"{name:<18} {getattr(old, name):>10.3g} {value:>10.3g}")
    print(f"{'shape':<10} {'ChunkCost now (layer, forward)':>32} {'fitted':>22}")
    for shape, s in shapes.items():
        now = ChunkCost.estimate(device_type, s["layer_bytes"], s["layer_flops"],
                                 s["head_bytes"])
        token = s["layer_flops"] / constants["flops"]
        fitted = ((constants["layer_overhead"] + s["layer_bytes"] / constants["bandwidth"])
                  / token, (constants["forward_overhead"] + s["head_bytes"]
                            / constants["bandwidth"]) / token)
        print(f"{shape:<10} {now.layer:>15.1f} {now.forward:>16.1f} {fitted[0]:>10.1f} "
              f"{fitted[1]:>11.1f}")
    print("paste into tracing/chunks.py DEVICE_SPEEDS:")
    print(f'    "{device_type}": DeviceSpeed(layer_overhead={constants["layer_overhead"]:.3g}, '
          f'forward_overhead={constants["forward_overhead"]:.3g}, '
          f'bandwidth={constants["bandwidth"]:.3g}, flops={constants["flops"]:.3g}),')
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "constants": constants,
                                         "shapes": shapes, "points": points,
                                         "median_relative_error": float(np.median(errors))},
                                        indent=1))


if __name__ == "__main__":
    main()
