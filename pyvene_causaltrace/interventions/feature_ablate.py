"""``feature_ablate``: scale, zero or set chosen transcoder features inside a ``clt_splice``.

    FeatureAblate(clt=clt, session=session, clt_layer=3, features=[17], positions=[5])  # zero
    FeatureAblate(..., scale=2.0)                  # double them
    FeatureAblate(..., value=8.0)                  # set them to 8 (steering)
    FeatureAblate(..., features=[17, 40], value=[8.0, 0.0])   # one value per feature
    FeatureAblate(..., row_values=[8.0, None, 2.0])  # batch row 0 sets 8, row 1 nothing, ...

It sits on the transcoder's input hook after its layer's encoder (``clt_splice_representations``
places it there, ``ablations=[{...}]``) and changes the session's features before any decoder
reads them; ``positions=None`` means every position of the forward (in a generation loop that
recomputes the sequence, every generated position too). ``scale`` and ``value`` exclude each
other; with neither, the features are zeroed. ``features="all"`` switches the whole layer off
(its decoders then add nothing, leaving ``b_dec``). ``row_values`` (Python only, not a spec
field) gives each row of a batch of copies of one prompt its own value, ``None`` leaving a row
as it is: many single-feature patches in one forward (``crosscheck``). ``keep`` and ``outside``
(Python only, with ``features="all"``): a bool ``[B, P, F]`` mask and values ``[1 or B, P, F]``;
every feature where ``keep`` is False is set to ``outside``, the rest stay as encoded: one
circuit per batch row (``attribution.faithfulness``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InputError, NonFiniteError, SpecError
from .spec_entry import Site, SpecContext
from .splice_session import SpliceIntervention


def _finite(value: object, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"feature_ablate {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise NonFiniteError(f"feature_ablate {name} must be finite, got {value!r}")
    return float(value)


def _values(value: object, features: list[int] | str) -> float | list[float] | None:
    """``value`` as a float, or a list of floats with one per feature."""
    if not isinstance(value, list | tuple):
        return _finite(value, "value")
    if features == "all" or len(value) != len(features):
        raise InputError(f"feature_ablate value is a list of {len(value)}: give one value per "
                         f"feature ({'a list of features' if features == 'all' else len(features)})"
                         " or a single number")
    return [_finite(v, "value") for v in value]  # type: ignore[misc]


class FeatureAblate(SpliceIntervention):
    """Scale (default: zero) or set to ``value`` the ``features`` of layer ``clt_layer`` at
    ``positions`` (None: all) inside a splice (see module docstring)."""

    registered_name = "feature_ablate"
    tensor_fields = ("keep", "outside")

    def _setup(self, clt_layer: int, features: list[int] | str,
               positions: list[int] | None = None, scale: float | None = None,
               value: float | list[float] | None = None,
               row_values: list[float | None] | None = None, source: str | None = None,
               session: str | None = None, keep: torch.Tensor | None = None,
               outside: torch.Tensor | None = None) -> None:
        source = source if source is not None else self._source_of()
        self._set_circuit(keep, outside, features, positions, scale, value, row_values)
        if scale is not None and value is not None:
            raise InputError(f"feature_ablate takes scale or value, not both (got scale={scale}, "
                             f"value={value}): scale multiplies the features, value sets them")
        if row_values is not None:
            if scale is not None or value is not None:
                raise InputError("feature_ablate row_values excludes scale and value")
            if not isinstance(row_values, list | tuple) or not row_values:
                raise InputError(f"row_values must be a non-empty list (one value or None per "
                                 f"batch row), got {row_values!r}")
            row_values = [None if v is None else _finite(v, "row value") for v in row_values]
        if features != "all":
            features = [int(f) for f in features]
            if not features or any(f < 0 for f in features):
                raise InputError(f"features must be 'all' or a non-empty list of ids >= 0, "
                                 f"got {features}")
            if isinstance(value, list | tuple) and len(set(features)) < len(features):
                raise InputError(f"features {features} name one feature twice, with one value "
                                 "each: give each once")
        if positions is not None and any(int(p) < 0 for p in positions):
            raise InputError(f"feature_ablate positions must be >= 0, got {positions}")
        value = _values(value, features)
        scale = _finite(scale, "scale")
        self._config = {"clt_layer": int(clt_layer), "features": features,
                        "positions": None if positions is None else [int(p) for p in positions],
                        "scale": 0.0 if scale is None and value is None else scale,
                        "value": value, "row_values": row_values, "source": source,
                        "session": self._session_id(session, source)}

    def _set_circuit(self, keep, outside, features, positions, scale, value,
                     row_values) -> None:
        """Check and hold ``keep`` and ``outside`` (module docstring)."""
        if keep is None and outside is None:
            self._set_tensor("keep", None)
            self._set_tensor("outside", None)
            return
        if keep is None or outside is None:
            raise InputError("feature_ablate keep and outside come together: the mask of the "
                             "features kept and the values of the others")
        if features != "all" or positions is not None or any(
                v is not None for v in (scale, value, row_values)):
            raise InputError("feature_ablate keep/outside act on every feature and position "
                             "(features='all'), without positions, scale, value or row_values")
        if keep.dtype != torch.bool or keep.dim() != 3 or outside.dim() != 3 or \
                outside.shape[0] not in (1, keep.shape[0]) or outside.shape[1:] != keep.shape[1:]:
            raise InputError(f"feature_ablate keep must be bool [B, P, F] and outside [1 or B, "
                             f"P, F], got {keep.dtype} {tuple(keep.shape)} and "
                             f"{tuple(outside.shape)}")
        self._set_tensor("keep", keep)
        self._set_tensor("outside", outside)

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
                    "positions": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                  "description": "Prompt positions (absent: every position)."},
                    "scale": {"type": "number", "default": 0.0,
                              "description": "Multiply the features by this (0: ablate)."},
                    "value": {"oneOf": [{"type": "number"}, {
                        "type": "array", "minItems": 1, "items": {"type": "number"}}],
                              "description": "Set the features to this value (or one value "
                                             "per feature) instead of scaling them "
                                             "(steering); excludes scale."}}}

    @classmethod
    def check_spec(cls, entry: dict, spec: dict, path: str) -> None:
        if "scale" in entry and "value" in entry:
            raise SpecError(f"{path}.value", "scale and value exclude each other: scale "
                                             "multiplies the features, value sets them")
        for key in ("scale", "value"):
            values = entry.get(key)
            values = values if isinstance(values, list) else [] if values is None else [values]
            if not all(math.isfinite(v) for v in values):
                raise SpecError(f"{path}.{key}", f"must be finite, got {entry[key]!r}")
        value = entry.get("value")
        if isinstance(value, list) and (entry["features"] == "all"
                                        or len(value) != len(entry["features"])):
            raise SpecError(f"{path}.value", f"{len(value)} values: give one per feature, or "
                                             "a single number")

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        return []  # built by the clt_splice entry

    def to_spec(self, site: Site) -> dict[str, Any]:
        if self._config.get("row_values") is not None or self.keep is not None:
            raise InputError("a feature_ablate with row_values or keep/outside (one circuit "
                             "per batch row) is not a spec entry")
        keys = ("clt_layer", "features", "positions",
                "value" if self._config.get("value") is not None else "scale")
        return {"type": self.registered_name,
                **{k: self._config[k] for k in keys if self._config.get(k) is not None}}

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        session = self.session.acts
        layer = self._config["clt_layer"]
        if layer not in session:
            raise InputError(f"feature_ablate at layer {layer} needs a clt_splice encoder "
                             "at the same layer, placed before it")
        acts = session[layer].clone()
        positions = self._config["positions"]
        features = self._config["features"]
        if features != "all" and max(features) >= acts.shape[-1]:
            raise InputError(f"feature {max(features)} is outside layer {layer}'s "
                             f"{acts.shape[-1]} features")
        if positions is not None and positions and max(positions) >= acts.shape[1]:
            raise InputError(f"position {max(positions)} is outside a sequence of "
                             f"{acts.shape[1]} tokens")
        columns = slice(None) if features == "all" else features
        if self.keep is not None:
            if self.keep.shape[1:] != acts.shape[1:] or self.keep.shape[0] != acts.shape[0]:
                raise InputError(f"feature_ablate keep is {tuple(self.keep.shape)}, the layer's "
                                 f"features {tuple(acts.shape)} (batch, positions, features)")
            session[layer] = torch.where(self.keep.to(acts.device), acts,
                                         self.outside.to(acts.device, acts.dtype))
            return base
        if self._config.get("row_values") is not None:
            session[layer] = self._set_rows(acts, positions, columns)
            return base
        value = self._config.get("value")
        block = acts if positions is None else acts[:, positions]
        if isinstance(value, list):
            block[..., columns] = torch.tensor(value, dtype=acts.dtype, device=acts.device)
        elif value is not None:
            block[..., columns] = value
        else:
            block[..., columns] = block[..., columns] * self._config["scale"]
        if positions is not None:
            acts[:, positions] = block
        session[layer] = acts
        return base

    def _set_rows(self, acts: torch.Tensor, positions: list[int] | None,
                  columns: slice | list[int]) -> torch.Tensor:
        """Each batch row's value at ``positions`` x ``columns`` (rows given None untouched)."""
        values = self._config["row_values"]
        if len(values) != acts.shape[0]:
            raise InputError(f"feature_ablate has {len(values)} row values for a batch of "
                             f"{acts.shape[0]}")
        rows = [i for i, v in enumerate(values) if v is not None]
        if not rows:
            return acts
        device = acts.device
        row = torch.tensor(rows, device=device)
        pos = torch.arange(acts.shape[1], device=device) if positions is None \
            else torch.tensor(positions, device=device)
        col = torch.arange(acts.shape[2], device=device) if isinstance(columns, slice) \
            else torch.tensor(columns, device=device)
        new = torch.tensor([values[i] for i in rows], dtype=acts.dtype, device=device)
        acts[row[:, None, None], pos[None, :, None], col[None, None, :]] = new[:, None, None]
        return acts
