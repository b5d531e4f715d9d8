"""What a splice computes from its session, apart from the pyvene intervention that runs it:
the reconstruction (:func:`reconstruct`), what ``feature_ablate`` changed
(:func:`ablation_change`, for ``live_error``), a ``joint_topk`` transcoder's fixed selection
(:func:`joint_selection`), and in leaf mode the writes of each layer's :class:`ActiveFeatures`
into later layers (:func:`leaf_writes`), summed over ranks for a shard (:func:`summed_over_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import current
from ..errors import InputError
from .splice_session import SpliceSession


@dataclass
class ActiveFeatures:
    """The active features of one layer in a leaf-mode splice: batch row, position, feature id
    and value (an autograd leaf) of each, and their decoder rows ``[n, L - layer, D]``."""

    row: torch.Tensor
    position: torch.Tensor
    feature: torch.Tensor
    value: torch.Tensor
    decoder: torch.Tensor


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
    rows), so that the backward pass — run once per adjacency row — is a few matrix products
    that read each decoder row once per batch of rows, not an elementwise product per (source,
    target) layer pair. Features come sorted by row, then position (``nonzero`` order)."""
    if active.value.numel() == 0:
        return None
    batch, n_pos = shape
    cells = active.row * n_pos + active.position
    counts = torch.bincount(cells, minlength=batch * n_pos).tolist()
    zeros = active.decoder.new_zeros(n_targets * d_model)
    per_position, offset = [], 0
    for count in counts:
        if count == 0:
            per_position.append(zeros)
            continue
        values = active.value[offset:offset + count]
        rows = active.decoder[offset:offset + count].reshape(count, -1)
        per_position.append(values @ rows)
        offset += count
    return torch.stack(per_position).reshape(batch, n_pos, n_targets, d_model).unbind(2)
