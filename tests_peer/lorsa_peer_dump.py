"""The Lorsa peer (issue 56): llamascopium's own ``attribute`` on a tiny random-init model with
Lorsa modules and per-layer transcoders, written in llamascopium's format, and its graph dumped.

Runs in ``.venv-lorsa-peer`` (``make peer-lorsa-env``), never in ours: llamascopium needs
torch >= 2.11, TransformerLens 3 and a stack of its own. It imports nothing of this package,
only the test suite's tiny models and tokenizer (``tests/_support``, ``tests_peer/peer.py``),
so that our side can rebuild the same model and read the same files::

    .venv-lorsa-peer/bin/python tests_peer/lorsa_peer_dump.py OUT [--seed 0] [--bias-std 0.1]

``OUT`` receives:

- ``model/``: the tiny Hugging Face model and its tokenizer (``save_pretrained``);
- ``dictionaries/lorsa-L{l}/``, ``dictionaries/transcoder-L{l}/``: one directory per module as
  llamascopium saves and loads it (``config.json`` from ``cfg.save_hyperparameters``,
  ``sae_weights.safetensors`` from ``save_pretrained``, ``lm_config.json``), read back with
  ``SparseDictionary.from_pretrained`` before attributing;
- ``graph.json``: the graph's node spaces in llamascopium's terms (hook key + index per node),
  the same nodes as Neuronpedia-style node records (``feature_type`` ``lorsa``, ``lorsa error``,
  ``cross layer transcoder``, ``mlp reconstruction error``, ``embedding``, ``logit``; ids as
  OpenMOSS's circuit server writes them), activations, logit tokens and probabilities, the
  QK tracing results per Lorsa target (``qk_tracing_results``), the nodes those results name
  that the graph lacks (``qk_only_nodes``), and the settings and timings of the run;
- ``graph.safetensors``: the edge matrix ``attribution`` (rows: targets, columns: sources, as
  ``graph.json``'s ``rows`` / ``columns``), ``activations``, ``logits``, ``probs``,
  ``pruned_attribution`` (their ``prune_attribution`` at its defaults 0.6 / 0.8).

Deterministic (seeded weights, one torch thread) and small: 3 layers, d_model 32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # peer.py: the tokenizer the circuit-tracer peer uses
from peer import make_tokenizer, suite  # noqa: E402

N_LAYERS = 3
#: Lorsa: 4 QK heads of width 8 (the model's head_dim), each shared by 16 rank-1 OV heads.
N_QK_HEADS, D_QK_HEAD, LORSA_EXPANSION, LORSA_TOP_K = 4, 8, 2, 6
#: per-layer transcoders (ln2 output -> MLP output): 64 features, TopK 6.
TRANSCODER_EXPANSION, TRANSCODER_TOP_K = 2, 6
PROMPT = suite.PROMPT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    # Qwen3 only: a local Llama fails inside TransformerLens 3.2.1 as llamascopium loads it
    # (convert_hf_model_config with hf_cfg given: UnboundLocalError on hf_config)
    p.add_argument("--arch", choices=("qwen3",), default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--bias-std", type=float, default=0.0,
                   help="std of the dictionaries' biases (b_E, b_D, b_V, b_Q, b_K); 0 (default) "
                        "makes every row's edges sum to its activation")
    p.add_argument("--qk-ln", choices=("auto", "on", "off"), default="auto",
                   help="Lorsa's post-QK RMS norm (use_post_qk_ln); auto: on for qwen3")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--qk-topk", type=int, default=32,
                   help="QK tracing's top-k; 32 exceeds every target's count of nonzero "
                        "sources here, so that the marginals are complete (they sum to the score)")
    p.add_argument("--qk-top-fraction", type=float, default=0.6)
    p.add_argument("--max-n-logits", type=int, default=5)
    p.add_argument("--desired-logit-prob", type=float, default=0.95)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the model


def build_model(args, root: Path):
    """The tiny model and tokenizer saved in ``root`` and loaded back as llamascopium loads a
    model: ``TransformerLensLanguageModel(LanguageModelConfig)`` (HF weights through
    TransformerLens's own conversion and ``load_and_process_state_dict`` defaults)."""
    # llamascopium and its stack live in .venv-lorsa-peer only: imported where used
    from llamascopium.backend.language_model import (
        LanguageModelConfig,
        TransformerLensLanguageModel,
    )

    root.mkdir(parents=True, exist_ok=True)
    make_tokenizer(suite.CORPUS, root)
    hf = suite.make_tiny_model(args.arch, init=0.2, n_layers=N_LAYERS, seed=args.seed)
    # norm weights away from 1: TransformerLens folds them into the next weights (fold_ln),
    # so that the dictionaries' "ln*.hook_normalized" inputs are x / rms(x) without them, a
    # convention a fixture with unit norm weights would hide
    generator = torch.Generator().manual_seed(2000 + args.seed)
    with torch.no_grad():
        for name, p in sorted(hf.named_parameters()):
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
    hf.save_pretrained(root)
    cfg = LanguageModelConfig(model_name=str(root), model_from_pretrained_path=str(root),
                              local_files_only=True, backend="transformer_lens",
                              device="cpu", dtype=torch.float32)
    return TransformerLensLanguageModel(cfg).eval(), cfg


# ------------------------------------------------------------------------- dictionaries


def _fill(module, generator, bias_std: float):
    """Seeded weights: decoder rows of norm 0.5 to 2 (TopK ranks ``hidden_pre`` times the
    decoder norm, ``sparsity_include_decoder_norm``: unit norms would hide that), encoders of
    unit-variance outputs, QK norms' weights near 1; biases N(0, bias_std), zero by default."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.startswith("b_"):
                p.copy_(torch.randn(p.shape, generator=generator) * bias_std)
            elif name.startswith("ln_"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
            elif name == "activation_function.log_jumprelu_threshold":
                p.fill_(math.log(0.05))
            else:
                w = torch.randn(p.shape, generator=generator)
                if name in ("W_D", "W_O"):  # (d_sae, d_model): decoder rows
                    scale = 0.5 + 1.5 * torch.rand(p.shape[0], 1, generator=generator)
                    w = w / w.norm(dim=-1, keepdim=True) * scale
                else:
                    w = w / math.sqrt(module.cfg.d_model)
                p.copy_(w)


def write_dictionaries(args, model, lm_cfg, root: Path) -> list[Path]:
    """One Lorsa (attention output) and one transcoder (MLP output) per layer, each saved in
    its own directory as llamascopium saves a trained module; returns the directories."""
    # the peer's stack (see build_model)
    from llamascopium.models.lorsa import LorsaConfig
    from llamascopium.models.sae import SAEConfig
    from llamascopium.models.sparse_dictionary import SparseDictionary

    tl = model.cfg
    qk_ln = args.qk_ln == "on" or (args.qk_ln == "auto" and args.arch == "qwen3")
    generator = torch.Generator().manual_seed(1000 + args.seed)
    paths = []
    for layer in range(tl.n_layers):
        lorsa = LorsaConfig(
            hook_point_in=f"blocks.{layer}.ln1.hook_normalized",
            hook_point_out=f"blocks.{layer}.hook_attn_out",
            d_model=tl.d_model, expansion_factor=LORSA_EXPANSION, act_fn="topk",
            top_k=LORSA_TOP_K, norm_activation="inference", n_qk_heads=N_QK_HEADS,
            d_qk_head=D_QK_HEAD, rotary_dim=D_QK_HEAD, rotary_base=int(tl.rotary_base),
            # transformers' Llama/Qwen rotary rotates (x_i, x_{i+d/2}) pairs (GPT-NeoX style)
            rotary_adjacent_pairs=False, n_ctx=64, use_post_qk_ln=qk_ln,
            normalization_type="RMS" if qk_ln else None, eps=tl.eps)
        transcoder = SAEConfig(
            hook_point_in=f"blocks.{layer}.ln2.hook_normalized",
            hook_point_out=f"blocks.{layer}.hook_mlp_out",
            d_model=tl.d_model, expansion_factor=TRANSCODER_EXPANSION, act_fn="topk",
            top_k=TRANSCODER_TOP_K, norm_activation="inference")
        for name, cfg in ((f"lorsa-L{layer}", lorsa), (f"transcoder-L{layer}", transcoder)):
            module = SparseDictionary.from_config(cfg)
            _fill(module, generator, args.bias_std)
            # a fixed (unit) dataset norm: left unset, the checkpoint would hold torch.empty()
            module.set_dataset_average_activation_norm(
                {hook: math.sqrt(tl.d_model) for hook in cfg.associated_hook_points})
            path = root / name
            module.save_pretrained(path)
            cfg.save_hyperparameters(path)
            lm_cfg.save_lm_config(str(path))
            paths.append(path)
    return paths


def load_dictionaries(paths: list[Path]):
    """The modules read back from disk the way llamascopium loads a trained one."""
    # the peer's stack (see build_model)
    from llamascopium.models.sparse_dictionary import SparseDictionary

    return [SparseDictionary.from_pretrained(str(p)).eval() for p in paths]


def count_active(model, modules, tokens) -> int:
    """How many (position, feature) pairs are active on the prompt: ``attribute``'s
    ``max_features=None`` collects only ``len(replacement_modules)`` features, so the full
    graph needs the count."""
    keys = [m.cfg.hook_point_out + ".sae.hook_feature_acts" for m in modules]
    with torch.no_grad(), model.apply_saes(modules):
        _, cache = model.run_with_cache(tokens[None], names_filter=keys)
    return sum(int((cache[k][0] != 0).sum()) for k in keys)


# ------------------------------------------------------------------------------ dumping


def _nodes(dimension) -> list[list]:
    """A NodeDimension as ``[[key, [index, ...]], ...]`` in offset order."""
    return [[str(n.key), [int(i) for i in n.indices[0].tolist()]] for n in dimension]


def neuronpedia_node(key: str, index: list[int], modules, tokens, n_layers: int,
                     logit_probs: dict[int, float]) -> dict:
    """The node record OpenMOSS's circuit server (``server/routers/circuits.py``,
    ``load_circuit_graph``) builds from a node key: layer ``2 l`` for Lorsa (attention) and
    ``2 l + 1`` for transcoders (MLP), logits at ``2 n_layers``."""
    lorsa = {m.cfg.hook_point_out: type(m).__name__ == "LowRankSparseAttention" for m in modules}
    if key == "hook_embed":
        pos = index[0]
        return {"feature_type": "embedding", "node_id": f"E_{tokens[pos]}_{pos}", "layer": -1,
                "ctx_idx": pos}
    if key == "logits":
        ctx, layer = len(tokens) - 1, 2 * n_layers
        return {"feature_type": "logit", "node_id": f"{layer}_{index[0]}_{ctx}", "layer": layer,
                "ctx_idx": ctx, "feature": index[0], "token_prob": logit_probs[index[0]]}
    hook = key.removesuffix(".error").removesuffix(".sae.hook_feature_acts")
    if hook not in lorsa:  # a bias leaf (QK tracing's sources): the server's fallback
        return {"feature_type": "bias", "node_id": f"{key}:{'_'.join(map(str, index))}",
                "layer": 0, "ctx_idx": index[0] if index else 0}
    is_lorsa = lorsa[hook]
    layer = 2 * int(re.search(r"blocks\.(\d+)\.", hook).group(1)) + int(not is_lorsa)
    if key.endswith(".error"):
        return {"feature_type": "lorsa error" if is_lorsa else "mlp reconstruction error",
                "node_id": f"{layer}_error_{index[0]}", "layer": layer, "ctx_idx": index[0]}
    return {"feature_type": "lorsa" if is_lorsa else "cross layer transcoder",
            "node_id": f"{layer}_{index[1]}_{index[0]}", "layer": layer, "ctx_idx": index[0],
            "feature": index[1]}


def attention_scores(model, modules, tokens) -> dict[str, torch.Tensor]:
    """Each Lorsa's attention scores ``[n_qk_heads, q, k]`` (``hook_attn_score``: scaled
    q.k, causal mask -inf) on a plain forward of the replacement model, apart from
    ``attribute``: what a QK target's complete marginals must sum to."""
    keys = {m.cfg.hook_point_out: m.cfg.hook_point_out + ".sae.hook_attn_score"
            for m in modules if type(m).__name__ == "LowRankSparseAttention"}
    with torch.no_grad(), model.apply_saes(modules):
        _, cache = model.run_with_cache(tokens[None], names_filter=list(keys.values()))
    return {hook: cache[key][0] for hook, key in keys.items()}


