"""Our attribution graphs equal circuit-tracer 0.5's, edge for edge, on tiny Llama and Gemma-2
with per-layer JumpReLU, skip and ReLU transcoder sets and a cross-layer transcoder, through its
TransformerLens and its nnsight backends.

Both graphs order their nodes alike — features (layer, position, id), errors (layer-major),
tokens, logits — so the comparison is index for index: the same active features in the same
order and with the same activations, the same logit tokens and probabilities, every edge within
1e-4 of its row's largest ``|edge|``, and the same nodes kept by pruning at 0.8 / 0.98.

Ours are built with circuit-tracer's conventions: its salient logits (``max_n_logits``,
``desired_logit_prob``), each demeaned by the vocabulary mean (``target="demeaned_vocab"``),
and BOS errors as constants rather than nodes (``bos_errors="drop"``: circuit-tracer zeroes the
BOS error vectors). Our default keeps them as nodes: the one difference, checked last.
"""

from __future__ import annotations

import gc

import pytest
import torch

circuit_tracer = pytest.importorskip(
    "circuit_tracer", reason="the peer suite runs in make test-peer's venv (.venv-peer)")

import peer  # noqa: E402  (after the skip: it is only useful next to circuit-tracer)

from pyvene_causaltrace.attribution import attribute  # noqa: E402
from pyvene_causaltrace.transcoders import load_transcoder  # noqa: E402

ARCHS = ("llama", "gemma2")
KINDS = ("jumprelu", "skip", "relu", "clt")
BACKENDS = ("transformerlens", "nnsight")
#: An edge may differ by this much of its row's largest |edge| (float32 on both sides).
EDGE_TOLERANCE = 1e-4
#: Rows per backward in circuit-tracer (its forward holds this many copies of the prompt).
PEER_BATCH = 128
#: circuit-tracer's salient logits: at most 10, until their probability reaches 0.95.
LOGITS = {"max_n_logits": 10, "desired_logit_prob": 0.95}


@pytest.fixture(scope="session")
def our_graphs(worlds, transcoder_files):
    """``our_graphs(arch, kind, logits, bos_errors)``: our graph, built once per model,
    transcoder, logit selection and BOS convention."""
    made = {}

    def get(arch: str, kind: str, logits: dict = LOGITS, bos_errors: str = "drop"):
        key = arch, kind, tuple(logits.items()), bos_errors
        if key not in made:
            world = worlds(arch)
            transcoder = load_transcoder(transcoder_files(kind))
            made[key] = attribute(world.model, world.tokenizer, transcoder, peer.suite.PROMPT,
                                  target="demeaned_vocab", bos_errors=bos_errors, **logits)
        return made[key]

    return get


def _peer_graph(backend: str, world, path, logits: dict = LOGITS):
    """circuit-tracer's graph and its pruned node mask; its replacement model is dropped
    before returning (its ``__del__`` fails if left to interpreter shutdown)."""
    model = peer.replacement_model(backend, world, path)
    try:
        graph = circuit_tracer.attribute(peer.suite.PROMPT, model, batch_size=PEER_BATCH,
                                         **logits)
        return graph, peer.prune_theirs(graph)
    finally:
        del model
        gc.collect()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_graph_equals_circuit_tracers(arch, kind, backend, worlds, transcoder_files,
                                      our_graphs):
    graph = our_graphs(arch, kind)
    peer_graph, peer_kept = _peer_graph(backend, worlds(arch), transcoder_files(kind))
    _check_equal(graph, peer_graph, peer_kept, (arch, kind, backend))


def test_salient_logits_stop_at_the_same_probability(worlds, transcoder_files, our_graphs):
    """The tiny models' next-token distributions are flat: 10 logits never reach 0.95. At a
    lower ``desired_logit_prob`` the cut falls inside the cap, where both must stop at the
    same logit (circuit-tracer: the first whose cumulative probability reaches it; here the
    4th of tiny Gemma-2's, 0.158)."""
    logits = {"max_n_logits": 10, "desired_logit_prob": 0.15}
    graph = our_graphs("gemma2", "jumprelu", logits)
    peer_graph, peer_kept = _peer_graph("transformerlens", worlds("gemma2"),
                                        transcoder_files("jumprelu"), logits)
    assert 1 < len(peer_graph.logit_targets) < 10, "the cut is not inside the cap"
    _check_equal(graph, peer_graph, peer_kept, ("gemma2", "jumprelu p=0.15", "transformerlens"))


def test_kept_bos_errors_are_the_one_difference(worlds, transcoder_files, our_graphs):
    """Our default (``bos_errors="keep"``) gives the BOS errors nodes and edges where
    circuit-tracer has zeros; every other edge is the same."""
    graph = our_graphs("llama", "jumprelu", bos_errors="keep")
    peer_graph, _ = _peer_graph("transformerlens", worlds("llama"), transcoder_files("jumprelu"))
    a, b = peer.ours(graph), peer.theirs(peer_graph)
    bos = a.bos_errors()
    assert a.adjacency[:, bos].abs().amax() > 0.1 * a.adjacency.abs().amax()
    assert not b.adjacency[:, bos].any()
    assert peer.relative_edge_difference(a, b, skip_columns=bos).max() <= EDGE_TOLERANCE


def _check_equal(graph, peer_graph, peer_kept, case):
    """Everything the module docstring lists, recorded in the summary table first."""
    a, b = peer.ours(graph), peer.theirs(peer_graph)

    assert a.input_ids == b.input_ids
    assert torch.equal(a.features, b.features), "different active features or order"
    assert (a.activations - b.activations).abs().max() <= 1e-4 * b.activations.abs().max()
    assert a.logit_tokens == b.logit_tokens
    assert torch.allclose(a.logit_probs, b.logit_probs, atol=1e-5)

    diff = peer.relative_edge_difference(a, b)
    kept = graph.prune(peer.NODE_THRESHOLD, peer.EDGE_THRESHOLD).node_mask
    peer.RESULTS[case] = {
        "features": a.n_features, "logits": len(a.logit_tokens),
        "edge_diff": float(diff.max()),
        "pruned": f"{int(kept.sum())}/{int(peer_kept.sum())}"
                  + ("" if torch.equal(kept, peer_kept) else " DIFFER")}

    worst = int(diff.argmax())
    assert diff.max() <= EDGE_TOLERANCE, (
        f"row {worst} ({graph.label(worst)}): edges differ by {float(diff.max()):.2e} of the "
        f"row's largest")
    assert not a.adjacency[:, a.bos_errors()].any(), "BOS errors dropped, as circuit-tracer's"
    only_ours = (kept & ~peer_kept).nonzero().squeeze(-1)
    only_theirs = (peer_kept & ~kept).nonzero().squeeze(-1)
    assert torch.equal(kept, peer_kept), (
        f"pruned node sets differ: only ours {graph.labels(only_ours)}, only circuit-tracer's "
        f"{graph.labels(only_theirs)}")
