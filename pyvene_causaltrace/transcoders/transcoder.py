"""The transcoder: per-layer encoders, decoders into the same or every later layer, optional skip.

Shapes (``L`` layers, ``F`` features per layer, ``D`` = d_model, ``T_l`` = the number of layers
layer ``l`` writes: ``L - l`` for a cross-layer transcoder, 1 for a per-layer set):

- ``W_enc[l]`` ``[F, D]``, ``b_enc[l]`` ``[F]``, ``threshold[l]`` ``[F]``, ``b_dec[l]`` ``[D]``;
- ``W_dec[l]`` ``[F, T_l, D]``: feature ``f`` born at layer ``l`` writes ``W_dec[l][f, t - l]``
  into target layer ``t``;
- ``W_skip[l]`` ``[D, D]`` (optional, either kind): ``skip_l(x) = x @ W_skip[l].T``;
- ``score_weight`` ``[L, F]`` (``joint_topk``; optional for ``relu_topk``): what each feature's
  ``relu(z)`` is multiplied by to rank it, the activation staying ``relu(z)`` (ByteDance's and
  llamascopium's decoder norms; ones when absent).

Encode: ``z = x @ W_enc[l].T + b_enc[l]`` with ``x`` the input hook's value at layer ``l``, then
the activation (:mod:`.config`); ``joint_topk``'s features need every layer's input, so only
:meth:`~Transcoder.encode_all` computes them, or :meth:`~Transcoder.encode` given a selection
fixed beforehand (:meth:`~Transcoder.joint_selection`, e.g. the clean run's). Reconstruct:
``out_t ~= b_dec[t] + sum_{l writing t} sum_f a[l, f] * W_dec[l][f, t - l] + skip_t(x_t)``.
Features at position 0 (BOS) are zeroed: no dictionary is trained on the attention sink there.

The decoder is usually far larger than everything else (18 GB for the 1B model's CLT): it can
stay memory-mapped on disk, and only the rows of features that fired are read.

Sharding by feature (docs/transcoders.md, "Sharded by feature"): :meth:`Transcoder.shard` or
``load_transcoder(..., shard=(rank, world))`` keeps features :func:`feature_range` of every
layer; ``b_dec``, ``W_skip`` and ``cfg`` stay the whole transcoder's. A shard's ``encode`` gives
local ids (global = local + ``feature_offset``), ``reconstruct(..., partial=True)`` its part of
the decoder sum. A top-k shard's ``encode`` (and ``joint_selection``) is a collective over the
ranks, ties going to the lower global id (only there may it differ from the whole transcoder's
``torch.topk``); outside a distributed run it refuses to encode.

    tc = Transcoder.from_pretrained("path/or/hub-id")
    acts = tc.encode_all(inputs)              # [L, P, F], position 0 zeroed
    recon = tc.reconstruct(acts, inputs)      # [L, P, D]
    part = Transcoder.from_pretrained("path", shard=(rank, world))  # features feature_range(...)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .. import distributed
from ..arguments import checked
from ..bound import BoundModel, bind
from ..errors import InputError, TranscoderMismatchError
from ..finite import check_weight
from ..models import get_module, model_name
from .config import TranscoderConfig

#: Activations that rank features against each other: on a shard, a collective picks the
#: global top-k (module docstring).
RANKED_ACTIVATIONS = ("topk", "relu_topk", "joint_topk")

#: Why a top-k shard refuses to encode outside a distributed run.
RANKED_SHARD_ALONE = ("this transcoder is one rank's shard of its features (Transcoder.shard, "
                      "load_transcoder(..., shard=)) and its {activation} ranks them against the "
                      "other ranks' features: alone it cannot tell which {k} are kept; encode it "
                      "under torchrun with every rank holding its shard (attribute), or load "
                      "the whole transcoder")

#: The layout reader and writer behind the class's loading and saving methods: :mod:`.formats`
#: builds Transcoders, so it registers them (:func:`register_layouts`) on import.
_LAYOUTS: dict[str, Callable] = {}


def register_layouts(load: Callable[..., Transcoder],
                     save: Callable[[Transcoder, str | Path], None]) -> None:
    """Set what the class's loading and saving methods call."""
    _LAYOUTS.update(load=load, save=save)


