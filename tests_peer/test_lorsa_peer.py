"""The Lorsa peer's own graph (issue 56 item 4): llamascopium's ``attribute`` run by
``tests_peer/lorsa_peer_dump.py`` in ``.venv-lorsa-peer`` (``make test-peer`` builds it), and
checks of that dump's internal consistency — the files in llamascopium's layout, the node
spaces, every row's closure, QK tracing against the attention score. Our graph against it:
``test_lorsa_peer_equality.py``.

The dump is made once per session (the ``lorsa_dump`` fixture, conftest; about 35 s, most of it
llamascopium's imports). Skipped unless the Lorsa peer's venv exists (``PVCT_LORSA_PEER_VENV``
names another); under ``make test-peer`` (``PVCT_LORSA_PEER_REQUIRED``) a missing venv fails.
Only torch and safetensors are needed on this side.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from lorsa_peer import MISSING, SKIP, node
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(SKIP, reason=MISSING)

#: A row's edges sum to its activation within this much of the row's largest |edge| (float32).
CLOSURE_TOLERANCE = 1e-5
#: QK tracing's top-k in the dump (its default): more than any target's nonzero sources.
QK_TOPK = 32


@pytest.fixture(scope="module")
def dump(lorsa_dump):
    return lorsa_dump


def row_closure(graph) -> torch.Tensor:
    """Per row, ``|sum(edges) - activation|`` over the row's largest ``|edge|``."""
    edges = graph["tensors"]["attribution"].double()
    where = {node(n): i for i, n in enumerate(graph["activation_nodes"])}
    activation = graph["tensors"]["activations"].double()
    target = torch.stack([activation[where[node(r)]] for r in graph["rows"]])
    return (edges.sum(1) - target).abs() / edges.abs().amax(1)


def test_the_dictionaries_are_in_llamascopiums_layout(dump):
    for name in dump["dictionaries"]:
        path = dump["out"] / name
        cfg = json.loads((path / "config.json").read_text())
        weights = load_file(str(path / "sae_weights.safetensors"))
        d_model, d_sae = cfg["d_model"], int(cfg["d_model"] * cfg["expansion_factor"])
        norms = {f"dataset_average_activation_norm.{cfg[h]}"
                 for h in ("hook_point_in", "hook_point_out")}
        buffers = {}
        if cfg["sae_type"] == "lorsa":
            heads, width = cfg["n_qk_heads"], cfg["d_qk_head"]
            shapes = {"W_Q": (heads, d_model, width), "W_K": (heads, d_model, width),
                      "W_V": (d_sae, d_model), "W_O": (d_sae, d_model), "b_Q": (heads, width),
                      "b_K": (heads, width), "b_V": (d_sae,), "b_D": (d_model,)}
            if cfg["use_post_qk_ln"]:
                shapes |= {"ln_q.w": (heads, width), "ln_k.w": (heads, width)}
            # buffers saved with the weights: the causal mask, its fill value, the rotary tables
            n_ctx = cfg["n_ctx"]
            buffers = {"mask": (n_ctx, n_ctx), "IGNORE": ()}
            if cfg["positional_embedding_type"] == "rotary":
                buffers |= {"rotary_sin": (n_ctx, cfg["rotary_dim"]),
                            "rotary_cos": (n_ctx, cfg["rotary_dim"])}
            assert weights["mask"].dtype == torch.bool
            assert torch.equal(weights["mask"], torch.ones(n_ctx, n_ctx, dtype=torch.bool).tril())
            assert cfg["hook_point_out"].endswith("hook_attn_out")
        else:
            assert cfg["sae_type"] == "sae"
            shapes = {"W_E": (d_model, d_sae), "b_E": (d_sae,), "W_D": (d_sae, d_model),
                      "b_D": (d_model,)}
            assert cfg["hook_point_out"].endswith("hook_mlp_out")
        assert set(weights) == set(shapes) | set(buffers) | norms, name
        assert {k: tuple(weights[k].shape) for k in shapes | buffers} == shapes | buffers, name
        assert all(weights[k].dtype == torch.float32 for k in weights if k != "mask"), name


def test_the_node_spaces(dump):
    n_layers, n_pos = dump["n_layers"], len(dump["prompt_token_ids"])
    rows = [node(r) for r in dump["rows"]]
    columns = [node(c) for c in dump["columns"]]
    n_logits = len(dump["logit_token_ids"])
    # rows: the logits, then every active feature (max_features = their count: all collected)
    assert [r[1] for r in rows[:n_logits]] == dump["logit_token_ids"]
    assert len(rows) == n_logits + dump["n_active_features"]
    # columns: token embeddings and each module's error per position, then the same features
    fixed = len(columns) - dump["n_active_features"]
    assert fixed == n_pos * (1 + 2 * n_layers)
    assert columns[fixed:] == rows[n_logits:]
    assert len(set(columns)) == len(columns)
    kinds = Counter(n["feature_type"] for n in dump["nodes"])
    assert kinds["embedding"] == n_pos and kinds["logit"] == n_logits
    assert kinds["lorsa error"] == kinds["mlp reconstruction error"] == n_layers * n_pos
    assert kinds["lorsa"] > 0 and kinds["cross layer transcoder"] > 0
    assert kinds["lorsa"] + kinds["cross layer transcoder"] == dump["n_active_features"]
    # Neuronpedia's layers: 2l for Lorsa (attention), 2l + 1 for the MLP's transcoder
    for n in dump["nodes"]:
        if n["feature_type"] in ("lorsa", "lorsa error", "cross layer transcoder",
                                 "mlp reconstruction error"):
            layer = int(n["key"].split(".")[1])
            assert n["layer"] == 2 * layer + ("lorsa" not in n["feature_type"]), n
    assert len({n["node_id"] for n in dump["nodes"]}) == len(dump["nodes"])


