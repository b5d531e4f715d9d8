"""Overwrite a component's output with stored states, by per-row position masks.

Three registered names share one mechanism and differ in what the stored states mean:
``clean_restore``, clean-run states (ROME's restoration of one cell); ``window_restore``, clean
sublayer outputs at one layer of a window centred ROME's way (:func:`window_layers`; a spec
names it once and it expands to one instance per layer); ``freeze``, the states a component had
in another run, typically the corrupted one (ROME's severed traces).

Row ``r`` of the batch takes ``states[r]`` (or the single row of ``states``, or
``states[state_rows[r]]`` when ``state_rows`` maps rows to donors, e.g. to their noise seed's
corrupted run) at the positions where ``positions[r]`` is True; a row whose mask is empty is
returned untouched, bit for bit.

    restore = CleanRestore(states=clean_block_out, positions=[[4], [], [8]])
    pv_model = IntervenableModel([{"component": "model.layers[3].output",
                                   "intervention": restore}], model)

Without ``states`` the donor is pyvene's source run (``pv_model(base, sources=[clean])``), as
for ``VanillaIntervention``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError
from ..locations import window_layers
from .base import (
    CausalTraceIntervention,
    as_positions_last,
    fit_mask,
    positions_to_mask,
    rows_for,
    subspace_mask,
)
from .spec_entry import Site, SpecContext


class _Overwrite(CausalTraceIntervention):
    tensor_fields = ("states", "positions", "state_rows")
    _config_defaults: dict[str, Any] = {}

    def __init__(self, positions: Any = None, states: torch.Tensor | None = None,
                 state_rows: torch.Tensor | None = None, **kwargs: Any) -> None:
        super().__init__(positions=positions, states=states, state_rows=state_rows, **kwargs)

    def _setup(self, positions=None, states=None, state_rows=None, **config: Any) -> None:
        mask = positions_to_mask(positions)
        if states is not None:
            if states.dim() == 2:
                states = states.unsqueeze(0)
            if states.dim() != 3:
                raise InputError(f"states must be [rows, seq, hidden], got {tuple(states.shape)}")
            states = states.detach().clone()
        if state_rows is not None:
            if states is None:
                raise InputError("state_rows needs states")
            state_rows = torch.as_tensor(state_rows, dtype=torch.int64).reshape(-1)
            if state_rows.numel() and int(state_rows.max()) >= states.shape[0]:
                raise InputError(f"state_rows points past the {states.shape[0]} donor rows")
        self._set_tensor("positions", mask)
        self._set_tensor("states", states)
        self._set_tensor("state_rows", state_rows)
        self.is_source_constant = states is not None
        unknown = set(config) - set(self._config_defaults)
        if unknown:
            raise InputError(f"{self.registered_name} got unexpected settings "
                             f"{', '.join(sorted(unknown))}")
        self._config = {**self._config_defaults, **config}

    handles_units = True

    def forward(self, base: torch.Tensor, source=None, subspaces=None, **kwargs) -> torch.Tensor:
        """``base`` with the donor's values where the row's mask (and ``subspaces``, pyvene's
        dimensions) say. Head units come as ``[batch, heads, seq, d_head]``, the donor alike
        (pyvene gathers the source the same way)."""
        donor = self.states if self.states is not None else source
        if donor is None:
            raise InputError(
                f"{self.registered_name} has no stored states and pyvene passed no source")
        flat, back = as_positions_last(base)
        batch, seq_len, hidden = flat.shape
        if donor.dim() == base.dim():
            donor = as_positions_last(donor)[0]
        offset, generating = self._placement(seq_len)
        mask = fit_mask(None if self.positions is None else self.positions.to(base.device),
                        batch, offset + seq_len).to(base.device)[:, offset:]
        if mask.device.type == "cpu" and not bool(mask.any()):  # (a check on a GPU would sync)
            return base
        if generating:
            donor = _window(donor, offset, seq_len, mask, self.registered_name)
        if donor.shape[1] != seq_len or donor.shape[-1] != hidden:
            raise InputError(
                f"{self.registered_name}: donor states are {tuple(donor.shape)}, the component "
                f"output is {tuple(base.shape)}")
        if self.state_rows is not None:
            rows_for(batch, self.state_rows.numel(), "state_rows")
            donor = donor.index_select(0, self.state_rows.to(donor.device))
        rows_for(batch, donor.shape[0], "the donor states")
        where = back(mask.unsqueeze(-1).expand(batch, seq_len, hidden))
        dims = subspace_mask(subspaces, base, self.subspace_partition)
        if dims is not None:
            where = where & dims
        return torch.where(where, back(donor.to(base.device, base.dtype)), base)

    def retarget(self, positions: torch.Tensor, states: torch.Tensor | None = None,
                 state_rows: torch.Tensor | None = None) -> None:
        """Point this instance at another batch, copying nothing: a ``[rows, seq]`` bool mask,
        and optionally other donor states (kept as given, e.g. a view of longer states) and
        their row map. The trace engine calls this once per chunk of rows."""
        self._set_tensor("positions", positions)
        if states is not None:
            self._set_tensor("states", states)
        self._set_tensor("state_rows", state_rows)

    # -- spec entry: component, layers, positions; the donor run's states at each site
    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return cls(positions=site.positions, states=states)

    def to_spec(self, site: Site) -> dict[str, Any]:
        return {"type": self.registered_name, "component": site.component,
                "positions": "all" if site.positions is None else list(site.positions),
                **{k: v for k, v in self._config.items() if k in self.spec_schema()["properties"]}}


def _window(donor: torch.Tensor, offset: int, seq_len: int, mask: torch.Tensor,
            name: str) -> torch.Tensor:
    """The donor's positions ``offset .. offset + seq_len`` (a generation step's window);
    positions past the donor's end are zero, and must not be restored."""
    if offset == 0 and donor.shape[1] == seq_len:
        return donor
    window = donor[:, offset:offset + seq_len]
    missing = seq_len - window.shape[1]
    if missing > 0:
        if mask[:, seq_len - missing:].any():
            raise InputError(f"{name}: positions past the donor's {donor.shape[1]} states "
                             "are to be restored")
        window = torch.nn.functional.pad(window, (0, 0, 0, missing))
    return window