@checked
def feature_range(d_transcoder: int, rank: int, world: int) -> tuple[int, int]:
    """Features ``[lo, hi)`` of each layer that rank ``rank`` of ``world`` holds: contiguous,
    the first ``d_transcoder % world`` ranks one more than the others.

    >>> [feature_range(47, rank, 3) for rank in range(3)]
    [(0, 16), (16, 32), (32, 47)]"""
    for name, value in (("d_transcoder", d_transcoder), ("rank", rank), ("world", world)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InputError(f"{name} must be an integer, got {value!r}")
    if world < 1:
        raise InputError(f"world must be >= 1, got world={world}")
    if not 0 <= rank < world:
        raise InputError(f"rank must be in 0..{world - 1} for world={world}, got rank={rank}")
    if world > d_transcoder:
        raise InputError(f"world={world} ranks cannot share d_transcoder={d_transcoder} "
                         "features per layer: some would hold none")
    base, extra = divmod(d_transcoder, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def shard_features(d_transcoder: int, shard) -> tuple[int, int] | None:
    """``feature_range`` of a loader's ``shard=(rank, world)`` (None: the whole)."""
    if shard is None:
        return None
    if not isinstance(shard, tuple | list) or len(shard) != 2:
        raise InputError(f"shard must be (rank, world), got {shard!r}")
    return feature_range(d_transcoder, *shard)


class Transcoder(nn.Module):
    """A transcoder held as buffers (encoder side) and per-layer decoder tensors (resident or
    mmapped). Build one with :func:`~pyvene_causaltrace.transcoders.load_transcoder` (any
    layout; :meth:`from_pretrained` is the same) or :meth:`from_tensors`.

    ``features=(lo, hi)`` makes it a shard (module docstring): the tensors given hold only
    features ``[lo, hi)`` of each layer, ``cfg`` describes the whole. ``handles``: a
    memory-mapped decoder's file maps, one per layer, in layer order (they keep it valid, and
    name a bad row's file)."""

    def __init__(
        self,
        cfg: TranscoderConfig,
        *,
        b_enc: torch.Tensor,
        threshold: torch.Tensor | None,
        b_dec: torch.Tensor,
        W_enc: torch.Tensor | None,
        W_dec: list[torch.Tensor],
        W_skip: list[torch.Tensor] | None = None,
        encoder_loader: Callable[[int], torch.Tensor] | None = None,
        score_weight: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        source: str | None = None,
        features: tuple[int, int] | None = None,
        handles: list | None = None,
    ) -> None:
        super().__init__()
        if features is not None:
            lo, hi = features
            if not 0 <= lo < hi <= cfg.d_transcoder:
                raise InputError(f"features {features} is not a range [lo, hi) within the "
                                 f"transcoder's {cfg.d_transcoder} features per layer")
            features = (int(lo), int(hi))
            widths = {"b_enc": b_enc.shape[-1]} \
                | ({} if W_enc is None else {"W_enc": W_enc.shape[1]}) \
                | {f"W_dec[{layer}]": w.shape[0] for layer, w in enumerate(W_dec)}
            wrong = {name: width for name, width in widths.items() if width != hi - lo}
            if wrong:
                raise InputError(f"a shard of features {features} holds {hi - lo} features "
                                 f"per layer; got {wrong}")
        self.features = features
        self.cfg = cfg
        self.dtype = dtype
        self.device_ = torch.device(device)
        self.source = source
        if threshold is None:
            threshold = torch.zeros_like(b_enc)
        self.register_buffer("b_enc", b_enc.to(self.device_, dtype))
        self.register_buffer("threshold", threshold.to(self.device_, dtype))
        self.register_buffer("b_dec", b_dec.to(self.device_, dtype))
        if cfg.joint and score_weight is None or score_weight is not None and not (
                cfg.joint or cfg.activation == "relu_topk"):
            raise InputError("score_weight goes with a joint_topk transcoder (ones if unknown) "
                             "or ranks a relu_topk one's features")
        self.register_buffer("score_weight", None if score_weight is None
                             else score_weight.to(self.device_, dtype))
        self.W_enc = None if W_enc is None else W_enc.to(self.device_, dtype)
        self._encoder_loader = encoder_loader
        if W_enc is None and encoder_loader is None:
            raise InputError("a streamed encoder needs an encoder_loader")
        if cfg.skip != (W_skip is not None):
            raise InputError("cfg.skip must say whether W_skip is given")
        self.W_skip = None if W_skip is None else [w.to(self.device_, dtype) for w in W_skip]
        # Decoders are not buffers: a mmapped one must not be copied by .to() or state_dict().
        self.W_dec = W_dec
        self._handles: list = list(handles or [])

    # ----------------------------------------------------------------------- building
    @classmethod
    def from_tensors(cls, model_name: str, W_enc, b_enc, threshold, b_dec, W_dec,
                     W_skip=None, *, model_kind: str | None = None, activation: str = "jumprelu",
                     k: int | None = None, feature_input_hook: str = "hook_resid_mid",
                     feature_output_hook: str = "hook_mlp_out", scan: str | None = None,
                     **kwargs) -> Transcoder:
        """From stacked ``W_enc [L, F, D]``, ``b_enc``/``threshold [L, F]`` (threshold may be
        None), ``b_dec [L, D]``, a list of ``W_dec[l] [F, T_l, D]`` and optionally a list of
        ``W_skip[l] [D, D]``. The kind follows from the decoders' shapes unless given."""
        n_layers, d_transcoder, d_model = W_enc.shape
        if model_kind is None:
            per_layer = n_layers > 1 and all(w.shape[1] == 1 for w in W_dec)
            single = W_skip is not None and all(w.shape[1] == 1 for w in W_dec)
            model_kind = "transcoder_set" if per_layer or single else "cross_layer_transcoder"
        cfg = TranscoderConfig(model_name, n_layers, d_model, d_transcoder,
                               feature_input_hook, feature_output_hook, model_kind,
                               str(W_enc.dtype).removeprefix("torch."), activation, k,
                               W_skip is not None, scan)
        return cls(cfg, b_enc=b_enc, threshold=threshold, b_dec=b_dec, W_enc=W_enc,
                   W_dec=list(W_dec), W_skip=None if W_skip is None else list(W_skip), **kwargs)

    @classmethod
    def from_pretrained(cls, repo_id_or_dir: str, **kwargs) -> Transcoder:
        """Load any supported layout from a local path or hub id (see
        :func:`~pyvene_causaltrace.transcoders.load_transcoder`)."""
        return _LAYOUTS["load"](repo_id_or_dir, **kwargs)

    @classmethod
    def load_from_disk(cls, path: str, **kwargs) -> Transcoder:
        """Load a local directory or file (see
        :func:`~pyvene_causaltrace.transcoders.load_transcoder`)."""
        return _LAYOUTS["load"](path, **kwargs)

    def shard(self, rank: int, world: int) -> Transcoder:
        """Features :func:`feature_range` ``(d_transcoder, rank, world)`` of every layer (module
        docstring). Resident feature tensors are copied, a memory-mapped decoder stays a view, a
        streamed encoder reads only the slice; ``b_dec`` and ``W_skip`` are shared."""
        if self.features is not None:
            raise InputError(f"this transcoder is already a shard (features {self.features}); "
                             "shard the whole transcoder")
        lo, hi = feature_range(self.cfg.d_transcoder, rank, world)
        mapped = bool(self._handles)
        return Transcoder(
            self.cfg, b_enc=self.b_enc[:, lo:hi].clone(),
            threshold=self.threshold[:, lo:hi].clone(), b_dec=self.b_dec,
            W_enc=None if self.W_enc is None else self.W_enc[:, lo:hi].clone(),
            W_dec=[w[lo:hi] if mapped else w[lo:hi].clone() for w in self.W_dec],
            W_skip=self.W_skip,
            encoder_loader=None if self._encoder_loader is None
            else sliced_loader(self._encoder_loader, lo, hi),
            score_weight=None if self.score_weight is None
            else self.score_weight[:, lo:hi].clone(),
            dtype=self.dtype, device=self.device_, source=self.source, features=(lo, hi),
            handles=self._handles)

    def resident_bytes(self) -> int:
        """Bytes of the tensors this object holds in memory: buffers, ``W_enc``, ``W_skip`` and
        resident decoders (a memory-mapped decoder counts 0). Each storage counts once, whole."""
        tensors = [*self.buffers(), *([] if self.W_enc is None else [self.W_enc]),
                   *(self.W_skip or []), *([] if self._handles else self.W_dec)]
        storages = {}
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
        return sum(storages.values())

    def save_model(self, path: str) -> None:
        """Write a CLT in the mntss layout, a per-layer set in circuit-tracer's
        (see :mod:`~pyvene_causaltrace.transcoders.formats`)."""
        _LAYOUTS["save"](self, path)

    # ------------------------------------------------------------------------ encoder
    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def n_local(self) -> int:
        """Features per layer this object holds (``cfg.d_transcoder`` unless a shard)."""
        return self.cfg.d_transcoder if self.features is None \
            else self.features[1] - self.features[0]

    @property
    def feature_offset(self) -> int:
        """Global id of local feature 0 (0 unless a shard)."""
        return 0 if self.features is None else self.features[0]

    def encoder_weight(self, layer: int) -> torch.Tensor:
        """``W_enc[layer]`` ``[F, D]`` (a shard's ``[n_local, D]``) in the compute dtype (read
        from disk if streamed)."""
        if self.W_enc is not None:
            return self.W_enc[layer]
        return self._encoder_loader(layer).to(self.device_, self.dtype)

    def preactivation(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """``z = x @ W_enc[layer].T + b_enc[layer]``, ``[..., F]`` (a shard's ``n_local``)."""
        return x.to(self.dtype) @ self.encoder_weight(layer).T + self.b_enc[layer]

    def encode(self, x: torch.Tensor, layer: int,
               selection: torch.Tensor | None = None) -> torch.Tensor:
        """Features ``[..., F]`` of the input hook's values ``x [..., D]`` at ``layer`` (a
        shard's ``[..., n_local]``, local ids). A ``joint_topk`` transcoder needs ``selection``
        (bool, this layer's part of :meth:`joint_selection`): one layer's input cannot say what
        the joint top-k kept. A top-k shard's encode is a collective (module docstring)."""
        z = self.preactivation(x, layer)
        if self.cfg.joint:
            if selection is None:
                raise InputError(
                    f"a {self.cfg.activation} transcoder ranks all {self.n_layers} layers' "
                    f"features together, so layer {layer}'s features are not known from its "
                    "input alone: use encode_all, or pass selection= (joint_selection of every "
                    "layer's input, e.g. the clean run's)")
            return torch.relu(z) * selection.to(z.device)
        weight = None if self.score_weight is None else self.score_weight[layer]
        if self.features is not None and self.cfg.activation in RANKED_ACTIVATIONS:
            source = torch.relu(z) if self.cfg.activation == "relu_topk" else z
            ranked = source if weight is None else source * weight
            ids = torch.arange(self.n_local, device=z.device) + self.feature_offset
            keep = self._global_topk(ranked.reshape(-1, self.n_local), ids,
                                     f"layer {layer}'s top-k over ranks")
            return torch.where(keep.reshape(source.shape), source, torch.zeros_like(source))
        return activate(z, self.cfg.activation, self.threshold[layer], self.cfg.k, weight)

    def joint_selection(self, inputs: torch.Tensor) -> torch.Tensor:
        """Bool ``[L, ..., F]``: the features the joint top-k keeps given every layer's input
        ``inputs [L, ..., D]`` — at each position, the ``k`` largest ``relu(z) *
        score_weight`` over all layers' features together (features with ``relu(z) = 0`` are
        never kept). A shard returns its part ``[L, ..., n_local]`` (a collective)."""
        if not self.cfg.joint:
            raise InputError(f"a {self.cfg.activation} transcoder selects per layer")
        scores = torch.stack([torch.relu(self.preactivation(inputs[layer], layer))
                              * self.score_weight[layer] for layer in range(self.n_layers)])
        flat = scores.movedim(0, -2).flatten(-2)  # [..., L * F]
        if self.features is None:
            index = flat.topk(min(self.cfg.k, flat.shape[-1]), dim=-1).indices
            keep = torch.zeros_like(flat, dtype=torch.bool).scatter(-1, index, True)
        else:  # (layer, feature) -> layer * F + global feature: increasing in local order
            ids = (torch.arange(self.n_layers, device=flat.device)[:, None] * self.cfg.d_transcoder
                   + torch.arange(self.n_local, device=flat.device) + self.feature_offset)
            keep = self._global_topk(flat.reshape(-1, flat.shape[-1]), ids.flatten(),
                                     "the joint top-k over ranks").reshape(flat.shape)
        keep = keep & (flat > 0)
        return keep.unflatten(-1, (self.n_layers, -1)).movedim(-2, 0)

    def _global_topk(self, source: torch.Tensor, ids: torch.Tensor, what: str) -> torch.Tensor:
        """Bool ``[N, M]``: which of this shard's columns of ``source [N, M]`` (global ids
        ``ids [M]``, increasing) are among the ``k`` largest of every rank's, row by row
        (:func:`~..distributed.topk_over_ranks`: ties to the lower id)."""
        ranks = distributed.current()
        if ranks is None:
            raise InputError(RANKED_SHARD_ALONE.format(activation=self.cfg.activation,
                                                       k=self.cfg.k))
        return distributed.topk_over_ranks(ranks, source, ids, self.cfg.k, what)

    def encode_all(self, inputs: torch.Tensor, zero_bos: bool = True) -> torch.Tensor:
        """``[L, P, D]`` -> ``[L, P, F]`` (a shard's ``n_local``); position 0 zeroed unless
        ``zero_bos=False``."""
        selection = self.joint_selection(inputs) if self.cfg.joint else [None] * self.n_layers
        acts = torch.stack([self.encode(inputs[layer], layer, selection[layer])
                            for layer in range(self.n_layers)])
        if zero_bos:
            acts[:, 0] = 0
        return acts

    # ------------------------------------------------------------------------ decoder
    def decoder_rows(self, layer: int, feature_ids: torch.Tensor) -> torch.Tensor:
        """``W_dec[layer][feature_ids]`` ``[n, T_layer, D]``, gathered (only these rows are
        read from a mmapped decoder, and checked as they are: dtype, NaN/inf) and converted to
        the compute dtype. A shard takes local ids."""
        rows = self.W_dec[layer].index_select(0, feature_ids.to(self.W_dec[layer].device))
        if self._handles:  # one map per layer: its (file, tensor) names a bad row's source
            check_weight(rows, *self._handles[layer].origin)
        return rows.to(self.device_, self.dtype)

    def skip(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The skip path's output ``x @ W_skip[layer].T`` (zeros without one)."""
        if self.W_skip is None:
            return torch.zeros(x.shape[:-1] + (self.cfg.d_model,), dtype=self.dtype,
                               device=x.device)
        return x.to(self.dtype) @ self.W_skip[layer].T

    def reconstruct(self, acts: torch.Tensor, inputs: torch.Tensor | None = None, *,
                    partial: bool = False) -> torch.Tensor:
        """``[L, P, F]`` activations (a shard's ``n_local``) -> ``[L, P, D]`` reconstructed
        outputs (with ``b_dec``, and the skip path of ``inputs [L, P, D]`` when the transcoder
        has one). ``partial``: the decoder sum alone (``inputs`` unread), a shard's part."""
        n_layers, n_pos, width = acts.shape
        if width != self.n_local:
            raise InputError(f"acts hold {width} features per layer; this transcoder "
                             f"{'shard ' if self.features else ''}holds {self.n_local}")
        if self.features is not None and not partial:
            raise InputError("a shard's features are a part of every layer's: its reconstruction "
                             "is partial (reconstruct(..., partial=True), summed over every "
                             "shard, plus b_dec and the skip once); load the whole transcoder "
                             "for the whole reconstruction")
        if self.W_skip is not None and inputs is None and not partial:
            raise InputError("a transcoder with a skip path reconstructs from its inputs too")
        recon = self.b_dec[:, None, :].expand(n_layers, n_pos, -1).clone()
        if partial:
            recon.zero_()
        for layer in range(n_layers):
            if inputs is not None and not partial:
                recon[layer] += self.skip(inputs[layer], layer)
            pos, fid = acts[layer].nonzero(as_tuple=True)
            if pos.numel() == 0:
                continue
            n_targets = self.cfg.n_targets(layer)
            unique, inverse = fid.unique(return_inverse=True)  # read each row once
            rows = self.decoder_rows(layer, unique)[inverse]  # [n, T, D]
            contrib = rows * acts[layer, pos, fid][:, None, None]
            flat = torch.zeros(n_targets * n_pos, self.cfg.d_model,
                               dtype=self.dtype, device=self.device_)
            targets = torch.arange(n_targets, device=self.device_)
            index = (targets[None, :] * n_pos + pos[:, None]).reshape(-1)
            flat.index_add_(0, index, contrib.reshape(-1, self.cfg.d_model))
            recon[layer:layer + n_targets] += flat.reshape(n_targets, n_pos, self.cfg.d_model)
        return recon

    def __deepcopy__(self, memo) -> Transcoder:
        # Read-only and possibly gigabytes backed by open file maps: copies share it (pyvene
        # deep-copies its config, which holds interventions that hold the transcoder).
        return self

    def extra_repr(self) -> str:
        c = self.cfg
        lazy = "mmapped" if self._handles else "resident"
        kind = ("cross-layer" if c.cross_layer else "per-layer") + (" + skip" if c.skip else "")
        act = f"{c.activation}(k={c.k})" if c.k is not None else c.activation
        part = "" if self.features is None else f" (shard: features [{self.features[0]}, " \
            f"{self.features[1]}))"
        return (f"{c.model_name}: {kind}, {c.n_layers} layers x {c.d_transcoder} features{part}, "
                f"d_model={c.d_model}, {act}, decoder {lazy}, dtype={self.dtype}")


def sliced_loader(loader: Callable[[int], torch.Tensor], lo: int, hi: int
                  ) -> Callable[[int], torch.Tensor]:
    """A streamed encoder's loader for rows ``[lo, hi)``: the loader's own ``sliced(lo, hi)``
    when it has one (it then reads only those rows), else its whole ``W_enc[layer]`` sliced."""
    sliced = getattr(loader, "sliced", None)
    if sliced is not None:
        return sliced(lo, hi)
    return lambda layer: loader(layer)[lo:hi]


def activate(z: torch.Tensor, activation: str, threshold: torch.Tensor | None = None,
             k: int | None = None, score_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Feature activations from pre-activations ``z [..., F]``; ``relu_topk`` ranks
    ``relu(z) * score_weight`` when given."""
    if activation == "jumprelu":
        return z * (z > threshold)
    if activation == "relu":
        return torch.relu(z)
    if activation == "joint_topk":
        raise InputError("joint_topk selects over all layers: Transcoder.encode_all or "
                         "Transcoder.encode(..., selection=)")
    if activation in ("topk", "relu_topk"):
        source = torch.relu(z) if activation == "relu_topk" else z
        if score_weight is not None:
            index = (source * score_weight).topk(k, dim=-1).indices
            return torch.zeros_like(z).scatter(-1, index, source.gather(-1, index))
        values, index = source.topk(k, dim=-1)
        return torch.zeros_like(z).scatter(-1, index, values)
    raise InputError(f"unknown activation {activation!r}")


@checked
def check_fits(model: nn.Module | BoundModel, transcoder: Transcoder) -> None:
    """Raise :class:`TranscoderMismatchError` unless ``transcoder`` has the model's layer count
    and width and its hooks exist in the model; warn when the names differ (the shapes may
    agree by accident: run the pairing check)."""
    bound = bind(model)
    model, adapter = bound.model, bound.adapter
    n_layers, d_model = bound.n_layers, bound.d_model
    cfg = transcoder.cfg
    if (cfg.n_layers, cfg.d_model) != (n_layers, d_model):
        raise TranscoderMismatchError(
            f"the transcoder ({cfg.model_name}) has {cfg.n_layers} layers x d_model "
            f"{cfg.d_model}; the model has {n_layers} layers x {d_model}")
    for role, component in cfg.hf_hooks(adapter, 0).items():
        path = component.rsplit(".", 1)[0]
        try:
            get_module(model, path)
        except InputError:
            raise TranscoderMismatchError(
                f"the transcoder's {role} hook {getattr(cfg, f'feature_{role}_hook')!r} maps to "
                f"{path}, which {bound.model_type} does not have") from None
    name = model_name(model)
    if cfg.model_name and name and cfg.model_name not in (name, name.split("/")[-1]):
        warnings.warn(f"the transcoder was made for {cfg.model_name!r}, the model is {name!r}; "
                      "run check_pairing before trusting it", stacklevel=2)