def qk_results(result, modules, scores) -> list[dict]:
    """``AttributionResult.qk_trace_results`` per Lorsa target: the top Q-side and K-side
    marginal sources and the top (Q source, K source) pairs, each ``[key, index, value]``;
    with the target's QK head, its key position (the row's argmax, as ``attribute`` picks
    it) and the attention score there (:func:`attention_scores`)."""
    qk = result.qk_trace_results
    if qk is None:
        return []
    group = {m.cfg.hook_point_out: m.cfg.ov_group_size for m in modules
             if type(m).__name__ == "LowRankSparseAttention"}
    out = []
    targets = list(qk.q_marginal.dimensions[0])
    for i, target in enumerate(targets):
        q, k, pairs = qk.q_marginal.value[i], qk.k_marginal.value[i], qk.pairs.value[i]
        hook = str(target.key).removesuffix(".sae.hook_feature_acts")
        q_pos, head = (int(x) for x in target.indices[0].tolist())
        row = scores[hook][head // group[hook], q_pos]
        k_pos = int(row.argmax())
        out.append({
            "target": [str(target.key), [q_pos, head]],
            "qk_head": head // group[hook], "k_pos": k_pos, "score": float(row[k_pos]),
            "q_marginal": [[*n, float(v)] for n, v in zip(
                _nodes(q.dimensions[0]), q.value.tolist(), strict=True)],
            "k_marginal": [[*n, float(v)] for n, v in zip(
                _nodes(k.dimensions[0]), k.value.tolist(), strict=True)],
            "pairs": [[*nq, *nk, float(v)] for nq, nk, v in zip(
                _nodes(pairs.dimensions[0]), _nodes(pairs.dimensions[1]), pairs.value.tolist(),
                strict=True)],
        })
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    t_import = time.perf_counter()
    # the peer's stack (see build_model); timed: most of a run is importing it
    from llamascopium.circuits.attribution import attribute, prune_attribution
    from safetensors.torch import save_file

    timings = {"import_llamascopium_s": time.perf_counter() - t_import}
    t0 = time.perf_counter()
    out: Path = args.out
    model, lm_cfg = build_model(args, out / "model")
    timings["model_s"] = time.perf_counter() - t0
    paths = write_dictionaries(args, model, lm_cfg, out / "dictionaries")
    modules = load_dictionaries(paths)
    tokens = model.tokenizer(args.prompt, return_tensors="pt").input_ids[0]
    n_active = count_active(model, modules, tokens)

    t1 = time.perf_counter()
    result = attribute(model, tokens, modules, max_n_logits=args.max_n_logits,
                       desired_logit_prob=args.desired_logit_prob, batch_size=args.batch_size,
                       max_features=n_active, enable_qk_tracing=True,
                       qk_top_fraction=args.qk_top_fraction, qk_topk=args.qk_topk)
    timings["attribute_s"] = time.perf_counter() - t1
    pruned = prune_attribution(result.attribution, result.probs)

    rows, columns = result.attribution.dimensions
    token_ids = [int(t) for t in tokens.tolist()]
    probs = {t: float(p) for t, p in zip(result.logit_token_ids, result.probs.tolist(),
                                               strict=True)}
    n_layers = model.cfg.n_layers
    activation_nodes = _nodes(result.activations.dimensions[0])
    qk = qk_results(result, modules, attention_scores(model, modules, tokens))
    # the nodes the pruned graph keeps: those with an edge left (as the circuit server does)
    targets, sources = pruned.nonzero()[1]
    kept = {tuple([k, *i]) for k, i in _nodes(targets) + _nodes(sources)}
    qk_named = {tuple([n[0], *n[1]]) for r in qk for side in ("q_marginal", "k_marginal")
                for n in r[side]}
    qk_named |= {tuple([p[0], *p[1]]) for r in qk for p in r["pairs"]}
    qk_named |= {tuple([p[2], *p[3]]) for r in qk for p in r["pairs"]}
    def node_id(key, index):
        return neuronpedia_node(key, index, modules, token_ids, n_layers, probs)["node_id"]

    traced = {}
    for r in qk:  # the same results in Neuronpedia's terms, by node id
        traced[node_id(*r["target"])] = {
            "q_marginal": [[node_id(k, i), v] for k, i, v in r["q_marginal"]],
            "k_marginal": [[node_id(k, i), v] for k, i, v in r["k_marginal"]],
            "pairs": [[node_id(kq, iq), node_id(kk, ik), v] for kq, iq, kk, ik, v in r["pairs"]]}
    nodes = []
    for (k, i), a in zip(activation_nodes, result.activations.data.tolist(), strict=True):
        record = neuronpedia_node(k, i, modules, token_ids, n_layers, probs)
        record |= {"key": k, "index": i, "activation": a}
        if record["feature_type"] == "lorsa":
            record["qk_tracing_results"] = traced.get(record["node_id"])
        nodes.append(record)
    graph = {
        "peer": "llamascopium",
        "peer_version": __import__("importlib.metadata").metadata.version("llamascopium"),
        "transformer_lens_version": __import__("importlib.metadata").metadata.version(
            "transformer-lens"),
        "arch": args.arch, "seed": args.seed, "prompt": args.prompt,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tl_normalization_type": model.cfg.normalization_type,
        "tl_use_qk_norm": bool(getattr(model.cfg, "use_qk_norm", False)),
        "n_layers": n_layers, "n_active_features": n_active,
        "prompt_token_ids": token_ids, "prompt_tokens": result.prompt_tokens,
        "logit_token_ids": result.logit_token_ids, "logit_tokens": result.logit_tokens,
        "logit_probs": result.probs.tolist(),
        "dictionaries": [str(p.relative_to(out)) for p in paths],
        "rows": _nodes(rows), "columns": _nodes(columns),
        "activation_nodes": activation_nodes,
        "activations": result.activations.data.tolist(),
        "nodes": nodes,
        "qk_tracing_results": qk,
        "pruned_nodes": sorted([list(n) for n in kept], key=str),
        # Neuronpedia's qk_only_nodes: nodes QK tracing names that the pruned graph lacks
        "qk_only_nodes": sorted([list(n) for n in qk_named - kept], key=str),
        "timings": timings,
    }
    save_file({"attribution": result.attribution.data.detach().contiguous(),
               "pruned_attribution": pruned.data.detach().contiguous(),
               "activations": result.activations.data.detach().contiguous(),
               "logits": result.logits.detach().contiguous(),
               "probs": result.probs.detach().contiguous()}, str(out / "graph.safetensors"))
    timings["total_s"] = time.perf_counter() - t0
    (out / "graph.json").write_text(json.dumps(graph, indent=1))
    sys.stdout.write(
          f"llamascopium {graph['peer_version']}: {len(rows)} rows x {len(columns)} columns, "
          f"{n_active} active features, {len(qk)} QK-traced Lorsa targets, "
          f"{len(graph['pruned_nodes'])} nodes kept by pruning, {len(graph['qk_only_nodes'])} "
          f"qk-only; import {timings['import_llamascopium_s']:.1f} s, attribute "
          f"{timings['attribute_s']:.1f} s, after import {timings['total_s']:.1f} s\n")
    return graph


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
