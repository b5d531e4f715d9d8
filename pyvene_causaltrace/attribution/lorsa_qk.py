"""QK tracing of Lorsa target nodes (:mod:`.lorsa_nodes`): a Lorsa head's QK score split over
the graph's nodes on the query side and on the key side, as :mod:`.qk` does for the model's
heads. The query and key of the head's QK head are linear in the residual stream (the input's
norm statistic and the post-QK norm's frozen, rotary linear), so each is the sum of its
columns' parts plus constants (one batched backward per side, the features' gradients from
the errors' as for rows, :mod:`.leaf_grads`; checked to sum to the vector);
the score ``q . k / attn_scale`` is the sum of the bilinear terms. Conventions against
llamascopium's (``compute_qk_tracing``): one key per target (the clean pattern's argmax, as
theirs) unless given; marginals and pairs ranked by magnitude (theirs: the signed top-k, so
negative terms never appear); constants as one column -1 (theirs: ``b_Q``/``b_K`` and the
model's biases as per-position leaves); pairs among each side's largest marginals (theirs:
a second backward per pick).

    results = lorsa_qk_tracing(run, lorsa, node)     # run: the graph's ReplacementRun"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..bound import BoundModel
from ..errors import ClosureError, InputError
from ..model_guard import measured
from ..transcoders.lorsa import Lorsa, LorsaSet, _rotate, rotary_tables
from ..transcoders.transcoder import Transcoder
from .edges import CLOSURE_TOLERANCE, edges_from_grads
from .graph_replay import graph_run
from .leaf_grads import leaf_grads
from .lorsa_nodes import slots_of

if TYPE_CHECKING:  # annotations only
    from .graph import AttributionGraph

__all__ = ["QK_TOP", "lorsa_qk_tracing", "trace_lorsa_qk"]

#: QK tracing's top-k per side and of pairs (llamascopium's ``qk_topk`` default is 10).
QK_TOP = 10


def _qk_vectors(lorsa: Lorsa, x: torch.Tensor, qk_head: int, query: int, key: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(query, its b_Q part), (key, its b_K part)]``: QK head ``qk_head``'s query at
    ``query`` and key at ``key`` (post-QK norm with its statistic frozen, rotary) from the live
    input ``x [1, P, D]``, each linear in the graph's nodes plus constants, and what its bias
    alone contributes through the same (frozen) transform (a constant)."""
    cfg = lorsa.cfg
    x = x[0].to(lorsa.dtype)
    sides = []
    for weight, bias, norm, at in ((lorsa.W_Q, lorsa.b_Q, "ln_q_w", query),
                                   (lorsa.W_K, lorsa.b_K, "ln_k_w", key)):
        pre = x @ weight[qk_head] + bias[qk_head]
        parts = [pre, bias[qk_head].expand_as(pre)]
        if cfg.use_post_qk_ln:  # RMSNormPerHead (models/lorsa.py:1046-1052), statistic frozen
            root = (pre.float().pow(2).mean(-1, keepdim=True) + cfg.eps).sqrt().detach()
            gain = getattr(lorsa, norm)[qk_head].float()
            parts = [(t.float() / root * gain).to(pre.dtype) for t in parts]
        if cfg.rotary:
            sin, cos = rotary_tables(cfg, x.shape[0], lorsa.dtype, x.device)
            parts = [_rotate(t, cfg, sin, cos) for t in parts]
        sides.append((parts[0][at], parts[1][at].detach()))
    return sides


def _side(run, vector: torch.Tensor, bias_part: torch.Tensor, what: str) -> torch.Tensor:
    """``[n_columns + 1, d]``: each graph column's part of ``vector`` (one batched backward,
    :func:`~.leaf_grads.leaf_grads`), the last row the constants' (the model's biases,
    ``b_dec``, ``b_D`` and ``bias_part``); refused unless they sum to it."""
    d = vector.shape[0]
    seeds = torch.eye(d, dtype=vector.dtype, device=vector.device)
    rows, constants = edges_from_grads(run, leaf_grads(run, vector, seeds), batch=d)
    constants = constants.double() + bias_part.double().to(constants.device)
    parts = torch.cat([rows.T.double(), constants[None]]).cpu()
    value = vector.detach().double().cpu()
    scale = float(parts.abs().sum(0).max()) + float(value.abs().max())
    worst = float((parts.sum(0) - value).abs().max())
    if worst > CLOSURE_TOLERANCE * max(scale, 1e-30):
        raise ClosureError(f"the Lorsa {what}'s node parts do not sum to it (residual "
                           f"{worst:.3g} of {scale:.3g})")
    return parts


