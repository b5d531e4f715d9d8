"""What the interventions of one transcoder splice share: the per-forward :class:`SpliceSession`,
which also holds the transcoder read by path (once per session).

    session = SpliceSession()          # or splice_session(reps) for a splice's own
    session.acts[layer]                # features after any feature_ablate, [B, P, F]
    session.encoded[layer]             # the same, as the encoder computed them

``clt_splice`` and ``feature_ablate`` derive from :class:`SpliceIntervention`: a transcoder held
by reference or by path (``source``), and a session held by reference whose id is also in the
configuration (so in the state dict). Interventions built one by one — by pyvene from a class
(``CLTSplice.configured(...)``, ``add_intervention``) or by ``pv.IntervenableModel.load`` — hold
only that id; :func:`bind_sessions` gives each group with one id one session object. Our
``IntervenableModel`` binds when built (and loaded), our runs before they apply a user's
``pv.IntervenableModel``; inside a plain ``pv.IntervenableModel``'s call such an intervention
cannot find its siblings and is refused. No table of sessions lives in this module.

A deep copy of a session (pyvene's ``save`` deep-copies its configuration) is a new, empty
session with the same id and ``selection``: the copies of one splice share it, none aliases the
caller's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError, SpecError
from ..pyvene_boundary.calls import announced_call, pyvene_call
from ..transcoders.formats import load_transcoder
from .base import CausalTraceIntervention


@dataclass(eq=False)
class SpliceSession:
    """What one splice's interventions share during a forward (the first encoder of a forward
    clears it): per layer the features (``acts``, after any ``feature_ablate``; ``encoded``, as
    the encoder computed them — the same tensor when nothing changed them) and the transcoder's
    inputs; in leaf mode ``leaves`` — ``features`` (:class:`~.clt_splice.ActiveFeatures`),
    ``writes``, ``errors``, ``inputs`` per layer and the ``b_dec`` leaf.

    Not per forward: ``selection`` (bool ``[L, P, F]`` or ``[L, B, P, F]``), the features a
    ``joint_topk`` transcoder keeps, fixed for the splice's life
    (:func:`~.clt_splice.clean_selection`); ``transcoders``, those its interventions named by
    path, read once (:meth:`transcoder`; a deep copy shares them: they are read-only)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    acts: dict[int, torch.Tensor] = field(default_factory=dict)
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    leaves: dict[str, Any] = field(default_factory=dict)
    selection: torch.Tensor | None = None
    transcoders: dict[str, Any] = field(default_factory=dict)

    def transcoder(self, source: str, load=None):
        """The transcoder (or Lorsa set) at ``source``: read by ``load`` (default
        ``load_transcoder``) the first time this session is asked for it."""
        found = self.transcoders.get(source)
        if found is None:
            found = self.transcoders[source] = (load or load_transcoder)(source)
        return found

    def clear(self) -> None:
        self.acts.clear()
        self.encoded.clear()
        self.inputs.clear()
        self.leaves.clear()

    def __deepcopy__(self, memo) -> SpliceSession:
        # per-forward state is not copied (the first encoder of a forward clears it, and in leaf
        # mode it holds autograd tensors deepcopy refuses); the selection is read-only
        copied = SpliceSession(id=self.id, selection=self.selection,
                               transcoders=dict(self.transcoders))
        memo[id(self)] = copied
        return copied


def bind_sessions(interventions: Iterable[Any]) -> None:
    """Give the splice interventions among ``interventions`` (one ``IntervenableModel``'s) that
    hold no session object one per session id — a sibling's that holds one, else a new one —
    and let each session know the transcoders its interventions hold as objects, by their
    paths (a sibling holding only the path then uses the object instead of reading it again)."""
    splices = [made for made in interventions if isinstance(made, SpliceIntervention)]
    held = {made.session_id: made.__dict__["_session_object"] for made in splices
            if made.__dict__["_session_object"] is not None}
    for made in splices:
        if made.__dict__["_session_object"] is None:
            key = made.session_id
            if key not in held:
                held[key] = SpliceSession() if key is None else SpliceSession(id=key)
            made.__dict__["_session_object"] = held[key]
            made._config["session"] = held[key].id
        clt = made.__dict__["_clt_object"]
        if clt is not None and clt.source is not None:
            made.__dict__["_session_object"].transcoders.setdefault(clt.source, clt)


