"""``clt_splice`` and ``feature_ablate``: run a transcoder (cross-layer or a per-layer set) inside
the model.

A splice is two registered interventions per layer, built by :func:`clt_splice_representations`:

- ``role="encode"`` on the transcoder's input hook (``hook_resid_mid``, or the MLP's normalised
  input): computes the layer's features and keeps them, with the decoder rows of the features
  that fired and the hook's value (for a skip path), in the transcoder's per-forward session
  (positions before ``from_position`` zeroed);
- ``role="decode"`` on its output hook (``hook_mlp_out``): replaces positions
  ``>= from_position`` by ``b_dec[t] + sum_{l writing t} a_l @ W_dec[l][:, t - l] + skip_t(x_t)``,
  plus, with ``add_error``, the frozen error ``(out - recon).detach()`` so the forward is the
  original one while gradients flow through the features; or plus a fixed ``error`` tensor
  ``[1, P, D]`` (the clean run's error, :func:`clean_errors`), so that ablating features changes
  the output while the part the dictionary misses stays as it was.

With ``leaves=True`` (the attribution graph's local replacement model) the encoder keeps the
layer's active features as one autograd leaf vector (:class:`ActiveFeatures`, values cut from
the residual stream), and the decoder builds every position's output from those leaves, a
``b_dec`` leaf, the skip path of the live input (linear: its edges run to whatever feeds that
input) and the error ``out - recon`` as a leaf constant: the forward is still the original one,
and ``torch.autograd.grad`` on the leaves gives each feature's, error's and bias's direct effect.
The encoder also keeps its input live so each feature's pre-activation can be a gradient target.
Features before ``from_position`` are zero, but the decoder covers every position (the error
carries BOS exactly).

``feature_ablate`` sits on the same input hook after the encoder and scales chosen features
(zero by default) before any decoder reads them. The default ``from_position=1`` never splices
BOS: no dictionary is trained on the attention sink there, and splicing it wrecks the model.

The interventions refer to their transcoder by its path (``clt.source``), so
``pv.IntervenableModel.save``/``load`` round-trips them; loading reads it once per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..transcoders.hooks import norm_settings, normalize
from .base import CausalTraceIntervention

_CLTS: dict[str, Any] = {}  # source directory -> Transcoder, shared per process


def _resolve(source: str | None, clt=None):
    if clt is not None:
        if clt.source is not None:
            _CLTS.setdefault(clt.source, clt)
        return clt
    if source is None:
        raise ValueError("clt_splice needs a transcoder (an object, or the path it was loaded "
                         "from)")
    if source not in _CLTS:
        from ..transcoders.formats import load_transcoder

        _CLTS[source] = load_transcoder(source)
    return _CLTS[source]


@dataclass
class ActiveFeatures:
    """The active features of one layer in a leaf-mode splice: batch row, position, feature id
    and value (an autograd leaf) of each, and their decoder rows ``[n, L - layer, D]``."""

    row: torch.Tensor
    position: torch.Tensor
    feature: torch.Tensor
    value: torch.Tensor
    decoder: torch.Tensor


def _leaf_session(session: dict) -> dict:
    return session.setdefault("leaves", {"features": {}, "writes": {}, "errors": {},
                                         "inputs": {}})


class _CLTIntervention(CausalTraceIntervention):
    _config_keys: tuple[str, ...] = ()

    def __init__(self, clt=None, **kwargs: Any) -> None:
        # a plain reference, not a submodule: the CLT must not enter pyvene's state dicts
        self.__dict__["_clt_object"] = clt
        own = {k: kwargs.pop(k) for k in self._config_keys if k in kwargs}
        super().__init__(**own, **kwargs)

    @property
    def clt(self):
        return _resolve(self._config.get("source"), self._clt_object)

    def _source_of(self) -> str | None:
        return self._clt_object.source if self._clt_object is not None else None


class CLTSplice(_CLTIntervention):
    """One role of a CLT splice at one layer (see module docstring)."""

    registered_name = "clt_splice"
    tensor_fields = ("error",)
    _config_keys = ("role", "clt_layer", "from_position", "add_error", "reset", "leaves",
                    "source", "error", "normalize")

    def _setup(self, role: str, clt_layer: int, from_position: int = 1, add_error: bool = False,
               reset: bool = False, leaves: bool = False, source: str | None = None,
               error: torch.Tensor | None = None, normalize: dict | None = None) -> None:
        if role not in ("encode", "decode"):
            raise ValueError(f"role must be 'encode' or 'decode', got {role!r}")
        if from_position < 0:
            raise ValueError(f"from_position must be >= 0, got {from_position}")
        if error is not None and (add_error or role != "decode"):
            raise ValueError("a fixed error goes on a decoder, instead of add_error")
        self._set_tensor("error", error)
        self._config = {"role": role, "clt_layer": int(clt_layer),
                        "from_position": int(from_position),
                        "add_error": bool(add_error), "reset": bool(reset),
                        "leaves": bool(leaves),
                        "source": source if source is not None else self._source_of(),
                        "normalize": None if normalize is None else dict(normalize)}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        clt, layer = self.clt, self._config["clt_layer"]
        start = self._config["from_position"]
        session = clt.__dict__.setdefault("_session", {})
        if self._config["reset"] and self._config["role"] == "encode":
            session.clear()
        if self._config["leaves"]:
            return self._leaf_forward(base, clt, layer, start, _leaf_session(session))
        if self._config["role"] == "encode":
            x = self._input(base)
            acts = clt.encode(x, layer)
            acts = torch.cat([torch.zeros_like(acts[:, :start]), acts[:, start:]], dim=1)
            session.setdefault("acts", {})[layer] = acts
            session.setdefault("inputs", {})[layer] = x
            return base
        recon = clt.b_dec[layer].to(base.dtype).expand_as(base)
        inputs = session.get("inputs", {})
        if layer not in inputs:
            raise RuntimeError(f"the decoder of layer {layer} needs its encoder, placed before "
                               "it in the same forward")
        recon = recon + clt.skip(inputs[layer], layer).to(base.dtype)
        for source_layer in clt.cfg.sources(layer):
            acts = session.get("acts", {}).get(source_layer)
            if acts is None:
                continue
            active = (acts != 0).reshape(-1, acts.shape[-1]).any(0).nonzero().squeeze(-1)
            if active.numel() == 0:
                continue
            rows = clt.decoder_rows(source_layer, active)[:, layer - source_layer]  # [n, D]
            recon = recon + (acts[..., active] @ rows).to(base.dtype)
        if self._config["add_error"]:
            recon = recon + (base - recon).detach()
        elif self.error is not None:
            recon = recon + self.error[..., :base.shape[1], :].to(base.dtype)
        return torch.cat([base[:, :start], recon[:, start:]], dim=1)

    def _input(self, base: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        """The transcoder's input from the hook's value: itself, or normalised before the
        norm's gain (``ln2.hook_normalized``; frozen statistic in leaf mode)."""
        norm = self._config.get("normalize")
        return base if norm is None else normalize(base, norm["kind"], norm["eps"], frozen)

    def _leaf_forward(self, base: torch.Tensor, clt, layer: int, start: int,
                      leaves: dict) -> torch.Tensor:
        if self._config["role"] == "encode":
            x = self._input(base, frozen=True)
            with torch.no_grad():
                acts = clt.encode(x, layer)
                acts[:, :start] = 0
                row, position, feature = acts.nonzero(as_tuple=True)
                unique, inverse = feature.unique(return_inverse=True)
                decoder = clt.decoder_rows(layer, unique)[inverse]
            value = acts[row, position, feature].detach().requires_grad_(True)
            active = ActiveFeatures(row, position, feature, value, decoder)
            leaves["features"][layer] = active
            leaves["writes"][layer] = _writes(active, base.shape[:2], clt.cfg.n_targets(layer),
                                              clt.cfg.d_model)
            leaves["inputs"][layer] = x
            if "b_dec" not in leaves:
                leaves["b_dec"] = clt.b_dec.detach().clone().requires_grad_(True)
            return base
        recon = leaves["b_dec"][layer].expand(base.shape)
        recon = recon + clt.skip(leaves["inputs"][layer], layer)
        for source_layer in clt.cfg.sources(layer):
            writes = leaves["writes"].get(source_layer)
            if writes is not None:
                recon = recon + writes[layer - source_layer]
        recon = recon.to(base.dtype)
        error = (base - recon).detach().requires_grad_(True)
        leaves["errors"][layer] = error
        return recon + error


