"""A graph's feature nodes when the transcoder is sharded by feature across ranks.

Each rank holds features ``[lo, hi)`` of every layer; the ranks sum their partial
reconstructions once per layer, so every rank runs the one process's forward (to float
rounding) with only its own features as leaves. :func:`globalize` gives every rank the whole
feature list in node order and a :class:`FeatureShard` naming its own; each rank fills its own
features' columns of the replicated rows and :meth:`FeatureShard.gather_columns` joins them.
A Lorsa sharded by OV head beside it (:mod:`.lorsa_nodes`) is globalized the same way, its
heads after every rank's features (:meth:`FeatureShard.followed_by`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import Ranks


@dataclass(frozen=True)
class FeatureShard:
    """Which of the graph's feature nodes this rank holds: ``indices[r]`` are rank ``r``'s
    nodes' global indices, in its local node order."""

    ranks: Ranks
    indices: tuple[torch.Tensor, ...]
    n_global: int

    @property
    def n_local(self) -> int:
        return len(self.indices[self.ranks.rank])

    def gather_columns(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, n_local + rest]`` (this rank's feature columns, then the columns every rank
        computes alike) -> ``[B, n_global + rest]`` in global node order, the same on every
        rank."""
        local, rest = rows[:, :self.n_local], rows[:, self.n_local:]
        parts = self.ranks.all_gather(local.T.contiguous(), "gathering the feature columns")
        full = rows.new_zeros(rows.shape[0], self.n_global)
        for index, part in zip(self.indices, parts, strict=True):
            full[:, index.to(full.device)] = part.T.to(full.dtype)
        return torch.cat([full, rest], dim=1)

    def followed_by(self, other: FeatureShard) -> FeatureShard:
        """The nodes of this shard, then ``other``'s (a sharded Lorsa's heads after the
        transcoder's features): every rank's local columns in that order too."""
        return FeatureShard(self.ranks, tuple(
            torch.cat([mine, theirs + self.n_global])
            for mine, theirs in zip(self.indices, other.indices, strict=True)),
            self.n_global + other.n_global)


def globalize(ranks: Ranks, layers: torch.Tensor, positions: torch.Tensor,
              features: torch.Tensor, activations: torch.Tensor, encoder_rows: torch.Tensor,
              n_pos: int, d_transcoder: int) -> tuple[dict[str, torch.Tensor], FeatureShard]:
    """Every rank's active features (``features``: global ids) in global node order: their
    ``layer``, ``position``, ``id``, ``activation`` and ``encoder_rows``, and this rank's
    :class:`FeatureShard`."""
    what = "gathering the active features"
    coords = torch.stack([layers, positions, features]).T.to(torch.long).cpu()
    all_coords = ranks.all_gather(coords, what)
    all_values = ranks.all_gather(activations.detach().cpu()[:, None], what)
    all_rows = ranks.all_gather(encoder_rows.detach().cpu(), what)
    coords = torch.cat(all_coords)
    key = (coords[:, 0] * n_pos + coords[:, 1]) * d_transcoder + coords[:, 2]
    order = key.argsort(stable=True)
    position_of = torch.empty_like(order)
    position_of[order] = torch.arange(len(order))
    indices, start = [], 0
    for part in all_coords:
        indices.append(position_of[start:start + len(part)])
        start += len(part)
    device = encoder_rows.device
    out = {"layer": coords[order, 0].to(device), "position": coords[order, 1].to(device),
           "id": coords[order, 2].to(device),
           "activation": torch.cat(all_values)[order, 0].to(device),
           "encoder_rows": torch.cat(all_rows)[order].to(device)}
    return out, FeatureShard(ranks, tuple(indices), len(order))
