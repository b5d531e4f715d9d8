"""Lorsa OV heads as graph nodes: ``attribute(..., attention=lorsa)``.

A Lorsa layer's attention output is replaced in the local replacement model by the Lorsa's
reconstruction plus an error leaf (``lorsa_splice`` in leaf mode,
:class:`~..interventions.lorsa_splice.LorsaSplice`): its QK patterns and TopK active set are
the clean run's, its input ``x / rms(x)`` has the norm's statistic frozen, so an OV head's
activation ``sum_k pattern[h // group, p, k] (x_k . W_V[h] + b_V[h])`` is linear in the
residual stream. Nodes: the active heads ``(layer, position, head)`` after the transcoder's
features (they share the feature budget, the ranking and pruning), and a ``lorsa error`` per
(Lorsa layer, position) after the MLP errors. A head's row target is its activation without
``b_V`` (as a transcoder feature's is ``W_enc . x`` without ``b_enc``): the seed on the Lorsa
input is ``pattern[h // group, p, :, None] * W_V[h]``. ``b_D`` joins the constants."""

from __future__ import annotations

from pathlib import Path

import torch

from ..fingerprint import tensors_fingerprint
from ..interventions.splice_session import SpliceSession
from ..transcoders.lorsa import LorsaSet


def lorsa_leaves(lorsa: LorsaSet | None, session: SpliceSession) -> dict:
    """The :class:`~.replacement.ReplacementRun` fields of a leaf-mode Lorsa splice's
    ``session`` (none without ``lorsa``)."""
    if lorsa is None:
        return {}
    leaves = dict(session.leaves)
    session.clear()
    layers = sorted(lorsa.layers)
    return {"lorsa_layers": layers,
            **{f"lorsa_{name}": [leaves[key][layer] for layer in layers]
               for name, key in (("heads", "heads"), ("errors", "errors"),
                                 ("inputs", "inputs"), ("biases", "b_D"))}}


def slots_of(run, index: torch.Tensor) -> list[int]:
    """The ``run.lorsa_*`` slot of each Lorsa node in ``index`` (graph feature indices)."""
    slots = {layer: slot for slot, layer in enumerate(run.lorsa_layers)}
    return [slots[layer] for layer in run.feature_layer[index].tolist()]


def lorsa_seed(run, node: int, slot: int) -> torch.Tensor:
    """``[P, D]``: the gradient of Lorsa node ``node``'s activation (no ``b_V``) on its Lorsa
    input (module docstring); ``run.encoder_rows[node]`` is its ``W_V`` row."""
    heads = run.lorsa_heads[slot]
    weights = heads.pattern[int(run.feature_id[node]) // heads.group,
                            int(run.feature_position[node])]
    row = run.encoder_rows[node]
    return weights[:, None].to(row.dtype) * row[None, :]


