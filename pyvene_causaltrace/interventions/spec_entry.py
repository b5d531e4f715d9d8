"""How a registered type lives in a JSON spec: its entry's schema, where it acts, how it is built.

Every registered type answers three questions (the :class:`SpecEntry` protocol), asked by
:mod:`pyvene_causaltrace.execute` (which runs specs) and
:func:`pyvene_causaltrace.specs.validate_spec` — neither knows any type by name:

- ``spec_schema()``: the JSON Schema of the entry's fields (``$ref``\\ s may point at the shared
  ``#/$defs`` of ``spec.schema.json``: ``positions``, ``layers``, ``component``, ``seeds``);
- ``spec_sites(entry, index, ctx)``: the :class:`Site`\\ s the entry acts at — a pyvene
  component, its layer and positions, and whose states (``clean`` or ``corrupted`` run) it needs;
- ``from_spec(entry, site, ctx, states)``: the intervention instance at one site; ``to_spec(site)``
  on an instance writes back the single-site entry that rebuilds it.

:class:`~.base.CausalTraceIntervention` gives every subclass the *generic shape* — ``component``
(a site name such as ``"mlp_output"`` or a raw module path), ``layers``, ``positions``, and any
other field passed to the constructor as a keyword — so a third-party type needs nothing more
than registering; a plain ``pyvene.Intervention`` subclass gets it through :func:`entry_of`
(docs/plugins.md, "A plain pyvene type"). Class attributes add cross-entry rules:
``spec_refusal`` (a spec cannot hold the type, and why), ``spec_unique`` (at most one entry),
``spec_requires`` (another type that must be present), ``spec_corrupts`` (the entry makes the
corrupted run: the noise).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..bound import BoundModel
from ..errors import SpecError
from ..locations import component_layers, component_path, resolve_layers, resolve_positions
from ..models import ArchAdapter
from ..prompts import TokenizedPrompt
from ..pyvene_boundary.quiet_import import import_pyvene
from ..pyvene_boundary.user_edits import NOISE_INTERVENTION_REFUSAL

#: The fields of the generic shape and the site they name.
SITE_FIELDS = ("component", "layers", "positions")


def generic_schema() -> dict[str, Any]:
    """The generic entry: a component, its layers and positions, and any other field, passed
    to the constructor."""
    return {"description": "A registered type: built once per layer of its component, with its "
                           "other fields as keyword arguments.",
            "required": ["component"],
            "properties": {"type": True, "component": {"$ref": "#/$defs/component"},
                           "layers": {"$ref": "#/$defs/layers"},
                           "positions": {"$ref": "#/$defs/positions", "default": "all"}},
            "additionalProperties": True}


@dataclass(frozen=True)
class Site:
    """One place an entry acts: ``component`` (a pyvene component string) at ``layer`` (None
    for a component without layers), ``positions`` (None: every position), ``donor`` (the run
    whose states of ``component`` the intervention holds: ``"clean"``, ``"corrupted"`` or None).
    ``where`` is the JSON path of the entry field that named the component; ``made`` an
    instance built while resolving (an entry whose sites share one object, e.g. a splice)."""

    index: int
    component: str
    layer: int | None = None
    positions: list[int] | None = None
    donor: str | None = None
    where: str = ""
    made: Any = None
    settings: dict[str, Any] = field(default_factory=dict)


class SpecItem(Protocol):
    """One entry as a spec holds it (an :class:`~pyvene_causaltrace.specs.InterventionSpec`)."""

    @property
    def type(self) -> str: ...

    @property
    def fields(self) -> dict[str, Any]: ...


class SpecView(Protocol):
    """What an entry may read of the whole spec (an
    :class:`~pyvene_causaltrace.specs.ExperimentSpec`, which sits above this module)."""

    @property
    def subject(self) -> str | None: ...

    @property
    def interventions(self) -> Sequence[SpecItem]: ...


@dataclass
class SpecContext:
    """What an entry is resolved against: the spec, the bound model (its module and adapter as
    ``model`` and ``adapter``), the tokenized prompt; ``cache`` holds what entries compute once
    per resolution and share (the clean run's transcoder errors, its attention patterns)."""

    spec: SpecView
    bound: BoundModel
    tokenizer: Any
    prompt: TokenizedPrompt
    cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        return self.bound.model

    @property
    def adapter(self) -> ArchAdapter:
        return self.bound.adapter

    @property
    def n_layers(self) -> int:
        return self.bound.n_layers

    @staticmethod
    def path(index: int, name: str | None = None) -> str:
        return f"$.interventions[{index}]" + (f".{name}" if name else "")

    def positions(self, value: Any, path: str) -> list[int]:
        return resolve_positions(value, self.prompt, path)

    def layers(self, value: Any, path: str) -> list[int]:
        return resolve_layers(value, self.n_layers, path)

    def component_sites(self, entry: dict, index: int, *, default_component: str | None = None,
                        default_layers: Any = None, default_positions: Any = "all",
                        donor: str | None = None) -> list[Site]:
        """The generic shape's sites: ``component`` at each of ``layers``, at ``positions``."""
        component = entry.get("component", default_component)
        positions = self.positions(entry.get("positions", default_positions),
                                   self.path(index, "positions"))
        layers = component_layers(component, entry.get("layers"), self.n_layers,
                                  self.path(index), self.adapter, default=default_layers)
        return [Site(index, component_path(component, layer, self.adapter), layer, positions,
                     donor, self.path(index, "component")) for layer in layers]


class SpecEntry(Protocol):
    """What a registered type provides to live in a spec (see the module docstring): a class of
    ours answers with its class attributes and classmethods, :func:`entry_of` wraps any other."""

    spec_refusal: str | None
    spec_unique: bool
    spec_requires: tuple[str, ...]
    spec_corrupts: bool

    def spec_schema(self) -> dict[str, Any]: ...

    def check_spec(self, entry: dict, spec: dict, path: str) -> None: ...

    def spec_sites(self, entry: dict, index: int, ctx: SpecContext) -> list[Site]: ...

    def from_spec(self, entry: dict, site: Site, ctx: SpecContext,
                  states: torch.Tensor | None = None) -> Any: ...


def extra_fields(entry: dict) -> dict[str, Any]:
    """An entry's fields other than ``type`` and the generic site fields."""
    return {k: v for k, v in entry.items() if k != "type" and k not in SITE_FIELDS}


def _plain_refusal(cls: type) -> str | None:
    """Why a spec cannot hold plain pyvene type ``cls``, or None: pyvene's own types that take
    their values from a source at call time (a spec has no source run), and pyvene's
    ``NoiseIntervention`` (a fixed 4-position draw)."""
    pv = import_pyvene()
    name = cls.__name__
    if issubclass(cls, pv.NoiseIntervention):
        return NOISE_INTERVENTION_REFUSAL.format(where="a spec")
    sourceless = issubclass(cls, (pv.ConstantSourceIntervention, pv.SourcelessIntervention))
    if not sourceless and getattr(cls.forward, "__module__", "").startswith("pyvene."):
        return (f"{name} takes its values from a source run at call time (pyvene's "
                f"{cls.forward.__qualname__.split('.')[0]}.forward), and a spec has no source "
                "run: use clean_restore or freeze for the clean or corrupted run's states, or "
                "add it yourself to the config of build_interventions / to_pv_config and call "
                "the IntervenableModel with sources")
    return None


@functools.cache
def _called_without_source(cls: type) -> type:
    """``cls`` whose ``forward``, called without a source, turns a failure that a missing
    source explains (``TypeError``, ``AttributeError``) into a :class:`SpecError` naming the
    entry. Keeps ``cls``'s name and module, so pyvene's save/load see ``cls``."""
    class WithoutSource(cls):
        def forward(self, base, source=None, *args, **kwargs):
            try:
                return super().forward(base, source, *args, **kwargs)
            except (TypeError, AttributeError) as error:
                if source is not None:
                    raise
                where = getattr(self, "_pvct_spec_entry", ("$.interventions", cls.__name__))
                raise SpecError(where[0], (
                    f"{where[1]} ({cls.__qualname__}) failed when called without a source "
                    f"({type(error).__name__}: {error}). In a spec a plain pyvene type is "
                    "called with source=None on its component's whole [batch, seq, hidden] "
                    "output: compute the edit from base alone (and subclass "
                    "pv.SourcelessIntervention), or take states from a run with "
                    "clean_restore / freeze")) from error

    WithoutSource.__name__, WithoutSource.__qualname__ = cls.__name__, cls.__qualname__
    WithoutSource.__module__ = cls.__module__
    return WithoutSource


class _PlainPyveneEntry:
    """The generic shape for a registered ``pyvene.Intervention`` that is not one of ours: built
    from the entry's fields, it acts at every position of its component."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.spec_refusal = getattr(cls, "spec_refusal", None) or _plain_refusal(cls)
        self.spec_unique = getattr(cls, "spec_unique", False)
        self.spec_requires = getattr(cls, "spec_requires", ())
        self.spec_corrupts = getattr(cls, "spec_corrupts", False)

    def spec_schema(self) -> dict[str, Any]:
        schema = generic_schema()
        schema["properties"]["positions"] = {
            "const": "all", "description": "a plain pyvene type acts at every position"}
        return schema

    def check_spec(self, entry: dict, spec: dict, path: str) -> None:
        return None

    def spec_sites(self, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        return ctx.component_sites(entry, index, default_positions="all")

    def from_spec(self, entry: dict, site: Site, ctx: SpecContext,
                  states: torch.Tensor | None = None) -> Any:
        """The instance, set to see what a spec gives it: the whole ``[batch, seq, hidden]``
        output (pyvene would otherwise flatten a type that is not Localist to ``[batch,
        seq * hidden]``) and ``source=None`` (pyvene skips a type that wants a source when it
        has none, silently: it is marked source-constant, and a failure without a source names
        the entry)."""
        made = self.cls(**extra_fields(entry))
        made.keep_last_dim = True  # read by pyvene's do_intervention at each call
        if not made.is_source_constant:
            made.__class__ = _called_without_source(type(made))
            made.is_source_constant = True
            made._pvct_spec_entry = (ctx.path(site.index, "type"), entry["type"])
        return made


def entry_of(cls: type) -> SpecEntry:
    """The object answering the spec questions for registered class ``cls``: the class itself
    when it has them (ours and their subclasses), else the generic shape around it."""
    return cls if hasattr(cls, "spec_sites") else _PlainPyveneEntry(cls)
