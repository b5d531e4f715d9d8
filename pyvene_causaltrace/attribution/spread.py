"""How one graph's work is spread over the ranks of a distributed run (``torchrun``):
:class:`Spread`, chosen once per graph by :func:`~.attribute.attribute`.

    spread = Spread.of(replacement, prompt, answer, settings)   # None in one process
    rows, constants = spread.rows(feature_rows, run, chunk)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..distributed import Ranks, current
from ..errors import InputError
from ..fingerprint import tensors_fingerprint, transcoder_fingerprint
from ..interventions.lorsa_splice import LORSA_SUM_ALONE
from ..interventions.splice_math import SHARD_ALONE
from ..transcoders.lorsa import LorsaSet
from ..transcoders.lorsa_config import HEAD_TENSORS, head_range
from ..transcoders.transcoder import Transcoder, feature_range
from .lorsa_nodes import lorsa_fingerprint
from .replacement import LORSA_SHARDED_ALIKE, ReplacementRun

if TYPE_CHECKING:  # annotations only
    from .replacement_model import ReplacementModel
    from .settings import AttributionSettings

__all__ = ["Spread", "shared_fingerprint"]


@dataclass(frozen=True)
class Spread:
    """How one graph's work is spread over the ranks of a distributed run: ``"features"`` (the
    transcoder sharded by feature, :mod:`.sharded`: every rank runs every row's backward and fills
    its own features' columns, ``4 * n_active`` bytes per row) or ``"rows"`` (the transcoder whole
    on every rank: each batch of rows split and gathered, ``4 * n_columns`` bytes per row). Every
    rank ends with the one process's rows, to float rounding; rank 0 chooses each queue and writes
    the checkpoint."""

    ranks: Ranks
    mode: str

    @classmethod
    def of(cls, replacement: ReplacementModel, prompt: str, answer: str | None,
           settings: AttributionSettings) -> Spread | None:
        """The run's spread (None: one process), after checking that every rank holds the
        same model, transcoder, prompt and settings."""
        ranks, transcoder, lorsa = current(), replacement.transcoder, replacement.lorsa
        if ranks is None:
            if transcoder.features is not None:
                raise InputError(SHARD_ALONE)
            if lorsa is not None and lorsa.sharded:
                raise InputError(LORSA_SUM_ALONE)
            return None
        sharded = transcoder.features is not None
        if lorsa is not None:
            _check_lorsa(lorsa, sharded, ranks)
        if sharded and transcoder.features != feature_range(transcoder.cfg.d_transcoder,
                                                           ranks.rank, ranks.world):
            raise InputError(
                f"rank {ranks.rank} of {ranks.world} holds features {transcoder.features}, not "
                f"its share {feature_range(transcoder.cfg.d_transcoder, ranks.rank, ranks.world)}"
                ": load it with shard=(rank, world) of this run")
        ranks.agree("mode (a sharded transcoder or a whole one)", sharded)
        ranks.agree("model weights", replacement.bound.fingerprint)
        ranks.agree("transcoder", (transcoder.cfg.yaml_dict(), shared_fingerprint(transcoder)))
        if lorsa is not None:
            ranks.agree("Lorsa", lorsa_shared_fingerprint(lorsa))
        ranks.agree("prompt and answer", (prompt, answer))
        ranks.agree("settings", repr(settings))
        return cls(ranks, "features" if sharded else "rows")

    def rows(self, compute, run: ReplacementRun, chunk: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``compute(run, chunk)``, spread as :attr:`mode` says."""
        if self.mode == "features":
            return compute(run, chunk)
        mine = chunk.tensor_split(self.ranks.world)[self.ranks.rank]
        rows, constants = compute(run, mine)
        dtype = torch.promote_types(run.activation.dtype, run.errors[0].dtype)
        both = torch.cat([rows.to(dtype), constants.to(dtype)[:, None]], 1)
        full = torch.cat(self.ranks.all_gather(both.detach(), "gathering the rows"))
        return full[:, :-1], full[:, -1]

    def describe(self, transcoder: Transcoder, lorsa: LorsaSet | None = None) -> dict:
        """What ``summary.json`` and the graph's metadata say about the run's ranks."""
        held = self.ranks.gather_objects(transcoder.resident_bytes(),
                                         "gathering the transcoder bytes per rank")
        out = {"world": self.ranks.world, "mode": self.mode, "transcoder_bytes_per_rank": held}
        if lorsa is not None:
            out["lorsa_bytes_per_rank"] = self.ranks.gather_objects(
                sum(lorsa[layer].resident_bytes() for layer in lorsa.layers),
                "gathering the Lorsa bytes per rank")
        return out


def _check_lorsa(lorsa: LorsaSet, sharded: bool, ranks: Ranks) -> None:
    """Refuse a Lorsa set split otherwise than the transcoder, or holding other OV heads than
    this rank's share."""
    if lorsa.sharded != sharded:
        raise InputError(LORSA_SHARDED_ALIKE)
    for layer, one in lorsa.layers.items():
        share = head_range(one.cfg.n_ov_heads, ranks.rank, ranks.world)
        if sharded and one.heads != share:
            raise InputError(f"rank {ranks.rank} of {ranks.world} holds layer {layer}'s OV heads "
                             f"{one.heads}, not its share {share}: load the Lorsa with "
                             "shard=(rank, world) of this run")


def lorsa_shared_fingerprint(lorsa: LorsaSet) -> str:
    """What every rank's Lorsa set must share: the whole set's fingerprint, or for shards
    what every rank holds alike (the QK side, ``b_D``) and the source."""
    if not lorsa.sharded:
        return lorsa_fingerprint(lorsa)
    return f"{lorsa.source}:" + tensors_fingerprint([
        (f"{layer}.{name}", tensor) for layer in sorted(lorsa.layers)
        for name, tensor in lorsa[layer].tensors().items() if name not in HEAD_TENSORS])


def shared_fingerprint(transcoder: Transcoder) -> str:
    """The fingerprint every rank's transcoder must share: the whole one's, or for a shard
    what every rank holds alike (biases of the outputs, the skip path) and the source."""
    if transcoder.features is None:
        return transcoder_fingerprint(transcoder)
    named = [("b_dec", transcoder.b_dec)]
    named += [(f"W_skip.{layer}", w) for layer, w in enumerate(transcoder.W_skip or [])]
    return f"{transcoder.source}:{tensors_fingerprint(named)}"
