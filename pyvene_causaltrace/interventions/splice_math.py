"""What a splice computes from its session, apart from the pyvene intervention that runs it:
the reconstruction (:func:`reconstruct`), what ``feature_ablate`` changed
(:func:`ablation_change`, for ``live_error``), a ``joint_topk`` transcoder's fixed selection
(:func:`joint_selection`), and in leaf mode the writes of each layer's :class:`ActiveFeatures`
into later layers (:func:`leaf_writes`), summed over ranks for a shard (:func:`summed_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..distributed import current
from ..errors import InputError
from .splice_session import SpliceSession

#: Bytes of decoder rows gathered at a time (:meth:`ActiveFeatures.cells`): the active features'
#: rows are never held, only gathered by the forward's writes and each batch's backward.
GATHER_BYTES = 1 << 28


@dataclass
class ActiveFeatures:
    """The active features of one layer in a leaf-mode splice: batch row, position, feature id
    and value (an autograd leaf) of each; ``gather`` gives the decoder rows ``[n, L - layer,
    D]`` of feature ids, ``row_bytes`` one row's bytes. The rows are gathered when needed
    (:meth:`cells`), not kept: on long prompts they were the forward graph's largest part
    (docs/attribution.md, "Memory")."""

    row: torch.Tensor
    position: torch.Tensor
    feature: torch.Tensor
    value: torch.Tensor
    gather: Callable[[torch.Tensor], torch.Tensor]
    row_bytes: int

    def decoder(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The decoder rows ``[stop - start, L - layer, D]`` of features ``start:stop``."""
        return self.gather(self.feature[start:stop])

    def cells(self, n_pos: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """``(cell, offset, count, rows)`` per (batch row, position) cell with features:
        ``cell = row * n_pos + position``, its features ``offset:offset + count`` (they come
        sorted by row, then position: ``nonzero`` order) and their decoder rows ``[count,
        L - layer, D]``, gathered :data:`GATHER_BYTES` at a time."""
        cells = (self.row * n_pos + self.position).tolist()
        limit = max(1, GATHER_BYTES // max(1, self.row_bytes))
        start, block, offset = 0, None, 0
        while offset < len(cells):
            count = 1
            while offset + count < len(cells) and cells[offset + count] == cells[offset]:
                count += 1
            if block is None or offset + count > start + len(block):
                start, block = offset, self.decoder(offset, offset + max(limit, count))
            yield cells[offset], offset, count, block[offset - start:offset - start + count]
            offset += count


def summed_over_ranks(written: torch.Tensor | None, like: torch.Tensor,
                       layer: int) -> torch.Tensor:
    """What every rank's features write into ``layer`` (one sum over ranks): the value is the
    sum, the same on every rank; the gradient reaches this rank's feature leaves only (the
    other ranks' features are theirs to differentiate)."""
    ranks = current()
    if ranks is None:
        raise InputError(SHARD_ALONE)
    local = like.new_zeros(like.shape) if written is None else written
    total = ranks.all_reduce(local, f"summing layer {layer}'s reconstruction over ranks")
    return total + (local - local.detach())


#: Why a shard is refused outside a distributed run: its features are a part of every layer's.
SHARD_ALONE = ("this transcoder is one rank's shard of its features (Transcoder.shard, "
               "load_transcoder(..., shard=)): alone it reconstructs every layer from a part of "
               "its features, which gives wrong numbers; run it under torchrun with every rank "
               "holding its shard (attribute), or load the whole transcoder")


def joint_selection(transcoder, session: SpliceSession, layer: int,
                    x: torch.Tensor) -> torch.Tensor | None:
    """Layer ``layer``'s part of the splice's fixed joint selection (None for a transcoder that
    selects per layer); refused when there is none or it does not cover ``x``'s positions."""
    if not transcoder.cfg.joint:
        return None
    if session.selection is None:
        raise InputError(
            f"a {transcoder.cfg.activation} transcoder keeps the {transcoder.cfg.k} best features "
            f"over all {transcoder.n_layers} layers at once, which a forward knows only after its "
            "last layer: "
            "splice it with selection= (clean_selection(model, transcoder, input_ids): the clean "
            "run's joint top-k, held fixed)")
    chosen = session.selection[layer]
    if chosen.shape[-2] != x.shape[-2]:
        raise InputError(f"the splice's joint selection covers {chosen.shape[-2]} positions and "
                         f"the sequence has {x.shape[-2]}: compute it on this sequence")
    return chosen


def reconstruct(transcoder, layer: int, session: SpliceSession,
                base: torch.Tensor) -> torch.Tensor:
    """``b_dec[layer] + skip(x) + sum_{l writing layer} a_l @ W_dec[l][:, layer - l]`` from the
    session's features (after any feature_ablate), in ``base``'s dtype."""
    recon = transcoder.b_dec[layer].to(base.dtype).expand_as(base)
    recon = recon + transcoder.skip(session.inputs[layer], layer).to(base.dtype)
    for source_layer in transcoder.cfg.sources(layer):
        acts = session.acts.get(source_layer)
        term = None if acts is None else _decoded(transcoder, source_layer, layer, acts)
        if term is not None:
            recon = recon + term.to(base.dtype)
    return recon


def _decoded(transcoder, source_layer: int, layer: int, acts: torch.Tensor) -> torch.Tensor | None:
    """``acts @ W_dec[source_layer][:, layer - source_layer]`` over the features nonzero
    somewhere in ``acts`` (None when none is)."""
    active = (acts != 0).reshape(-1, acts.shape[-1]).any(0).nonzero().squeeze(-1)
    if active.numel() == 0:
        return None
    rows = transcoder.decoder_rows(source_layer, active)[:, layer - source_layer]  # [n, D]
    return acts[..., active] @ rows


def ablation_change(transcoder, layer: int, session: SpliceSession) -> torch.Tensor | None:
    """What feature_ablate changed in ``layer``'s output: ``sum_l (a'_l - a_l) @ W_dec[l][:,
    layer - l]`` over the features it changed (None when it changed none)."""
    change = None
    for source_layer in transcoder.cfg.sources(layer):
        now, encoded = session.acts.get(source_layer), session.encoded.get(source_layer)
        if now is None or encoded is None or now is encoded:
            continue
        term = _decoded(transcoder, source_layer, layer, now - encoded)
        if term is not None:
            change = term if change is None else change + term
    return change


def leaf_writes(active: ActiveFeatures, shape: tuple[int, int], n_targets: int,
                d_model: int) -> tuple[torch.Tensor, ...] | None:
    """What one layer's leaf features write into each later layer: ``n_targets`` tensors
    ``[B, P, D]``. One matrix product per (row, position) (features there times their decoder
    rows), so that the backward pass reads each decoder row once; the rows are gathered again
    for it (:class:`_Writes`), not saved."""
    if active.value.numel() == 0:
        return None
    written = _Writes.apply(active.value, active, shape, n_targets, d_model)
    return written.unbind(2)


class _Writes(torch.autograd.Function):
    """``[B, P, n_targets, D]``: each cell's feature values times their decoder rows; the
    backward gathers the rows again instead of keeping them from the forward."""

    @staticmethod
    def forward(ctx, value, active, shape, n_targets, d_model):
        ctx.active, ctx.n_pos = active, shape[1]
        out = value.new_zeros(shape[0] * shape[1], n_targets * d_model)
        for cell, offset, count, rows in active.cells(shape[1]):
            torch.mm(value[None, offset:offset + count], rows.reshape(count, -1),
                     out=out[cell:cell + 1])
        return out.reshape(*shape, n_targets, d_model)

    @staticmethod
    def backward(ctx, grad):
        active = ctx.active
        flat = grad.reshape(-1, grad.shape[-2] * grad.shape[-1])
        # out of place: under is_grads_batched the gradient is vmapped, the features are not
        out = torch.cat([rows.reshape(count, -1) @ flat[cell]
                         for cell, _, count, rows in active.cells(ctx.n_pos)])
        return out, None, None, None, None