def _writes(active: ActiveFeatures, shape: tuple[int, int], n_targets: int,
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


class FeatureAblate(_CLTIntervention):
    """Scale (default: zero) ``features`` of layer ``clt_layer`` at ``positions`` (None: all)
    inside a splice; ``features="all"`` switches the whole layer off (its decoders then add
    nothing, leaving b_dec)."""

    registered_name = "feature_ablate"
    _config_keys = ("clt_layer", "features", "positions", "scale", "source")

    def _setup(self, clt_layer: int, features: list[int] | str,
               positions: list[int] | None = None, scale: float = 0.0,
               source: str | None = None) -> None:
        if features != "all":
            features = [int(f) for f in features]
        self._config = {"clt_layer": int(clt_layer), "features": features,
                        "positions": None if positions is None else [int(p) for p in positions],
                        "scale": float(scale),
                        "source": source if source is not None else self._source_of()}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        session = self.clt.__dict__.setdefault("_session", {}).setdefault("acts", {})
        layer = self._config["clt_layer"]
        if layer not in session:
            raise RuntimeError(f"feature_ablate at layer {layer} needs a clt_splice encoder "
                               "at the same layer, placed before it")
        acts = session[layer].clone()
        positions = self._config["positions"]
        where = slice(None) if positions is None else positions
        features = self._config["features"]
        columns = slice(None) if features == "all" else features
        chosen = acts[:, where][..., columns] * self._config["scale"]
        if positions is None:
            acts[..., columns] = chosen
        else:
            block = acts[:, positions]
            block[..., columns] = chosen
            acts[:, positions] = block
        session[layer] = acts
        return base


def clean_errors(clt, model, input_ids: torch.Tensor) -> torch.Tensor:
    """The clean run's transcoder error ``out - recon`` per layer, ``[L, 1, P, D]``, for a
    splice with a fixed error."""
    from ..transcoders.checks import transcoder_states

    states = transcoder_states(clt, model, input_ids)
    inputs = states["input"].to(clt.dtype)
    recon = clt.reconstruct(clt.encode_all(inputs), inputs)
    return (states["output"] - recon.to(states["output"].dtype))[:, None]


def clt_splice_representations(
    clt, model, *, layers: list[int] | None = None, from_position: int = 1,
    add_error: bool = False, ablations: list[dict] | None = None, leaves: bool = False,
    errors: torch.Tensor | None = None,
) -> list[dict]:
    """pyvene representation dicts that splice ``clt`` into ``model`` at ``layers`` (all by
    default), with ``ablations`` (``feature_ablate`` keyword dicts with ``clt_layer``) after
    their layer's encoder; ``leaves=True`` builds the attribution graph's leaf-mode splice
    (always with the error term, see module docstring); ``errors`` (``[L, 1, P, D]``, from
    :func:`clean_errors`) fixes each decoder's error term."""
    if leaves and ablations:
        raise ValueError("a leaf-mode splice does not take ablations")
    from ..models import get_adapter
    from ..transcoders.transcoder import check_fits

    check_fits(clt, model)
    adapter = get_adapter(model)
    layers = list(range(clt.n_layers)) if layers is None else sorted(layers)
    out = []
    for index, layer in enumerate(layers):
        hooks = clt.cfg.hf_hooks(adapter, layer)
        out.append({"component": hooks["input"], "intervention": CLTSplice(
            clt=clt, role="encode", clt_layer=layer, from_position=from_position,
            add_error=add_error or leaves, reset=index == 0, leaves=leaves,
            normalize=norm_settings(model, clt.cfg.feature_input_hook, layer))})
        for ablation in ablations or []:
            if ablation["clt_layer"] == layer:
                out.append({"component": hooks["input"],
                            "intervention": FeatureAblate(clt=clt, **ablation)})
    for layer in layers:
        out.append({"component": clt.cfg.hf_hooks(adapter, layer)["output"],
                    "intervention": CLTSplice(clt=clt, role="decode", clt_layer=layer,
                                              from_position=from_position,
                                              add_error=add_error or leaves, leaves=leaves,
                                              error=None if errors is None else errors[layer])})
    return out