class SpliceIntervention(CausalTraceIntervention):
    """Base of the splice's types: a transcoder (object or path) and a shared session."""

    #: What a subclass splices (for the refusal without one) and reads it from a path with
    #: (None: ``load_transcoder``).
    _holds, _load = "a transcoder", None

    def __init__(self, clt=None, session: SpliceSession | None = None, **kwargs: Any) -> None:
        # plain references, not submodules: they must not enter pyvene's state dicts
        self.__dict__["_clt_object"] = clt
        self.__dict__["_session_object"] = session
        super().__init__(**kwargs)

    @property
    def clt(self):
        """The transcoder object given, else the one at the configured path, read through the
        session (once for the siblings sharing it)."""
        if self._clt_object is not None:
            return self._clt_object
        source = self._config.get("source")
        if source is None:
            raise InputError(f"{self.registered_name} needs {self._holds} (an object, or the path "
                             "it was loaded from)")
        return self.session.transcoder(source, self._load)

    #: What an ``IntervenableModel`` of ours, or our runs applying a user's, call with all its
    #: interventions.
    bind_shared = staticmethod(bind_sessions)

    def _whole_sequence(self, seq_len: int) -> None:
        """Refuse a ``generate`` forward that is not the whole sequence: a splice rewrites every
        position from ``from_position`` on, indexed from the sequence's start, so only
        ``generate(..., intervene_on_prompt=True, use_cache=False)`` hands it what it needs. A
        cached step holds the newest token alone, read as position 0 (left unspliced); pyvene's
        default (``intervene_on_prompt=False``) puts unit location 0 on each step, so nothing
        past position 0 was spliced either."""
        call = pyvene_call()
        if call is None or not call.generating:
            return
        how = ("generate with intervene_on_prompt=True and use_cache=False: each step is then "
               "the whole sequence, spliced as a forward of it is")
        if call.unit_locations is not None:
            raise InputError(f"{self.registered_name} splices whole sequences, but pyvene is "
                             f"generating with unit_locations on each new token: {how}")
        round_, seen = getattr(self, "_generation_seen", (None, 0))
        if round_ is call.generation_round and seq_len <= seen:
            raise InputError(f"{self.registered_name} is handed {seq_len} position(s) after a "
                             f"forward of {seen} in this generate call (a cached step: the KV "
                             f"cache holds the rest): {how}")
        self._generation_seen = (call.generation_round, seq_len)

    @property
    def session_id(self) -> str | None:
        """The id in this intervention's configuration (its session's)."""
        return self._config.get("session")

    @property
    def session(self) -> SpliceSession:
        """The splice's shared state: the object given, or bound among the siblings when our
        ``IntervenableModel`` (or our runs) took them (:func:`bind_sessions`), else one of its
        own in an announced call; refused in pyvene's own class (and in a direct call)."""
        if self.__dict__["_session_object"] is None:
            announced_call(self.registered_name, "holds only its splice's session id and must "
                           "find its siblings through its model")
            bind_sessions([self])
        return self.__dict__["_session_object"]

    def _session_id(self, session_id: str | None, source: str | None) -> str:
        """The id of the session given to the constructor, else the saved one, else the
        transcoder's default id (interventions built one by one into one model share it)."""
        given = self.__dict__.get("_session_object")
        if given is not None:
            return given.id
        if session_id is not None:
            return session_id
        return f"default:{source if source is not None else id(self._clt_object)}"

    def _source_of(self) -> str | None:
        return self._clt_object.source if self._clt_object is not None else None

    @staticmethod
    def _check_roles(role: str, from_position: int, error: torch.Tensor | None,
                     add_error: bool, error_from: str | None) -> None:
        """The settings every splice's ``_setup`` checks alike."""
        if role not in ("encode", "decode"):
            raise InputError(f"role must be 'encode' or 'decode', got {role!r}")
        if from_position < 0:
            raise InputError(f"from_position must be >= 0, got {from_position}")
        if error is not None and (add_error or role != "decode"):
            raise InputError("a fixed error goes on a decoder, instead of add_error")
        if error_from not in (None, "clean"):
            raise InputError(f"error_from must be None or 'clean', got {error_from!r}")

    @classmethod
    def check_spec(cls, entry: dict, spec: dict, path: str) -> None:
        if "error" in entry and entry.get("add_error"):
            raise SpecError(f"{path}.error", "add_error makes the forward the original one "
                                             "whatever the features; error replaces it: give "
                                             "one of them")
