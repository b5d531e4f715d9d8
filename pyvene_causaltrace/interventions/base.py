"""The shared base of our pyvene interventions (placing them: docs/interventions.md).

Positions, two ways. With its own ``positions`` (a list, a list per row, or a ``[rows, seq]``
mask) a type acts on those positions of the component's whole ``[batch, seq, hidden]`` output
(``unit_locations=None``): how per-row masks and seeds work, which pyvene's ``unit_locations``
cannot express (they cannot skip a row and turn sticky once given an int); it needs our
``IntervenableModel``. Without ``positions`` pyvene's ``unit_locations`` choose, as for its
built-ins. pyvene can build every type from the class (``intervention_type=NoiseAdd``: the
defaults; ``NoiseAdd.configured(seeds=[0], sigma=0.1)``: a class with those settings).

State is a few JSON scalars (:meth:`config`) plus tensor buffers, both in ``state_dict()``, so
``pv.IntervenableModel.save`` / ``load`` round-trips them: the class inherits
``SourcelessIntervention`` (pyvene's load then skips its broken constant-source branch) and
``TrainableIntervention`` (pyvene then saves the state dict and loads it back). None of our
types has trainable parameters.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..errors import InputError
from ..pyvene_boundary.calls import announced_call
from ..pyvene_boundary.quiet_import import import_pyvene
from .spec_entry import Site, SpecContext, extra_fields, generic_schema

pv = import_pyvene()

_CONFIG_KEY = "pvct_config"

# Keyword arguments pyvene passes to every intervention constructor (RepresentationConfig fields
# and the two it adds). We accept and ignore them apart from what pv.Intervention reads.
_PYVENE_KWARGS = frozenset(
    "layer component unit max_number_of_units low_rank_dimension intervention_type intervention "
    "subspace_partition group_key intervention_link_key moe_key source_representation "
    "hidden_source_representation latent_dim embed_dim use_fast keep_last_dim".split()
)


class CausalTraceIntervention(pv.SourcelessIntervention, pv.TrainableIntervention):
    """Base class: JSON config + tensor buffers that survive pyvene's save/load. Subclasses set
    ``registered_name``, list their tensor buffers in ``tensor_fields``, implement :meth:`_setup`
    (called with the config and tensors, at construction and after loading) and
    ``forward(base, source=None, subspaces=None, **kwargs)``."""

    registered_name: ClassVar[str] = ""
    tensor_fields: ClassVar[tuple[str, ...]] = ()

    # -- the spec entry (see spec_entry.py): the generic shape unless a subclass says more
    spec_refusal: ClassVar[str | None] = None
    spec_unique: ClassVar[bool] = False
    spec_requires: ClassVar[tuple[str, ...]] = ()
    spec_corrupts: ClassVar[bool] = False

    #: Whether ``forward`` honours pyvene's ``subspaces`` and head units (a ``[batch, heads,
    #: seq, d_head]`` input); a type that does not refuses them instead of ignoring them.
    handles_units: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__ and not cls.handles_units:
            cls.forward = _whole_states_only(cls.__dict__["forward"])

    def __init__(self, **kwargs: Any) -> None:
        pyvene_kwargs = {k: v for k, v in kwargs.items() if k in _PYVENE_KWARGS}
        own = {k: v for k, v in kwargs.items() if k not in _PYVENE_KWARGS and v is not None}
        super().__init__(**{k: v for k, v in pyvene_kwargs.items() if k != "source_representation"})
        self.trainable = False
        self.is_source_constant = True
        self.keep_last_dim = True  # pyvene would otherwise flatten [b, s, d] to [b, s*d]
        self._config: dict[str, Any] = {}
        if own or self._has_bare_defaults():
            self._setup(**own)

    @classmethod
    def _has_bare_defaults(cls) -> bool:
        """Whether an instance built bare (only pyvene's keyword arguments) sets itself up with
        defaults: when every argument of ``_setup`` has one. A type that needs settings (a
        splice needs its transcoder) is set up by pyvene's load, or built ``configured``."""
        return all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                   for p in inspect.signature(cls._setup).parameters.values()
                   if p.name != "self")

    @classmethod
    def configured(cls, **settings: Any) -> type:
        """This class with ``settings`` as its constructor's defaults: what pyvene builds from
        a class (``intervention_type=NoiseAdd.configured(seeds=[0, 1], sigma=0.1)``).

        It keeps the class's name and module, so a saved model loads back as the plain class
        (the settings travel in the state dict)."""
        def __init__(self, **kwargs: Any) -> None:
            cls.__init__(self, **{**settings, **kwargs})

        return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__,
                                           "settings": dict(settings)})

    # -- spec entry: the generic shape ----------------------------------------------------
    @classmethod
    def spec_schema(cls) -> dict[str, Any]:
        """JSON Schema of this type's spec entry (see :mod:`.spec_entry`)."""
        return generic_schema()

    @classmethod
    def check_spec(cls, entry: dict, spec: dict, path: str) -> None:
        """Rules across fields of the whole spec that the schema cannot say (raise SpecError)."""

    @classmethod
    def spec_sites(cls, entry: dict, index: int, ctx: SpecContext) -> list[Site]:
        """Where an entry acts: its component at each of its layers, at its positions."""
        return ctx.component_sites(entry, index)

    @classmethod
    def from_spec(cls, entry: dict, site: Site, ctx: SpecContext,
                  states: torch.Tensor | None = None) -> CausalTraceIntervention:
        """The instance at one site; the entry's other fields are constructor keywords."""
        return cls(positions=site.positions, **extra_fields(entry))

    def to_spec(self, site: Site) -> dict[str, Any]:
        """The single-site entry that rebuilds this instance (``site``: where it acts)."""
        return {"type": self.registered_name, "component": site.component,
                **({"positions": list(site.positions)} if site.positions is not None else {}),
                **self.config()}

    # -- state ---------------------------------------------------------------------------
    def _setup(self, **kwargs: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """The JSON part of this intervention's state."""
        return dict(self._config)

    def _set_tensor(self, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            self._buffers.pop(name, None)
            setattr(self, name, None)
            return
        self.__dict__.pop(name, None)
        self.register_buffer(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401 - torch hook
        super()._save_to_state_dict(destination, prefix, keep_vars)
        payload = json.dumps({"type": self.registered_name, "config": self._config})
        destination[prefix + _CONFIG_KEY] = torch.tensor(list(payload.encode()), dtype=torch.uint8)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + _CONFIG_KEY
        if key not in state_dict:
            error_msgs.append(f"{type(self).__name__}: state dict has no {key!r}")
            return
        payload = json.loads(bytes(state_dict[key].tolist()).decode())
        if payload["type"] != self.registered_name:
            error_msgs.append(f"state dict holds a {payload['type']!r} intervention, not "
                              f"{self.registered_name!r}")
            return
        ours = {key} | {prefix + name for name in self.tensor_fields}
        tensors = {name: state_dict[prefix + name] for name in self.tensor_fields
                   if prefix + name in state_dict}
        for name in self.tensor_fields:  # whatever shapes were there are replaced below
            self._set_tensor(name, None)
        rest = {k: v for k, v in state_dict.items() if k not in ours}
        for name in ("embed_dim", "interchange_dim"):
            # pyvene gives these to a type it builds from a layer/component at load time, not
            # to an instance placed in the config: the saved state may lack them
            if name in self._buffers and prefix + name not in rest:
                rest[prefix + name] = self._buffers[name]
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._setup(**payload["config"], **tensors)

    def __str__(self) -> str:
        return f"{type(self).__name__}({self._config})"

    # -- where a call acts ---------------------------------------------------------------
    def _placement(self, seq_len: int, offset: int = 0) -> tuple[int, bool]:
        """``(offset, generating)``: the absolute position of the handed sequence's first
        position, and whether pyvene is generating (a step may see fewer positions than the
        prompt had). A call with both ``positions`` and ``unit_locations``, or not announced,
        is refused rather than guessed at. Inside ``generate(intervene_on_prompt=True)``
        positions are the prompt's: the first forward is the prompt (offset 0), each later one
        holds the newest tokens, its offset following from the prompt's length and the step."""
        if self.positions is None:
            return offset, False
        call = announced_call(self.registered_name, "has its own positions (built without them, "
                              "pyvene's unit_locations choose) and must know this call's "
                              "unit_locations and whether pyvene is generating")
        if call.unit_locations is not None:
            if call.generating:
                raise InputError(
                    f"{self.registered_name} has its own positions (the prompt's), but pyvene "
                    "is generating with unit_locations (its default intervene_on_prompt=False "
                    "puts them on each generated token): call generate(..., "
                    "intervene_on_prompt=True) and leave unit_locations out")
            raise InputError(
                f"{self.registered_name} was given both its own positions and pyvene "
                "unit_locations for this call, two meanings of 'where': build it without "
                "positions to let unit_locations choose, or pass unit_locations=None (or None "
                "in its slot) to act on its positions of the whole output")
        if not call.generating:
            return offset, False
        round_ = call.generation_round
        state = getattr(self, "_generation", None)
        if state is None or state[0] is not round_:
            self._generation = (round_, seq_len, 0)
            return offset, True
        _, prompt_len, step = state
        step += 1
        self._generation = (round_, prompt_len, step)
        return prompt_len + step - seq_len, True


# ------------------------------------------------------------------------- shared helpers


def _whole_states_only(forward):
    """``forward`` behind a check that pyvene handed whole ``[batch, seq, hidden]`` states with
    no ``subspaces``: what a type without ``handles_units`` needs."""

    @functools.wraps(forward)
    def checked(self, base: torch.Tensor, source=None, subspaces=None, **kwargs):
        if subspaces is not None:
            raise InputError(f"{self.registered_name} acts on whole states: pyvene's subspaces "
                             "are not supported for it")
        if base.dim() != 3:
            raise InputError(f"{self.registered_name} needs [batch, seq, hidden] states; pyvene "
                             f"handed {tuple(base.shape)} (head units are not supported for it)")
        return forward(self, base, source, subspaces, **kwargs)

    return checked


def as_positions_last(base: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor],
                                                                          torch.Tensor]]:
    """``base`` as ``[batch, seq, hidden]`` and the inverse map: pyvene hands head units as
    ``[batch, heads, seq, d_head]``, which is ``[batch, seq, heads * d_head]`` head by head."""
    if base.dim() == 3:
        return base, lambda x: x
    if base.dim() != 4:
        raise InputError(f"expected [batch, seq, hidden] or [batch, heads, seq, d_head] states, "
                         f"got {tuple(base.shape)}")
    batch, heads, seq_len, d_head = base.shape
    flat = base.transpose(1, 2).reshape(batch, seq_len, heads * d_head)
    return flat, lambda x: x.reshape(batch, seq_len, heads, d_head).transpose(1, 2)


def subspace_mask(subspaces: Any, base: torch.Tensor,
                  partition: list[list[int]] | None = None) -> torch.Tensor | None:
    """pyvene's ``subspaces`` for one intervention — a list of dimensions for every row, one
    list per row, or indices into ``subspace_partition`` — as a bool mask of ``base``'s last
    dimension, ``[batch, 1, ..., width]`` on its device; None stays None (every dimension)."""
    if subspaces is None:
        return None
    batch, width = base.shape[0], base.shape[-1]
    rows = subspaces.tolist() if isinstance(subspaces, torch.Tensor) else list(subspaces)
    if not rows or isinstance(rows[0], int):
        rows = [rows]
    rows_for(batch, len(rows), "subspaces")
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        columns = [c for part in row for c in partition[part]] if partition else list(row)
        if any(not 0 <= int(c) < width for c in columns):
            raise InputError(f"subspace dimensions {columns} are outside 0..{width - 1}")
        mask[r, [int(c) for c in columns]] = True
    return mask.expand(batch, width).to(base.device).reshape(batch, *(1,) * (base.dim() - 2), -1)


def rows_for(batch: int, rows: int, what: str) -> None:
    """Check that ``rows`` per-row settings fit a batch of ``batch`` (1 broadcasts)."""
    if rows not in (1, batch):
        raise InputError(f"{what} has {rows} rows but the batch has {batch}; give 1 or {batch}")


def positions_to_mask(
    positions: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | None,
    seq_len: int | None = None,
) -> torch.Tensor | None:
    """A ``[rows, seq]`` bool mask from a bool mask, one position list, or one list per row;
    None stays None (every position).

    Negative positions count from the end and need ``seq_len``.
    """
    if positions is None:
        return None
    if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
        return positions.unsqueeze(0) if positions.dim() == 1 else positions
    if isinstance(positions, torch.Tensor):
        positions = positions.tolist()
    rows = [list(positions)] if not positions or isinstance(positions[0], int) else positions
    rows = [[int(p) for p in row] for row in rows]
    flat = [p for row in rows for p in row]
    if any(p < 0 for p in flat) and seq_len is None:
        raise InputError("negative positions need seq_len")
    width = seq_len if seq_len is not None else (max(flat) + 1 if flat else 1)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        for p in row:
            q = p + width if p < 0 else p
            if not 0 <= q < width:
                raise InputError(f"position {p} is outside a sequence of length {width}")
            mask[r, q] = True
    return mask


def fit_mask(mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor:
    """Broadcast a ``[rows, width]`` mask to ``[batch, seq_len]`` (padding with False); None
    (every position) is all True."""
    if mask is None:
        return torch.ones(batch, seq_len, dtype=torch.bool)
    rows_for(batch, mask.shape[0], "the position mask")
    if mask.shape[1] > seq_len:
        if mask[:, seq_len:].any():
            raise InputError(
                f"positions up to {int(mask.nonzero()[:, 1].max())} requested but the "
                f"sequence has {seq_len} tokens")
        mask = mask[:, :seq_len]
    elif mask.shape[1] < seq_len:
        mask = torch.nn.functional.pad(mask, (0, seq_len - mask.shape[1]))
    return mask.expand(batch, seq_len)
