"""Our attribution through Lorsa and transcoders equals llamascopium's (issue 56 item 4).

The dump (``lorsa_dump``, conftest: tiny Qwen3, a Lorsa and a TopK transcoder per layer written
by llamascopium 2.0.0b34, and its own ``attribute`` with QK tracing) is read back with OUR
loaders — the Hugging Face model it saved, ``load_lorsa`` and ``load_transcoder`` (format
``llamascopium``) on its ``dictionaries/`` — and our ``attribute(..., attention=lorsa)`` is
compared with its graph, every node mapped by name (``(key, index)``, :mod:`lorsa_peer`),
never by position: the same nodes (features, Lorsa heads, errors, embeddings, logits) with
the same activations, every edge within 1e-5 of its row's largest ``|edge|``, and QK tracing
(key position, score, both marginals, pairs) within 1e-5 of the target's largest term.

Conventions (docs/attribution.md, "Against llamascopium"), and how each is met here:

1. BOS is spliced in theirs (Lorsa and transcoder at position 0, BOS features and errors are
   nodes): ours with ``bos="never"``; our default leaves position 0 unspliced
   (``test_our_default_bos_is_the_named_difference``).
2. Their logit rows are ``logit - mean(logit)`` over the vocabulary: ours with
   ``target="demeaned_vocab"``; salient logits with their ``max_n_logits`` 5 and
   ``desired_logit_prob`` 0.95 (the same rule as circuit-tracer's).
3. Their embedding and error nodes have activation 1, a feature's is its activation, a
   logit's its demeaned value; ours keep activations for features only: compared there.
4. Their transcoders read ``ln2.hook_normalized`` under TransformerLens's ``fold_ln`` (x/rms(x)
   without the norm's gain) and rank TopK by ``pre * |W_D row|``: our ``llamascopium``
   format reads the same hook (our hook is the norm's input over its RMS) and ranks by
   ``score_weight`` = the decoder norms (``test_ranking_by_the_decoder_norm_matters``).
5. QK tracing: theirs lists the signed top-k (positive terms only) and its bias leaves per
   position; ours ranks by magnitude with one constants entry. Compared: every term they
   list equals ours, every positive term of ours is listed by them (their ``qk_topk`` 32 is
   more than any target's terms), our constants are 0 (the fixture's biases are 0, as their
   bias leaves then are). Pairs: each pair they list has our value (a set, since theirs may
   list a pair twice through its Q and its K pick), and their largest is our largest among
   their candidates, the pairs of a node with a positive marginal (a Q or a K pick: a pair
   can be positive while both its nodes' marginals are negative, and then only ours lists it,
   2 of 97 targets here).
6. Their rows: logits then features in greedy order; columns: embeddings, errors
   module by module, features. Ours: features, errors, tokens, logits. Mapped by name.
7. Pruning (their 0.6 / 0.8 on the unpruned matrix, ours 0.8 / 0.98) is a reading, not the
   graph: not compared.
8. Biases: the fixture's dictionaries have none (their bias leaves would be per-position
   nodes, ours one constants column), so every row closes on both sides.
"""

from __future__ import annotations

import pytest
import torch
from lorsa_peer import MISSING, RESULTS, SKIP, edge_differences, node, our_graph

pytestmark = pytest.mark.skipif(SKIP, reason=MISSING)

#: An edge may differ by this much of its row's largest |edge| (float32 on both sides; the
#: issue's bar). Seen: 2.0e-6.
EDGE_TOLERANCE = 1e-5
#: QK terms, relative to the target's largest term on that side.
QK_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ours(lorsa_dump):
    return our_graph(lorsa_dump)


def feature_nodes(names) -> set:
    return {n for n in names if n[0].endswith("hook_feature_acts")}


def test_the_same_nodes_and_activations(lorsa_dump, ours):
    theirs = {node(n) for n in lorsa_dump["activation_nodes"]}
    assert set(ours.names) == theirs, (
        f"only ours: {sorted(set(ours.names) - theirs)[:8]}, only theirs: "
        f"{sorted(theirs - set(ours.names))[:8]}")
    kinds = {key.split(".")[-1] for key, *_ in theirs}
    assert kinds == {"hook_embed", "error", "hook_feature_acts", "logits"}
    assert any("hook_attn_out.sae" in n[0] for n in theirs), "no Lorsa head is active"
    # every active feature and head is a row of both (all explored)
    rows = {node(r) for r in lorsa_dump["rows"]}
    assert feature_nodes(theirs) <= rows
    assert bool(ours.graph.explored.all())
    activation = dict(zip((node(n) for n in lorsa_dump["activation_nodes"]),
                          lorsa_dump["activations"], strict=True))
    index = ours.index
    features = sorted(feature_nodes(theirs))
    mine = torch.tensor([float(ours.graph.activation[index[n]]) for n in features])
    peer = torch.tensor([activation[n] for n in features])
    worst = float(((mine - peer).abs() / peer.abs()).max())
    RESULTS["feature activations, max relative difference"] = f"{worst:.2e}"
    assert worst <= 1e-5
    assert [int(t["token"]) for t in ours.graph.targets] == lorsa_dump["logit_token_ids"]
    probs = torch.tensor([float(t["prob"]) for t in ours.graph.targets])
    assert torch.allclose(probs, torch.tensor(lorsa_dump["logit_probs"]), atol=1e-6)
    RESULTS["nodes (features / Lorsa heads / errors / tokens / logits)"] = "/".join(
        str(sum(1 for n in theirs if test(n))) for test in (
            lambda n: "mlp_out.sae" in n[0], lambda n: "attn_out.sae" in n[0],
            lambda n: n[0].endswith(".error"), lambda n: n[0] == "hook_embed",
            lambda n: n[0] == "logits"))