def lorsa_qk_tracing(run, lorsa: LorsaSet, node: int, *, key_pos: int | None = None,
                     n_top: int = QK_TOP) -> dict:
    """QK tracing of Lorsa node ``node`` (a graph feature index past the transcoder's): its QK
    head's pre-softmax score at (its position, ``key_pos``; default the key the clean pattern
    weights most, llamascopium's one key per target) split over the graph's columns on the
    query side and on the key side. ``q_marginal``/``k_marginal``: the ``n_top`` columns of
    largest ``|part . other side| / attn_scale`` (column -1: the constants, ``b_Q``/``b_K`` and
    the model's biases); each side's marginals over every column sum to ``score``. ``pairs``:
    the ``n_top`` largest ``|q part . k part| / attn_scale`` among the ``4 n_top`` largest
    marginals of each side."""
    if node < run.n_transcoder_features or node >= run.n_features:
        raise InputError(f"node {node} is not a Lorsa node (those are {run.n_transcoder_features}"
                         f"..{run.n_features - 1})")
    slot = slots_of(run, torch.tensor([node]))[0]
    layer, heads = run.lorsa_layers[slot], run.lorsa_heads[slot]
    head, position = int(run.feature_id[node]), int(run.feature_position[node])
    qk_head = head // heads.group
    if key_pos is None:
        key_pos = int(heads.pattern[qk_head, position].argmax())
    if not 0 <= key_pos <= position:
        raise InputError(f"key_pos {key_pos} is outside 0..{position} (the query's position)")
    one = lorsa[layer]
    with torch.enable_grad():
        (q, q_bias), (k, k_bias) = _qk_vectors(one, run.lorsa_inputs[slot], qk_head,
                                               position, key_pos)
        q_parts, k_parts = _side(run, q, q_bias, "query"), _side(run, k, k_bias, "key")
    scale = 1.0 / float(one.cfg.attn_scale)
    q_marg = scale * (q_parts @ k_parts.sum(0))
    k_marg = scale * (k_parts @ q_parts.sum(0))
    columns = torch.arange(len(q_parts))
    columns[-1] = -1

    def top(values: torch.Tensor, n: int) -> torch.Tensor:
        live = values.ne(0).nonzero().squeeze(-1)
        return live[values[live].abs().argsort(descending=True)[:n]]

    qi, ki = top(q_marg, 4 * n_top), top(k_marg, 4 * n_top)
    pair = scale * q_parts[qi] @ k_parts[ki].T
    flat = pair.flatten()
    best = flat.abs().argsort(descending=True)[:n_top]
    return {"node": node, "layer": layer, "position": position, "head": head,
            "qk_head": qk_head, "key_position": key_pos,
            "score": scale * float(q_parts.sum(0) @ k_parts.sum(0)),
            "q_marginal": [[int(columns[i]), float(q_marg[i])] for i in top(q_marg, n_top)],
            "k_marginal": [[int(columns[i]), float(k_marg[i])] for i in top(k_marg, n_top)],
            "pairs": [[int(columns[qi[b // len(ki)]]), int(columns[ki[b % len(ki)]]),
                       float(flat[b])] for b in best.tolist()],
            "q_total": float(q_marg.sum()), "k_total": float(k_marg.sum())}


@measured
def trace_lorsa_qk(model: BoundModel, transcoder: Transcoder, lorsa: LorsaSet,
                   graph: AttributionGraph, nodes: list[int] | None = None, *,
                   n_top: int = QK_TOP) -> list[dict]:
    """:func:`lorsa_qk_tracing` of ``graph``'s Lorsa ``nodes`` (default: those its default
    pruning keeps) on the graph's replayed forward (refused unless its nodes are the graph's,
    :func:`~.graph_replay.graph_run`); the results are also kept in
    ``graph.metadata["qk_tracing_results"]``, which the graph JSON writes as Neuronpedia's
    ``qk_tracing_results`` and ``qk_only_nodes``."""
    if not graph.lorsa_layers:
        raise InputError("the graph has no Lorsa nodes: build it with attribute(..., "
                         "attention=lorsa)")
    if nodes is None:
        kept = graph.prune().node_mask.nonzero().squeeze(-1)
        nodes = [int(i) for i in kept if graph.node_kind(int(i)) == "lorsa"]
    run = graph_run(model, transcoder, graph, lorsa=lorsa)
    results = [lorsa_qk_tracing(run, lorsa, int(node), n_top=n_top) for node in nodes]
    graph.metadata["qk_tracing_results"] = results
    return results