def test_activations_and_logits(dump):
    activation = dict(zip((node(n) for n in dump["activation_nodes"]),
                          dump["activations"], strict=True))
    for n in dump["columns"]:
        if not n[0].endswith("hook_feature_acts"):  # embeddings and errors weigh 1
            assert activation[node(n)] == 1.0
    # TopK: at most top_k active features per module and position, all of them positive
    per_site = Counter((n[0], n[1][0]) for n in dump["rows"] if n[0].endswith("feature_acts"))
    configs = [json.loads((dump["out"] / d / "config.json").read_text())
               for d in dump["dictionaries"]]
    top_k = {cfg["hook_point_out"]: cfg["top_k"] for cfg in configs}
    for (key, _), count in per_site.items():
        assert count <= top_k[key.removesuffix(".sae.hook_feature_acts")]
    assert all(activation[node(n)] > 0 for n in dump["rows"] if n[0].endswith("feature_acts"))
    probs = dump["logit_probs"]
    assert probs == sorted(probs, reverse=True)
    settings = dump["settings"]
    assert len(probs) == settings["max_n_logits"] or sum(probs) >= settings["desired_logit_prob"]


@pytest.mark.numerics
def test_every_row_sums_to_its_activation(dump):
    """The dictionaries' biases are zero and the model has none, LayerNorm scales and attention
    patterns (the model's and Lorsa's) are frozen: each row — a logit's demeaned value, a
    feature's activation — is linear in the embeddings, errors and features, so its edges sum
    to it."""
    closure = row_closure(dump)
    assert closure.max() < CLOSURE_TOLERANCE, closure.max()


def test_qk_tracing(dump):
    rows = {node(r) for r in dump["rows"]}
    results = dump["qk_tracing_results"]
    assert results, "no Lorsa target was QK-traced"
    lorsa = [n for n in dump["nodes"] if n["feature_type"] == "lorsa"]
    assert sum(n["qk_tracing_results"] is not None for n in lorsa) == len(results)
    for r in results:
        target = node(r["target"])
        assert target in rows and target[0].endswith("hook_attn_out.sae.hook_feature_acts")
        assert r["k_pos"] <= target[1]  # causal
        for side in ("q_marginal", "k_marginal"):
            values = [v for *_, v in r[side]]
            assert len(values) < QK_TOPK, "truncated: the sums below would not hold"
            # the top-k of signed values: positive contributions only, largest first
            assert values == sorted(values, reverse=True) and all(v > 0 for v in values)
            # every positive contribution is listed: they sum to at least the score
            assert sum(values) >= r["score"] - 1e-5 * max(1.0, abs(r["score"]))
        if target[0].startswith("blocks.0."):
            # layer 0's queries and keys read one embedding each: one source per side, and
            # the pair of the two is the whole score; a negative score lists nothing at all
            if r["score"] <= 0:
                assert r["q_marginal"] == r["k_marginal"] == r["pairs"] == []
                continue
            assert len(r["q_marginal"]) == len(r["k_marginal"]) == 1
            assert r["q_marginal"][0][:2] == ["hook_embed", [target[1]]]
            assert r["k_marginal"][0][:2] == ["hook_embed", [r["k_pos"]]]
            for side in ("q_marginal", "k_marginal"):
                assert r[side][0][2] == pytest.approx(r["score"], rel=1e-5, abs=1e-6)
            assert r["pairs"][0][4] == pytest.approx(r["score"], rel=1e-5, abs=1e-6)


def test_pruning_and_qk_only_nodes(dump):
    edges, pruned = dump["tensors"]["attribution"], dump["tensors"]["pruned_attribution"]
    kept = pruned != 0
    assert torch.equal(pruned[kept], edges[kept])  # pruning only zeroes edges
    assert kept[: len(dump["logit_token_ids"])].any(1).all()  # every logit keeps an edge
    in_graph = {tuple(n) for n in dump["pruned_nodes"]}
    named = set()  # the sources QK tracing names (its targets are the graph's own nodes)
    for r in dump["qk_tracing_results"]:
        named |= {node(n) for side in ("q_marginal", "k_marginal") for n in r[side]}
        named |= {node(p[:2]) for p in r["pairs"]} | {node(p[2:4]) for p in r["pairs"]}
    assert {tuple(n) for n in dump["qk_only_nodes"]} == {n for n in named if n not in in_graph}