def _site_schema(required: list[str], defaults: dict[str, str], **extra: Any) -> dict[str, Any]:
    """The schema of an entry naming ``component``, ``layers`` and ``positions`` (``defaults``:
    those that have one), with ``extra`` fields."""
    sites = {name: {"$ref": f"#/$defs/{name}"} for name in ("component", "layers", "positions")}
    for name, default in defaults.items():
        sites[name]["default"] = default
    return {"additionalProperties": False, "required": required,
            "properties": {"type": True, **sites, **extra}}


class CleanRestore(_Overwrite):
    """Overwrite with clean-run states at per-row positions (see module docstring)."""

    registered_name = "clean_restore"

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return _site_schema(["positions"], {"component": "block_output"})

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        return ctx.component_sites(entry, index, default_component="block_output",
                                   default_positions=None, donor="clean")


class WindowRestore(_Overwrite):
    """One layer (``window_layer``) of a sublayer-window restore; ``sublayer`` is ``"mlp"`` or
    ``"attn"``, and ``center``/``window`` record the window the layer belongs to."""

    registered_name = "window_restore"
    _config_defaults = {"sublayer": None, "window_layer": None, "center": None, "window": None}

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return {"additionalProperties": False,
                "required": ["sublayer", "center", "window", "positions"],
                "properties": {"type": True, "sublayer": {"enum": ["mlp", "attn"]},
                               "center": {"type": "integer"},
                               "window": {"type": "integer", "minimum": 1},
                               "positions": {"$ref": "#/$defs/positions"}}}

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        center = ctx.layers(entry["center"], ctx.path(index, "center"))[0]
        positions = ctx.positions(entry["positions"], ctx.path(index, "positions"))
        component = f"{entry['sublayer']}_output"
        return [Site(index, ctx.adapter.site(component, layer), layer, positions, "clean",
                     ctx.path(index, "sublayer"))
                for layer in window_layers(center, entry["window"], ctx.n_layers)]

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return cls(positions=site.positions, states=states, sublayer=entry["sublayer"],
                   window_layer=site.layer, center=entry["center"], window=entry["window"])

    def to_spec(self, site: Site) -> dict[str, Any]:
        """The whole window's entry (it rebuilds this layer and its window's others)."""
        return {"type": self.registered_name, "sublayer": self._config["sublayer"],
                "center": self._config["center"], "window": self._config["window"],
                "positions": "all" if site.positions is None else list(site.positions)}


class Freeze(_Overwrite):
    """Hold a component at the values it had in another run (``run`` names it)."""

    registered_name = "freeze"
    _config_defaults = {"run": "corrupted"}

    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        return _site_schema(["component"], {"layers": "all", "positions": "all"},
                            run={"enum": ["corrupted", "clean"], "default": "corrupted"})

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        return ctx.component_sites(entry, index, default_layers="all",
                                   donor=entry.get("run", "corrupted"))

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext, states=None):
        return cls(positions=site.positions, states=states, run=site.donor)
