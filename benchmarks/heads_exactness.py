"""Issue 42's exactness, on every row of a graph: for tiny Llama (GQA), Qwen3 (q/k norms) and
GPT-2 (fused QKV, LayerNorm) with a fixture CLT, every explored feature row and the logit row are
split by head at every layer (:mod:`pyvene_causaltrace.attribution.heads`), and the heads' parts
plus the bypass recomputed independently (the row with the layer's heads cut from the gradient)
are compared with the edge. The default tier tests 40 rows (``tests/test_heads.py``); this runs
them all.

    python benchmarks/heads_exactness.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _support.models import PROMPT, make_tiny_model, make_tokenizer  # noqa: E402
from clt_fixtures import random_clt_tensors, write_clt  # noqa: E402

from pyvene_causaltrace.attribution import attribute, run_local_replacement  # noqa: E402
from pyvene_causaltrace.attribution import heads as heads_module  # noqa: E402
from pyvene_causaltrace.attribution.edges import feature_rows, target_row  # noqa: E402
from pyvene_causaltrace.bound import bind  # noqa: E402
from pyvene_causaltrace.models import get_adapter, get_module  # noqa: E402
from pyvene_causaltrace.transcoders import load_from_disk  # noqa: E402


def cut_rows(model, clt, graph, layer, nodes):
    module = get_module(model, get_adapter(model).module_path("attn_out", layer))

    def cut(_module, args):
        return (args[0].detach(), *args[1:]) if args[0].requires_grad else None

    handle = module.register_forward_pre_hook(cut)
    try:
        run = run_local_replacement(model, clt, torch.tensor([graph.input_ids]),
                                    from_position=graph.from_position)
        rows = feature_rows(run, nodes)[0].detach().double()
        logit, _, _ = target_row(run, heads_module.graph_target(graph, 0))
    finally:
        handle.remove()
    return torch.cat([rows, logit.detach().double()[None]])


def main() -> None:
    tokenizer = make_tokenizer()
    print("| model | rows | sources | layers | worst |parts + bypass - edge| / row's largest "
          "| seconds |")
    print("|---|---|---|---|---|---|")
    for arch in ("llama", "qwen3", "gpt2"):
        start = time.perf_counter()
        model = make_tiny_model(arch, init=0.2, n_layers=3)
        with tempfile.TemporaryDirectory() as tmp:
            clt = load_from_disk(str(write_clt(Path(tmp) / "clt", random_clt_tensors(
                3, 32, 48, threshold=0.1))))
            graph = attribute(model, tokenizer, clt, PROMPT)
            nodes = graph.explored.nonzero().squeeze(-1)
            layers = list(range(graph.n_layers))
            replay = heads_module._replay(bind(model), clt, graph, layers)
            split = [heads_module._loadings(replay, int(n), layers)
                     for n in [*nodes.tolist(), graph.logit_node]]
            edges = torch.stack([s[0].double() for s in split])
            parts = torch.stack([s[2].double().sum(1) for s in split])
            scale = edges.abs().amax(1, keepdim=True).clamp(min=1e-30)
            worst = 0.0
            for layer in layers:
                bypass = cut_rows(model, clt, graph, layer, nodes)
                worst = max(worst, float(((parts[:, layer] + bypass - edges).abs() / scale).max()))
        print(f"| {arch} | {len(split)} | {edges.shape[1]} | {len(layers)} | {worst:.1e} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
