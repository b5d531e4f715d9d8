"""Batched gradients on the local replacement model's leaves, the feature leaves' computed from
the error leaves' instead of by autograd through the splice.

A feature of layer ``l`` at position ``p`` writes ``value * W_dec[l][f, t - l]`` into layer
``t``'s MLP output, ``reconstruction + error``, whose error leaf has gradient ``g_t``; so the
feature's gradient is ``sum_t g_t[p] . W_dec[l][f, t - l]``, one matrix product per (layer,
position) of decoder rows and the stacked error gradients. Autograd through the splice gives the
same numbers (``feature_rows_loop`` takes that path) but under ``is_grads_batched`` it was most
of a batched backward on SmolLM2 (benchmarks/RESULTS.md, "Attribution rows, issue 27").

    grads = leaf_grads(run, outputs, seeds)
    # == torch.autograd.grad(outputs, run.inputs(), seeds, allow_unused=True,
    #                        is_grads_batched=True), to float rounding"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..interventions.clt_splice import ActiveFeatures
from .replacement import ReplacementRun


def leaf_grads(run: ReplacementRun, outputs: torch.Tensor | Sequence[torch.Tensor],
               seeds: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Gradients of ``outputs`` with the batched ``seeds`` (leading dim: one per row) on every
    tensor of ``run.inputs()``, in that order (``None`` where no gradient reaches); the graph is
    kept for the next batch."""
    n_features, n_layers, n_heads = len(run.features), run.n_layers, len(run.lorsa_heads)
    batch = len(seeds) if isinstance(seeds, torch.Tensor) else len(seeds[0])
    others = run.inputs()[n_features:]  # Lorsa heads (by autograd), errors, ...
    grads = torch.autograd.grad(outputs, others, seeds, retain_graph=True, allow_unused=True,
                                is_grads_batched=True)
    features, errors = feature_grads(run, list(grads[n_heads:n_heads + n_layers]), batch)
    return [*features, *grads[:n_heads], *errors, *grads[n_heads + n_layers:]]


def feature_grads(run: ReplacementRun, error_grads: list[torch.Tensor | None],
                  batch: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per layer the gradient ``[batch, n_l]`` on its feature leaves (``None`` where no error
    gradient reaches one of its targets) from the error leaves' gradients ``[batch, B, P, D]``
    (``None`` where none reaches); returns them and the error gradients, now views of one
    stacked tensor (module docstring)."""
    present = [t for t, g in enumerate(error_grads) if g is not None]
    if not present:
        return [None] * len(run.features), error_grads
    last = present[-1] + 1  # the layers from here on get no gradient: no target needs them
    ref = error_grads[present[-1]]
    with torch.no_grad():
        zero = ref.new_zeros(()).expand_as(ref)
        stacked = torch.stack([zero if g is None else g for g in error_grads[:last]], dim=-2)
        errors = [None if g is None else stacked[..., t, :]
                  for t, g in enumerate(error_grads[:last])] + error_grads[last:]
        n_rows, n_pos, d_model = ref.shape[1], ref.shape[2], ref.shape[3]
        # [batch, cells, last * D]: a cell's target gradients, layer-major
        flat = stacked.reshape(batch, n_rows * n_pos, last * d_model)
        features = [_layer_grads(active, layer, flat, n_pos, d_model)
                    for layer, active in enumerate(run.features)]
    return features, errors


def _layer_grads(active: ActiveFeatures, layer: int, flat: torch.Tensor, n_pos: int,
                 d_model: int) -> torch.Tensor | None:
    """``[batch, n]``: one layer's feature gradients (:func:`feature_grads`), one matrix
    product per (batch row, position) cell of its features' decoder rows, gathered now
    (:meth:`~..interventions.clt_splice.ActiveFeatures.cells`)."""
    n = active.value.numel()
    width = min(active.row_bytes // (d_model * active.value.element_size()),
                flat.shape[-1] // d_model - layer)
    if n == 0 or width <= 0:
        return None
    targets = flat[:, :, layer * d_model:(layer + width) * d_model]  # targets with a gradient
    out = None
    for cell, offset, count, rows in active.cells(n_pos):
        decoder = rows.reshape(count, -1)[:, :width * d_model]
        if out is None:
            out = decoder.new_empty(n, flat.shape[0])
        torch.mm(decoder, targets[:, cell].T.to(decoder.dtype), out=out[offset:offset + count])
    return out.T