def lorsa_targets_and_magnitudes(run, index: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations without ``b_V`` of Lorsa nodes ``index`` from the live inputs, and the sums
    of their terms' magnitudes (float64), as :func:`~.edges.feature_targets_and_magnitudes`."""
    targets, magnitudes = [], []
    for node, slot in zip(index.tolist(), slots_of(run, index), strict=True):
        x = run.lorsa_inputs[slot][0]
        terms = lorsa_seed(run, node, slot) * x.to(run.encoder_rows.dtype)
        targets.append(terms.sum())
        magnitudes.append(terms.detach().abs().sum(dtype=torch.float64))
    return torch.stack(targets), torch.stack(magnitudes)


def lorsa_seeds(run, index: torch.Tensor, rows: torch.Tensor, batch: int
                ) -> tuple[list, list]:
    """Batched gradient seeds of Lorsa nodes ``index``, which are rows ``rows`` of a batch of
    ``batch``: per Lorsa input they read, that input and a ``[batch, 1, P, D]`` seed."""
    outputs, seeds = [], []
    slots = torch.tensor(slots_of(run, index), dtype=torch.long)
    for slot in slots.unique().tolist():
        state = run.lorsa_inputs[slot]
        seed = torch.zeros(batch, *state.shape, dtype=state.dtype, device=state.device)
        for j in (slots == slot).nonzero().squeeze(-1).tolist():
            seed[int(rows[j]), 0] = lorsa_seed(run, int(index[j]), slot).to(state.dtype)
        outputs.append(state)
        seeds.append(seed)
    return outputs, seeds


def lorsa_fingerprint(lorsa: LorsaSet) -> str:
    """Fingerprint of a Lorsa set's tensors (every layer's, loaded)."""
    return tensors_fingerprint([(f"{layer}.{name}", tensor)
                                for layer in sorted(lorsa.layers)
                                for name, tensor in lorsa[layer].tensors().items()])


def lorsa_metadata(lorsa: LorsaSet | None, run) -> dict | None:
    """What a graph's metadata says of its Lorsa nodes: the layers, the first Lorsa feature
    node, the set's source and model, each layer's OV heads and TopK (None without one)."""
    if lorsa is None:
        return None
    return {"layers": list(run.lorsa_layers), "first_node": run.n_transcoder_features,
            "source": lorsa.source, "model_name": lorsa.model_name,
            "n_ov_heads": {str(layer): lorsa[layer].cfg.n_ov_heads for layer in lorsa.layers},
            "top_k": {str(layer): lorsa[layer].cfg.top_k for layer in lorsa.layers}}


def source_set(source: str | None) -> str | None:
    """A dictionary set's name as Neuronpedia lists source sets: its directory's name."""
    return None if not source else Path(str(source)).expanduser().name or str(source)


def lorsa_info(graph) -> dict:
    """The graph JSON's ``metadata.info`` entries of a graph with Lorsa nodes (none
    without): the source-set names and how the ids and layers were written."""
    meta = graph.metadata.get("lorsa")
    if not meta:
        return {}
    transcoder = graph.metadata.get("transcoder") or {}
    return {"source_sets": {"lorsa": source_set(meta.get("source")),
                            "transcoder": transcoder.get("scan")
                            or source_set(transcoder.get("source"))},
            "lorsa": {**meta, "node_layers": "OpenMOSS sublayers: 2 l Lorsa heads and errors, "
                                             "2 l + 1 transcoder features and MLP errors, "
                                             "2 L logits; feature = layer * 10^ceil(log10 "
                                             "n_ov_heads) + head"}}


def qk_tracing_json(graph, node_id, shown: set[str]) -> dict:
    """The graph JSON's ``qk_tracing_results`` (by target node id, in Neuronpedia CRM's QK
    lists as :mod:`.attention` writes them: ``top_q_marginal_contributors`` and
    ``top_k_marginal_contributors`` ``[[node id, value]]``, ``pair_wise_contributors``
    ``[[q node id, k node id, value]]``, the constants named ``"constants"``; with the QK
    head, key position and score; :func:`~.lorsa_qk.trace_lorsa_qk`) and
    ``qk_only_nodes`` (the ids they name that the pruned graph does not show); empty without
    results."""
    results = graph.metadata.get("qk_tracing_results") or []
    if not results:
        return {}

    def name(column: int) -> str:
        return "constants" if column < 0 else node_id(graph, column)

    out, named = {}, set()
    for r in results:
        entry = {"qk_head": r["qk_head"], "k_pos": r["key_position"], "score": r["score"],
                 "top_q_marginal_contributors": [[name(c), v] for c, v in r["q_marginal"]],
                 "top_k_marginal_contributors": [[name(c), v] for c, v in r["k_marginal"]],
                 "pair_wise_contributors": [[name(q), name(k), v] for q, k, v in r["pairs"]]}
        out[node_id(graph, r["node"])] = entry
        named |= {n for side in ("top_q_marginal_contributors", "top_k_marginal_contributors")
                  for n, _ in entry[side]}
        named |= {n for q, k, _ in entry["pair_wise_contributors"] for n in (q, k)}
    return {"qk_tracing_results": out,
            "qk_only_nodes": sorted(named - shown - {"constants"})}
