"""Edges: ``x_i * d(row target) / d(x_i)`` for every node ``i``, and the closure check.

A row of the adjacency belongs to a target — the answer's :class:`~.targets.Target` or one
active feature's pre-activation ``W_enc[l, f] . x[l, pos]`` — and has one column per
node: features, then errors (layer-major, then position), then tokens (one per position: token
and position embeddings together). What the model's additive constants (``b_dec``, attention and
LayerNorm biases) contribute is kept beside the row, so ``row.sum() + constant == target`` is a
check, not a definition.

:func:`feature_rows` computes many feature rows per backward pass by batching the gradient
seeds (``torch.autograd.grad(..., is_grads_batched=True)``): the forward graph is built once
and never replicated. :func:`feature_rows_loop` is the obviously correct one-backward-per-node
reference it is tested against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .replacement import ReplacementRun
from .targets import Target


def edges_from_grads(run: ReplacementRun, grads: Sequence[torch.Tensor | None],
                     batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [B, n_nodes], constant [B])`` from gradients on ``run.inputs()`` (leading batch
    dim ``B`` when ``batch`` is given; ``None`` gradients are zeros), in the leaves' dtype."""
    inputs = run.inputs()
    lead = () if batch is None else (batch,)
    grads = [torch.zeros(*lead, *x.shape, dtype=x.dtype, device=x.device) if g is None else g
             for x, g in zip(inputs, grads, strict=True)]
    if batch is None:
        grads = [g[None] for g in grads]
    n_layers, n_emb = run.n_layers, len(run.embeddings)
    k = len(run.feature_values)
    feature_grads = grads[:k]
    error_grads = grads[k:k + n_layers]
    emb_grads = grads[k + n_layers:k + n_layers + n_emb]
    bias_grads = grads[k + n_layers + n_emb:]
    parts = [(v.detach() * g) for v, g in zip(run.feature_values, feature_grads, strict=True)]
    for e, g in zip(run.errors, error_grads, strict=True):
        parts.append((e.detach() * g).sum(-1).reshape(g.shape[0], -1))
    tokens = sum((e.detach() * g).sum(-1).reshape(g.shape[0], -1)
                 for e, g in zip(run.embeddings, emb_grads, strict=True))
    parts.append(tokens)
    rows = torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)
    constant = sum((c.detach() * g).reshape(g.shape[0], -1).sum(1)
                   for c, g in zip([run.b_dec, *run.constants], bias_grads, strict=True))
    return rows, torch.as_tensor(constant, dtype=rows.dtype).reshape(-1)


@dataclass(frozen=True)
class Closure:
    """How well a row's edges (plus constants) add up to its target."""

    target: float
    edges: float
    constant: float

    @property
    def residual(self) -> float:
        return self.edges + self.constant - self.target

    @property
    def relative(self) -> float:
        return abs(self.residual) / max(abs(self.target), 1e-12)

    def to_dict(self) -> dict:
        return {"target": self.target, "edges": self.edges, "constant": self.constant,
                "residual": self.residual, "relative": self.relative}


def target_row(run: ReplacementRun, target: Target) -> tuple[torch.Tensor, float, Closure]:
    """The target's row (one backward), its constant and its :class:`Closure`."""
    if run.input_ids.shape[0] != 1:
        raise ValueError("edges are computed for one prompt: run input_ids of shape [1, P]")
    value = target(run.logits)
    grads = torch.autograd.grad(value, run.inputs(), retain_graph=True, allow_unused=True)
    rows, constant = edges_from_grads(run, grads)
    closure = Closure(float(value.detach()), float(rows.double().sum()), float(constant[0]))
    return rows[0], float(constant[0]), closure


def feature_targets(run: ReplacementRun, index: torch.Tensor) -> torch.Tensor:
    """Pre-activations ``W_enc[l, f] . x[l, pos]`` (no ``b_enc``) of feature nodes."""
    layers, positions = run.feature_layer[index], run.feature_position[index]
    states = torch.stack([run.encoder_inputs[layer][0, pos]
                          for layer, pos in zip(layers.tolist(), positions.tolist(), strict=True)])
    return (states.to(run.encoder_rows.dtype) * run.encoder_rows[index]).sum(-1)


def _seeds(run: ReplacementRun, index: torch.Tensor) -> tuple[list, list]:
    """Batched gradient seeds: for each layer the rows of ``index`` live in, a
    ``[B, 1, P, D]`` tensor holding each row's encoder vector at its position."""
    layers = run.feature_layer[index]
    outputs, seeds = [], []
    for layer in layers.unique().tolist():
        state = run.encoder_inputs[layer]
        seed = torch.zeros(len(index), *state.shape, dtype=state.dtype, device=state.device)
        rows = (layers == layer).nonzero().squeeze(-1)
        seed[rows, 0, run.feature_position[index[rows]]] = \
            run.encoder_rows[index[rows]].to(state.dtype)
        outputs.append(state)
        seeds.append(seed)
    return outputs, seeds


def feature_rows(run: ReplacementRun, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the feature nodes ``index`` from one batched backward pass."""
    if len(index) == 0:
        return torch.zeros(0, run.n_columns), torch.zeros(0)
    outputs, seeds = _seeds(run, index)
    grads = torch.autograd.grad(outputs, run.inputs(), seeds, retain_graph=True,
                                allow_unused=True, is_grads_batched=True)
    return edges_from_grads(run, grads, batch=len(index))


def feature_rows_loop(run: ReplacementRun,
                      index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one backward per feature node."""
    rows, constants = [], []
    for i in index.tolist():
        value = feature_targets(run, torch.tensor([i]))[0]
        grads = torch.autograd.grad(value, run.inputs(), retain_graph=True, allow_unused=True)
        row, constant = edges_from_grads(run, grads)
        rows.append(row[0])
        constants.append(constant[0])
    return torch.stack(rows), torch.stack(constants)


def batches(index: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """``index`` in consecutive pieces of ``size``."""
    for start in range(0, len(index), size):
        yield index[start:start + size]