@pytest.mark.numerics
def test_every_edge_equals_theirs(lorsa_dump, ours):
    diff = edge_differences(lorsa_dump, ours)
    worst = int(diff.argmax())
    RESULTS["edges, max |ours - theirs| / row's largest"] = (
        f"{float(diff.max()):.2e} over {len(diff)} rows x {len(lorsa_dump['columns'])} columns")
    assert diff.max() <= EDGE_TOLERANCE, (
        f"row {lorsa_dump['rows'][worst]}: edges differ by {float(diff.max()):.2e} of the "
        "row's largest")


def qk_differences(lorsa_dump, ours) -> dict[str, float]:
    """Our QK tracing of their targets against theirs (convention 5), worst cases."""
    from pyvene_causaltrace.attribution.lorsa_qk import trace_lorsa_qk
    from pyvene_causaltrace.bound import bind

    index, names = ours.index, ours.names
    results = lorsa_dump["qk_tracing_results"]
    mine = trace_lorsa_qk(bind(ours.model), ours.transcoder, ours.lorsa, ours.graph,
                          [index[node(r["target"])] for r in results], n_top=10**6)
    worst = dict.fromkeys(("score", "marginals", "unlisted", "constants", "pairs"), 0.0)
    for theirs, ours_r in zip(results, mine, strict=True):
        assert ours_r["key_position"] == theirs["k_pos"], theirs["target"]
        worst["score"] = max(worst["score"], abs(ours_r["score"] - theirs["score"])
                             / max(1.0, abs(theirs["score"])))
        for side in ("q_marginal", "k_marginal"):
            terms = {(names[c] if c >= 0 else "constants"): v for c, v in ours_r[side]}
            scale = max([abs(v) for v in terms.values()] + [1e-30])
            listed = {node(e[:2]): e[2] for e in theirs[side]}
            worst["marginals"] = max([worst["marginals"]] + [
                abs(terms.get(n, 0.0) - v) / scale for n, v in listed.items()])
            worst["unlisted"] = max([worst["unlisted"]] + [
                v / scale for n, v in terms.items() if n not in listed and v > 0])
            worst["constants"] = max(worst["constants"],
                                     abs(terms.get("constants", 0.0)) / scale)
        pairs = {(names[a] if a >= 0 else "constants", names[b] if b >= 0 else "constants"): v
                 for a, b, v in ours_r["pairs"]}
        scale = max([abs(v) for v in pairs.values()] + [1e-30])
        for p in theirs["pairs"]:
            worst["pairs"] = max(worst["pairs"], abs(pairs.get(
                (node(p[:2]), node(p[2:4])), float("inf")) - p[4]) / scale)
        # their candidates: pairs of a node with a positive marginal (a Q or a K pick)
        picks = [{node(e[:2]) for e in theirs[side]} for side in ("q_marginal", "k_marginal")]
        candidates = [v for (q, k), v in pairs.items() if q in picks[0] or k in picks[1]]
        if theirs["pairs"]:
            worst["pairs"] = max(worst["pairs"],
                                 abs(max(candidates) - theirs["pairs"][0][4]) / scale)
    return worst


def test_qk_tracing_equals_theirs(lorsa_dump, ours):
    worst = qk_differences(lorsa_dump, ours)
    RESULTS["QK tracing, worst relative differences"] = (
        f"{len(lorsa_dump['qk_tracing_results'])} targets: "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert max(worst.values()) <= QK_TOLERANCE, worst


# ------------------------------------------------------------------ conventions, controls


def test_our_default_bos_is_the_named_difference(lorsa_dump):
    """Our default (``bos="auto"``: the tokenizer adds a BOS, so position 0 is unspliced)
    lacks exactly their position-0 features and Lorsa heads (convention 1)."""
    default = our_graph(lorsa_dump, bos="auto")
    theirs = {node(n) for n in lorsa_dump["activation_nodes"]}
    missing = theirs - set(default.names)
    assert missing and all(n[0].endswith("hook_feature_acts") and n[1] == 0 for n in missing)
    assert set(default.names) <= theirs


def test_ranking_by_the_decoder_norm_matters(lorsa_dump):
    """Control: the same transcoders ranked by ``relu(pre)`` alone (no ``score_weight``)
    choose other features, so the node sets differ (convention 4)."""
    from pyvene_causaltrace.transcoders import load_transcoder

    plain = load_transcoder(lorsa_dump["out"] / "dictionaries")
    assert plain.score_weight is not None
    plain.score_weight = None
    changed = our_graph(lorsa_dump, transcoder=plain)
    theirs = {node(n) for n in lorsa_dump["activation_nodes"]}
    assert feature_nodes(changed.names) != feature_nodes(theirs)


def test_a_changed_lorsa_head_breaks_the_equality(lorsa_dump):
    """Control: one active Lorsa OV head's ``W_V`` scaled by 1.001 moves its row's edges by
    about 1e-3 of the row's largest, past the tolerance: the comparison sees one head."""
    row = next(node(r) for r in lorsa_dump["rows"] if "attn_out.sae" in r[0])
    layer, head = int(row[0].split(".")[1]), row[2]

    def edit(lorsa):
        lorsa[layer].W_V[head] *= 1.001

    changed = our_graph(lorsa_dump, lorsa_edit=edit)
    diff = edge_differences(lorsa_dump, changed)
    assert diff.max() > EDGE_TOLERANCE
    worst = node(lorsa_dump["rows"][int(diff.argmax())])
    assert worst[0] == row[0] and worst[2] == head, worst
