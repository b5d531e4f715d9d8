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

What one splice's interventions share during a forward — each layer's features and inputs,
and in leaf mode the leaves — is a :class:`SpliceSession`, handed to the caller (pass your own
with ``session=``, or read ``splice_session(reps)``), never stored on the transcoder. Its
interventions carry the session's id in their configuration, so a splice loaded by
``pv.IntervenableModel.load`` finds one session again. They refer to their transcoder by its path
(``clt.source``); loading reads it once per process and reads it again when its files change.
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, SpecError
from ..locations import resolve_layers
from ..models import get_adapter
from ..transcoders.formats import load_transcoder
from ..transcoders.hooks import norm_settings, normalize, transcoder_states
from ..transcoders.transcoder import check_fits
from .base import CausalTraceIntervention
from .spec_entry import Site, SpecContext

#: Transcoders read by path, keyed by the files' identity (see :func:`file_identity`).
_TRANSCODERS: dict[tuple, Any] = {}


def file_identity(source: str) -> tuple:
    """What identifies a transcoder's files: the resolved path and each file's size and
    modification time (a directory's files, or a config file and the files beside it); a hub
    id as it is."""
    path = Path(source).expanduser()
    if not path.exists():
        return (source,)
    root = path if path.is_dir() else path.parent
    files = sorted(p for p in root.iterdir() if p.is_file())
    return (str(path.resolve()),
            *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def resolve_transcoder(source: str | None, clt=None):
    """``clt`` itself, or the transcoder at ``source`` (read once per version of its files)."""
    if clt is not None:
        if clt.source is not None:
            _TRANSCODERS.setdefault(file_identity(clt.source), clt)
        return clt
    if source is None:
        raise InputError("clt_splice needs a transcoder (an object, or the path it was loaded "
                         "from)")
    key = file_identity(source)
    if key not in _TRANSCODERS:
        _TRANSCODERS[key] = load_transcoder(source)
    return _TRANSCODERS[key]


@dataclass(eq=False)
class SpliceSession:
    """What one splice's interventions share during a forward: per layer the features
    (``acts``, after any ``feature_ablate``) and the transcoder's inputs; in leaf mode
    ``leaves`` — ``features`` (:class:`ActiveFeatures`), ``writes``, ``errors``, ``inputs`` per
    layer and the ``b_dec`` leaf. The first encoder of a forward clears it."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    acts: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    leaves: dict[str, Any] = field(default_factory=dict)

    def clear(self) -> None:
        self.acts.clear()
        self.inputs.clear()
        self.leaves.clear()

    def __deepcopy__(self, memo) -> SpliceSession:
        # pyvene deep-copies its config, which holds the interventions: they must keep sharing
        # the session their caller holds
        return self


#: Live sessions by id, so interventions rebuilt from a saved configuration share one.
_SESSIONS: weakref.WeakValueDictionary[str, SpliceSession] = weakref.WeakValueDictionary()


def _session_for(session_id: str | None) -> SpliceSession:
    if session_id is not None and session_id in _SESSIONS:
        return _SESSIONS[session_id]
    session = SpliceSession() if session_id is None else SpliceSession(id=session_id)
    _SESSIONS[session.id] = session
    return session


def splice_session(representations: list[dict]) -> SpliceSession:
    """The session of the splice in ``representations`` (from
    :func:`clt_splice_representations`)."""
    for rep in representations:
        intervention = rep["intervention"]
        if isinstance(intervention, _CLTIntervention):
            return intervention.session
    raise InputError("no clt_splice among these representations")


@dataclass
class ActiveFeatures:
    """The active features of one layer in a leaf-mode splice: batch row, position, feature id
    and value (an autograd leaf) of each, and their decoder rows ``[n, L - layer, D]``."""

    row: torch.Tensor
    position: torch.Tensor
    feature: torch.Tensor
    value: torch.Tensor
    decoder: torch.Tensor


def _leaf_session(session: SpliceSession) -> dict:
    if not session.leaves:
        session.leaves.update({"features": {}, "writes": {}, "errors": {}, "inputs": {}})
    return session.leaves


class _CLTIntervention(CausalTraceIntervention):
    _config_keys: tuple[str, ...] = ()

    def __init__(self, clt=None, session: SpliceSession | None = None, **kwargs: Any) -> None:
        # plain references, not submodules: they must not enter pyvene's state dicts
        self.__dict__["_clt_object"] = clt
        self.__dict__["_session_object"] = session
        own = {k: kwargs.pop(k) for k in self._config_keys if k in kwargs}
        super().__init__(**own, **kwargs)

    @property
    def clt(self):
        return resolve_transcoder(self._config.get("source"), self._clt_object)

    @property
    def session(self) -> SpliceSession:
        """The splice's shared state (found again by id after a pyvene load)."""
        if self.__dict__["_session_object"] is None:
            self.__dict__["_session_object"] = _session_for(self._config.get("session"))
            self._config["session"] = self.__dict__["_session_object"].id
        return self.__dict__["_session_object"]

    def _session_id(self, session_id: str | None, source: str | None) -> str:
        """The id of the session given to the constructor, else the saved one, else the
        transcoder's default session (interventions built one by one share it)."""
        given = self.__dict__.get("_session_object")
        if given is not None:
            _SESSIONS[given.id] = given
            return given.id
        if session_id is not None:
            return session_id
        return f"default:{source if source is not None else id(self._clt_object)}"

    def _source_of(self) -> str | None:
        return self._clt_object.source if self._clt_object is not None else None


class CLTSplice(_CLTIntervention):
    """One role of a CLT splice at one layer (see module docstring)."""

    registered_name = "clt_splice"
    tensor_fields = ("error",)
    _config_keys = ("role", "clt_layer", "from_position", "add_error", "reset", "leaves",
                    "source", "error", "normalize", "session")

    def _setup(self, role: str, clt_layer: int, from_position: int = 1, add_error: bool = False,
               reset: bool = False, leaves: bool = False, source: str | None = None,
               error: torch.Tensor | None = None, normalize: dict | None = None,
               session: str | None = None) -> None:
        source = source if source is not None else self._source_of()
        if role not in ("encode", "decode"):
            raise InputError(f"role must be 'encode' or 'decode', got {role!r}")
        if from_position < 0:
            raise InputError(f"from_position must be >= 0, got {from_position}")
        if error is not None and (add_error or role != "decode"):
            raise InputError("a fixed error goes on a decoder, instead of add_error")
        self._set_tensor("error", error)
        self._config = {"role": role, "clt_layer": int(clt_layer),
                        "from_position": int(from_position),
                        "add_error": bool(add_error), "reset": bool(reset),
                        "leaves": bool(leaves),
                        "source": source,
                        "normalize": None if normalize is None else dict(normalize),
                        "session": self._session_id(session, source)}

    # -- spec entry: one entry is the whole splice (every layer's encoder and decoder, with the
    # spec's feature_ablate entries after their layer's encoder), sharing one session
    spec_unique = True

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "required": ["clt"], "properties": {
            "type": True,
            "clt": {"type": "string", "minLength": 1,
                    "description": "The transcoder: an mntss CLT directory, a circuit-tracer "
                                   "config.yaml, a GemmaScope / sae-lens / sparsify directory, "
                                   "or a hub id (layout detected)."},
            "layers": {"$ref": "#/$defs/layers", "default": "all"},
            "from_position": {"type": "integer", "minimum": 0, "default": 1,
                              "description": "First spliced position; 1 leaves BOS alone."},
            "add_error": {"type": "boolean", "default": False,
                          "description": "Add the frozen error so the forward is exact."}}}

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        try:
            clt = resolve_transcoder(entry["clt"])
        except (OSError, ValueError) as error:
            raise SpecError(ctx.path(index, "clt"), str(error)) from None
        layers = resolve_layers(entry.get("layers", "all"), clt.n_layers,
                                ctx.path(index, "layers"))
        ablations = [dict(item.fields) for item in ctx.spec.interventions
                     if item.type == "feature_ablate"]
        reps = clt_splice_representations(
            clt, ctx.model, layers=layers, from_position=entry.get("from_position", 1),
            add_error=entry.get("add_error", False), ablations=ablations)
        return [Site(index, rep["component"], rep["intervention"].config()["clt_layer"],
                     where=ctx.path(index, "clt"), made=rep["intervention"]) for rep in reps]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return site.made

    def to_spec(self, site: Site) -> dict[str, Any]:
        return {"type": self.registered_name, "clt": self._config["source"],
                "layers": [self._config["clt_layer"]],
                "from_position": self._config["from_position"],
                "add_error": self._config["add_error"]}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        clt, layer = self.clt, self._config["clt_layer"]
        start = self._config["from_position"]
        session = self.session
        if self._config["reset"] and self._config["role"] == "encode":
            session.clear()
        if self._config["leaves"]:
            return self._leaf_forward(base, clt, layer, start, _leaf_session(session))
        if self._config["role"] == "encode":
            x = self._input(base)
            acts = clt.encode(x, layer)
            acts = torch.cat([torch.zeros_like(acts[:, :start]), acts[:, start:]], dim=1)
            session.acts[layer] = acts
            session.inputs[layer] = x
            return base
        recon = clt.b_dec[layer].to(base.dtype).expand_as(base)
        inputs = session.inputs
        if layer not in inputs:
            raise InputError(f"the decoder of layer {layer} needs its encoder, placed before "
                             "it in the same forward")
        recon = recon + clt.skip(inputs[layer], layer).to(base.dtype)
        for source_layer in clt.cfg.sources(layer):
            acts = session.acts.get(source_layer)
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
    _config_keys = ("clt_layer", "features", "positions", "scale", "source", "session")

    def _setup(self, clt_layer: int, features: list[int] | str,
               positions: list[int] | None = None, scale: float = 0.0,
               source: str | None = None, session: str | None = None) -> None:
        source = source if source is not None else self._source_of()
        if features != "all":
            features = [int(f) for f in features]
        self._config = {"clt_layer": int(clt_layer), "features": features,
                        "positions": None if positions is None else [int(p) for p in positions],
                        "scale": float(scale), "source": source,
                        "session": self._session_id(session, source)}

    # -- spec entry: read by the spec's clt_splice, which places it after its layer's encoder
    spec_requires = ("clt_splice",)

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False, "required": ["clt_layer", "features"],
                "properties": {
                    "type": True, "clt_layer": {"type": "integer", "minimum": 0},
                    "features": {"oneOf": [{"const": "all"}, {
                        "type": "array", "minItems": 1,
                        "items": {"type": "integer", "minimum": 0}}]},
                    "positions": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "scale": {"type": "number", "default": 0.0}}}

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        return []  # built by the clt_splice entry

    def to_spec(self, site: Site) -> dict[str, Any]:
        return {"type": self.registered_name,
                **{k: self._config[k] for k in ("clt_layer", "features", "positions", "scale")
                   if self._config[k] is not None}}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        session = self.session.acts
        layer = self._config["clt_layer"]
        if layer not in session:
            raise InputError(f"feature_ablate at layer {layer} needs a clt_splice encoder "
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
    states = transcoder_states(clt, model, input_ids)
    inputs = states["input"].to(clt.dtype)
    recon = clt.reconstruct(clt.encode_all(inputs), inputs)
    return (states["output"] - recon.to(states["output"].dtype))[:, None]


def clt_splice_representations(
    clt, model, *, layers: list[int] | None = None, from_position: int = 1,
    add_error: bool = False, ablations: list[dict] | None = None, leaves: bool = False,
    errors: torch.Tensor | None = None, session: SpliceSession | None = None,
) -> list[dict]:
    """pyvene representation dicts that splice ``clt`` into ``model`` at ``layers`` (all by
    default), with ``ablations`` (``feature_ablate`` keyword dicts with ``clt_layer``) after
    their layer's encoder; ``leaves=True`` builds the attribution graph's leaf-mode splice
    (always with the error term, see module docstring); ``errors`` (``[L, 1, P, D]``, from
    :func:`clean_errors`) fixes each decoder's error term. The interventions share ``session``
    (a new :class:`SpliceSession` by default; :func:`splice_session` finds it)."""
    if leaves and ablations:
        raise InputError("a leaf-mode splice does not take ablations")
    check_fits(clt, model)
    adapter = get_adapter(model)
    session = SpliceSession() if session is None else session
    layers = list(range(clt.n_layers)) if layers is None else sorted(layers)
    out = []
    for index, layer in enumerate(layers):
        hooks = clt.cfg.hf_hooks(adapter, layer)
        out.append({"component": hooks["input"], "intervention": CLTSplice(
            clt=clt, session=session, role="encode", clt_layer=layer,
            from_position=from_position,
            add_error=add_error or leaves, reset=index == 0, leaves=leaves,
            normalize=norm_settings(model, clt.cfg.feature_input_hook, layer))})
        for ablation in ablations or []:
            if ablation["clt_layer"] == layer:
                out.append({"component": hooks["input"],
                            "intervention": FeatureAblate(clt=clt, session=session,
                                                          **ablation)})
    for layer in layers:
        out.append({"component": clt.cfg.hf_hooks(adapter, layer)["output"],
                    "intervention": CLTSplice(clt=clt, session=session, role="decode",
                                              clt_layer=layer,
                                              from_position=from_position,
                                              add_error=add_error or leaves, leaves=leaves,
                                              error=None if errors is None else errors[layer])})
    return out
