"""Edges: ``x_i * d(row target) / d(x_i)`` for every node ``i``, and the closure check.

A row belongs to a target (a :class:`~.targets.Target`, or one active feature's pre-activation
``W_enc[l, f] . x[l, pos]``), one column per node. What the additive constants (``b_dec``,
biases) contribute is kept beside it, so ``row.sum() + constant == target`` is a check
(:class:`Closure`, :class:`ClosureError`). The residual is measured against the scale of what is
summed (:attr:`Closure.scale`, plus for a feature row its pre-activation's terms ``sum_i |w_i
x_i|``), not the target, which can be near zero while its terms are not. float32 rounding leaves
~1e-7..1e-5 of it; :data:`CLOSURE_TOLERANCE` (1e-4) is ten times the worst seen, so more means
the forward changed in a way the graph has no node for. A bfloat16 graph (:mod:`.precision`)
rounds its forward and backward to 8 bits of mantissa; its closures are checked against
:data:`BF16_CLOSURE_TOLERANCE` instead (:func:`closure_tolerance`).

:func:`feature_rows` batches gradient seeds on one forward graph (the feature leaves' gradients
from the error leaves', :mod:`.leaf_grads`); :func:`feature_rows_loop` is the one backward per
node reference it is tested against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..errors import ClosureError, InputError
from .leaf_grads import leaf_grads
from .lorsa_nodes import lorsa_seeds, lorsa_targets_and_magnitudes
from .replacement import ReplacementRun
from .targets import Target


def edges_from_grads(run: ReplacementRun, grads: Sequence[torch.Tensor | None],
                     batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [B, n_nodes], constant [B])`` from gradients on ``run.inputs()`` (leading batch
    dim ``B`` when ``batch`` is given; ``None`` gradients are zeros), float32 at least."""
    inputs = run.inputs()
    lead = () if batch is None else (batch,)
    grads = [torch.zeros(*lead, *x.shape, dtype=x.dtype, device=x.device) if g is None else g
             for x, g in zip(inputs, grads, strict=True)]
    if batch is None:
        grads = [g[None] for g in grads]
    # run.inputs() order: features, Lorsa heads, errors, Lorsa errors, steering, ...
    steering = run.steering_leaves
    ends = list(accumulate((len(run.feature_values), len(run.lorsa_heads), run.n_layers,
                            len(run.lorsa_errors), len(steering), len(run.embeddings))))
    feature_grads, head_grads, error_grads, lorsa_grads, steer_grads, emb_grads, bias_grads = (
        grads[start:end] for start, end in zip([0, *ends], [*ends, None], strict=True))
    values = [*run.feature_values, *[h.value for h in run.lorsa_heads]]
    parts = [_wide(v) * _wide(g) for v, g in zip(values, [*feature_grads, *head_grads],
                                                 strict=True)]
    dropped = []  # bos_errors="drop": the BOS errors' edges join the constant instead
    for e, g in zip([*run.errors, *run.lorsa_errors], [*error_grads, *lorsa_grads],
                    strict=True):
        edges = (_wide(e) * _wide(g)).sum(-1).reshape(g.shape[0], -1)
        if run.bos_errors == "drop":
            dropped.append(edges[:, 0].clone())
            edges[:, 0] = 0
        parts.append(edges)
    for s, positions, g in zip(steering, run.steering_positions, steer_grads, strict=True):
        leaf = s.leaf.detach()
        per_position = (_wide(leaf) * _wide(g)).reshape(g.shape[0], leaf.shape[0],
                                                        leaf.shape[1], -1)
        parts.append(per_position.sum((1, 3))[:, positions.to(g.device)])
    tokens = sum((_wide(e) * _wide(g)).sum(-1).reshape(g.shape[0], -1)
                 for e, g in zip(run.embeddings, emb_grads, strict=True))
    parts.append(tokens)
    rows = torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)
    constant = sum((_wide(c) * _wide(g)).reshape(g.shape[0], -1).sum(1)
                   for c, g in zip([run.b_dec, *run.lorsa_biases, *run.constants], bias_grads,
                                   strict=True))
    constant = constant + sum(dropped)
    if run.shard is not None:  # this rank's feature columns, then everyone's: the whole row
        rows = run.shard.gather_columns(rows)
    return rows, torch.as_tensor(constant, dtype=rows.dtype).reshape(-1)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, in float32 at least: a bfloat16 gradient's or leaf's edges are formed
    and summed in float32 (:mod:`.precision`); a float32 or float64 tensor as it is."""
    x = x.detach()
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


#: Largest closure residual a graph may have, relative to :attr:`Closure.scale` (module
#: docstring): float32 rounding stays below a tenth of it.
CLOSURE_TOLERANCE = 1e-4
#: The same for a bfloat16 graph (:mod:`.precision`): ten times the worst row seen on the tiny
#: test models and on SmolLM2 (docs/attribution.md, "Precision and determinism").
BF16_CLOSURE_TOLERANCE = 4e-2


def closure_tolerance(dtype: torch.dtype | None) -> float:
    """The closure tolerance of a graph computed in ``dtype`` (None: float32's)."""
    return BF16_CLOSURE_TOLERANCE if dtype in (torch.bfloat16, torch.float16) \
        else CLOSURE_TOLERANCE


@dataclass(frozen=True)
class Closure:
    """How well a row's edges (plus constants) add up to its target: ``relative`` is the
    residual over ``scale`` (``sum |edges| + |constant| + |target|``, not ``|target|``, which can
    be near zero), ``ok`` whether it is within ``tolerance`` (:func:`closure_tolerance` of the
    graph's dtype)."""

    target: float
    edges: float
    constant: float
    scale: float = 0.0
    tolerance: float = CLOSURE_TOLERANCE

    @property
    def residual(self) -> float:
        return self.edges + self.constant - self.target

    @property
    def relative(self) -> float:
        scale = self.scale or abs(self.edges) + abs(self.constant) + abs(self.target)
        return abs(self.residual) / max(scale, 1e-30)

    @property
    def ok(self) -> bool:
        return self.relative <= self.tolerance

    def to_dict(self) -> dict:
        return {"target": self.target, "edges": self.edges, "constant": self.constant,
                "residual": self.residual, "scale": self.scale, "relative": self.relative,
                "tolerance": self.tolerance}


def row_closures(rows: torch.Tensor, constants: torch.Tensor, targets: torch.Tensor,
                 magnitudes: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, ``|row.sum() + constant - target|`` over ``sum |row| + |constant| + |target|
    + magnitude`` (float64; ``magnitudes``: :func:`feature_targets_and_magnitudes`, 0 when
    None): the :attr:`Closure.relative` of each row."""
    rows = rows.detach()  # float64 sums without a float64 copy of the rows
    constants = torch.as_tensor(constants).detach().double().to(rows.device).reshape(-1)
    targets = torch.as_tensor(targets).detach().double().to(rows.device).reshape(-1)
    residual = (rows.sum(1, dtype=torch.float64) + constants - targets).abs()
    scale = (torch.linalg.vector_norm(rows, ord=1, dim=1, dtype=torch.float64)
             + constants.abs() + targets.abs())
    if magnitudes is not None:
        scale = scale + torch.as_tensor(magnitudes).detach().double().to(rows.device).reshape(-1)
    return (residual / scale.clamp(min=1e-30)).cpu()


def closure_error(what: str, closure: Closure, *, freeze: bool,
                  hidden: list[str] = ()) -> ClosureError:
    """The :class:`ClosureError` for ``what`` (e.g. "the target row"), saying what the graph
    is missing and what to do."""
    causes = []
    if not freeze:
        causes.append("freeze=False: attention patterns and norm scales are live, so edges are "
                      "total derivatives that do not sum to the target (a control, not a graph; "
                      "pass check_closure=False to get it anyway)")
    causes += [f"{name}: edits an output the local replacement model recomputes, so its "
               "constant cannot be a node; put it on the residual stream (block_input / "
               "block_output) instead" for name in hidden]
    causes += [
        "a hook or edit on the model that the graph cannot see as a node (a forward hook you "
        "registered yourself, a monkey-patched module): remove it, or make it a pyvene "
        "intervention in a pv.IntervenableModel passed to attribute — the constant part of "
        "an affine edit (addition, subtraction, constant source, noise_add, restores) becomes "
        "a steering node",
        "a non-linear intervention in the IntervenableModel (only affine edits f(x) = A x + c "
        "decompose exactly)",
        "dropout or other randomness: put the model in eval mode (model.eval())"]
    return ClosureError(
        f"{what} does not close: residual {closure.residual:+.3g} is {closure.relative:.2e} of "
        f"what is summed, above the tolerance {closure.tolerance:g} (rounding stays below a "
        "tenth of it), so the graph would credit the difference to no node: the forward holds "
        "something the graph cannot see (most likely a hook or edit on the model: make it a "
        "pyvene intervention so its constant becomes a steering node; a non-linear "
        "intervention; dropout in train mode); attribute(..., check_closure=False) returns it "
        f"anyway.\nedges {closure.edges:+.6g} + constants {closure.constant:+.6g} = "
        f"{closure.edges + closure.constant:+.6g}, target {closure.target:+.6g}; scale "
        f"{closure.scale:.4g} = sum of |edges|, |constants| and |target|. Likely causes:\n  - "
        + "\n  - ".join(causes))


def target_rows(run: ReplacementRun,
                targets: Sequence[Target]) -> tuple[torch.Tensor, torch.Tensor, list[Closure]]:
    """The rows of ``targets`` (``[K, n_columns]``: one batched backward per output they read),
    their constants ``[K]`` and :class:`Closure` s."""
    if run.input_ids.shape[0] != 1:
        raise InputError("edges are computed for one prompt: run input_ids of shape [1, P]")
    rows = [None] * len(targets)
    constants = [None] * len(targets)
    values = [float(t.value(run.output(t.output)).detach()) for t in targets]
    for name in dict.fromkeys(t.output for t in targets):
        members = [i for i, t in enumerate(targets) if t.output == name]
        output = run.output(name)
        seeds = torch.stack([targets[i].seed(output) for i in members])
        grads = leaf_grads(run, output, seeds)
        group_rows, group_constants = edges_from_grads(run, grads, batch=len(members))
        for j, i in enumerate(members):
            rows[i], constants[i] = group_rows[j], group_constants[j]
    rows, constants = torch.stack(rows), torch.stack(constants)
    closures = []
    tolerance = closure_tolerance(run.compute_dtype)
    for row, constant, value in zip(rows, constants, values, strict=True):
        edges, const = float(row.double().sum()), float(constant)
        scale = float(row.double().abs().sum()) + abs(const) + abs(value)
        closures.append(Closure(value, edges, const, scale, tolerance))
    return rows, constants, closures


def target_row(run: ReplacementRun, target: Target) -> tuple[torch.Tensor, float, Closure]:
    """One target's row, its constant and its :class:`Closure` (:func:`target_rows`)."""
    rows, constants, closures = target_rows(run, [target])
    return rows[0], float(constants[0]), closures[0]


def feature_targets(run: ReplacementRun, index: torch.Tensor) -> torch.Tensor:
    """Pre-activations ``W_enc[l, f] . x[l, pos]`` (no ``b_enc``) of feature nodes."""
    return feature_targets_and_magnitudes(run, index)[0]


def feature_targets_and_magnitudes(run: ReplacementRun, index: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-activations of feature nodes (:func:`feature_targets`) and, from the same
    products, ``sum_i |W_enc[l, f, i] x[l, pos, i]|`` (float64): the size of the terms each
    sums, which its float32 rounding is relative to (module docstring)."""
    lorsa = index >= run.n_transcoder_features
    if bool(lorsa.any()):  # Lorsa heads (:mod:`.lorsa_nodes`) beside transcoder features
        plain = feature_targets_and_magnitudes(run, index[~lorsa])
        heads = lorsa_targets_and_magnitudes(run, index[lorsa])
        targets = plain[0].new_empty(len(index))
        magnitudes = plain[1].new_empty(len(index))
        targets[~lorsa], magnitudes[~lorsa] = plain
        targets[lorsa], magnitudes[lorsa] = heads[0].to(targets.dtype), heads[1]
        return targets, magnitudes
    layers, positions = run.feature_layer[index], run.feature_position[index]
    states = [run.encoder_inputs[layer][0, pos]
              for layer, pos in zip(layers.tolist(), positions.tolist(), strict=True)]
    states = torch.stack(states) if states else run.encoder_rows[:0]
    terms = states.to(run.encoder_rows.dtype) * run.encoder_rows[index]
    return terms.sum(-1), terms.abs().sum(-1, dtype=torch.float64)


def _seeds(run: ReplacementRun, index: torch.Tensor) -> tuple[list, list]:
    """Batched gradient seeds: for each layer the rows of ``index`` live in, a
    ``[B, 1, P, D]`` tensor holding each row's encoder vector at its position; for Lorsa
    heads, one per Lorsa input (:func:`~.lorsa_nodes.lorsa_seeds`)."""
    lorsa = index >= run.n_transcoder_features
    outputs, seeds = lorsa_seeds(run, index[lorsa], lorsa.nonzero().squeeze(-1), len(index))
    layers = run.feature_layer[index].masked_fill(lorsa, -1)
    for layer in layers.unique().tolist():
        if layer < 0:
            continue
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
    grads = leaf_grads(run, outputs, seeds)
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

