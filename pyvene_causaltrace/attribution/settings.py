"""How :func:`~.attribute.attribute` builds a graph, as one typed, frozen object.

    from pyvene_causaltrace.attribution import AttributionSettings, attribute
    settings = AttributionSettings(max_feature_nodes=2000, memory_mb=8192)
    graph = attribute(model, tokenizer, transcoder, prompt, " Paris", settings=settings)

:class:`AttributionSettings` holds every setting of ``attribute()`` that is not an input (the
prompt and answer) or a choice about this call's files and display (``checkpoint``,
``keep_checkpoint``, ``progress``). Its fields' defaults are those of ``attribute()``'s keywords,
the ``attribute`` command's flags, attribution specs and
:class:`~..dataset.graphs.GraphSettings`: all of them read the values from
:mod:`pyvene_causaltrace.defaults` (where the command line's parser reads them without importing
torch), and none writes the value again.
:meth:`AttributionSettings.check` refuses what ``attribute()`` would refuse, before anything is
loaded or run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._settings import merge_settings
from ..arguments import check_fields
from ..defaults import (
    BOS,
    GRAPH_BOS_ERRORS,
    GRAPH_CHECK_CLOSURE,
    GRAPH_FREEZE,
    GRAPH_K,
    GRAPH_LOOP,
    GRAPH_MEMORY_MB,
    GRAPH_TARGET,
    GRAPH_UPDATE_INTERVAL,
)
from ..errors import InputError
from ..finite import positive_number
from ..prompts import check_bos_mode
from .replacement_model import BOS_ERRORS
from .targets import TARGET_KINDS, Target

__all__ = ["AttributionSettings", "settings_from"]


def _count(value: object, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class AttributionSettings:
    """The settings of one attribution graph (module docstring); ``attribute(...,
    settings=AttributionSettings(...))`` or the same names as keywords.

    What the graph explains: ``target`` is a kind (:data:`~.targets.TARGET_KINDS`:
    ``"demeaned"``, the answer's logit minus the mean of the top-``k`` logits;
    ``"demeaned_vocab"``, minus the vocabulary mean; ``"difference"``, the answer's minus
    ``other``'s), a direction ``[d_model]`` or a :func:`~.targets.direction_target`.

    Without an answer, circuit-tracer's salient logits: at most ``max_n_logits`` tokens, until
    their probabilities reach ``desired_logit_prob`` (``None``:
    :data:`~pyvene_causaltrace.defaults.GRAPH_MAX_N_LOGITS` and
    :data:`~pyvene_causaltrace.defaults.GRAPH_DESIRED_LOGIT_PROB`; either given with an
    answer, a difference or a direction is refused).

    Position 0: ``bos`` (:data:`~..prompts.BOS_MODES`) says whether it is BOS; ``bos_errors``
    keeps its errors as nodes (``"keep"``) or makes them constants (``"drop"``, only where it
    is BOS).

    Budget: ``max_feature_nodes`` feature rows at most (``None``: every feature whose row fits
    ``memory_mb``), ``memory_mb`` caps the forward graph, the gradient rows and the stored
    rows; ``batch_size`` fixes the rows per backward (``None``: as many as fit, at most
    ``max_batch``, ``None``: the device's :data:`~.budget.DEFAULT_MAX_BATCH`);
    ``update_interval`` batches between two rankings by partial influence.

    Computation: ``freeze`` the attention patterns and norm scales (the local replacement
    model), ``loop`` one backward per node (the reference) instead of batches,
    ``check_closure`` refuse a row that does not close."""

    target: str | Target | torch.Tensor = GRAPH_TARGET
    other: str | None = None
    k: int = GRAPH_K

    max_n_logits: int | None = None
    desired_logit_prob: float | None = None

    bos: str = BOS
    bos_errors: str = GRAPH_BOS_ERRORS

    max_feature_nodes: int | None = None
    memory_mb: float = GRAPH_MEMORY_MB
    batch_size: int | None = None
    max_batch: int | None = None
    update_interval: int = GRAPH_UPDATE_INTERVAL

    freeze: bool = GRAPH_FREEZE
    loop: bool = GRAPH_LOOP
    check_closure: bool = GRAPH_CHECK_CLOSURE

    def __post_init__(self) -> None:
        check_fields(self)  # types here; ranges and combinations in check()

    def check(self, answer: object = None) -> AttributionSettings:
        """Raise :class:`~..errors.InputError` for a setting :func:`~.attribute.attribute`
        would refuse with this ``answer``, before anything is loaded or run; returns ``self``.

        Refused: an ``answer`` or ``other`` that is not a string, a target kind it does not
        know, ``other`` missing for (or given without) ``target="difference"``,
        ``max_n_logits`` or ``desired_logit_prob`` given where no salient logits are chosen
        (with an answer, a difference or a direction they would be ignored), a count below its
        minimum, a probability outside (0, 1], a memory cap that is not a finite positive
        number, a ``bos_errors`` other than ``"keep"``/``"drop"``, a ``bos`` outside
        :data:`~..prompts.BOS_MODES`."""
        target, other = self.target, self.other
        max_n_logits, desired_logit_prob = self.max_n_logits, self.desired_logit_prob
        for name, value in (("answer", answer), ("other", other)):
            if value is not None and not isinstance(value, str):
                raise InputError(f"{name} must be a string (the text of one token) or None, "
                                 f"got {type(value).__name__} {value!r}")
        if max_n_logits is not None:
            _count(max_n_logits, "max_n_logits (--max-n-logits)", 1)
        if desired_logit_prob is not None and (
                isinstance(desired_logit_prob, bool)
                or not isinstance(desired_logit_prob, int | float)
                or not 0 < desired_logit_prob <= 1):
            raise InputError(f"desired_logit_prob (--desired-logit-prob) must be in (0, 1], "
                             f"got {desired_logit_prob!r}")
        if self.bos_errors not in BOS_ERRORS:
            raise InputError(f"bos_errors must be one of {', '.join(BOS_ERRORS)}, got "
                             f"{self.bos_errors!r}")
        check_bos_mode(self.bos)
        direction = isinstance(target, torch.Tensor | Target)
        chooser = [name for name, value in (("max_n_logits (--max-n-logits)", max_n_logits),
                                            ("desired_logit_prob (--desired-logit-prob)",
                                             desired_logit_prob)) if value is not None]
        if chooser and (direction or answer is not None or target == "difference"):
            why = ("a direction target (target=, --direction)" if direction else
                   "one answer's logit (answer=, --answer)" if answer is not None else
                   "a logit difference (target='difference')")
            raise InputError(f"{' and '.join(chooser)} choose the salient logits of a graph "
                             f"without an answer; this graph explains {why}, so they would be "
                             "ignored: drop them, or drop the answer")
        if direction:
            if other is not None:
                raise InputError("other= is only read by target='difference'")
            target = GRAPH_TARGET  # a direction: the remaining checks are the counts
        if target not in TARGET_KINDS:
            raise InputError(f"target must be one of {', '.join(TARGET_KINDS)}, a direction "
                             f"(a tensor [d_model]) or a Target, got {target!r}")
        if target == "difference" and not other:
            raise InputError("a logit-difference target needs the other token (other=..., "
                             "--other)")
        if target != "difference" and other is not None:
            raise InputError(f"other={other!r} is only read by target='difference' (--target "
                             f"difference); the target is {target!r}")
        _count(self.k, "k", 1)
        if self.max_feature_nodes is not None:
            _count(self.max_feature_nodes, "max_feature_nodes", 0)
        positive_number(self.memory_mb, "memory_mb")
        for name, value in (("batch_size", self.batch_size), ("max_batch", self.max_batch)):
            if value is not None:
                _count(value, name, 1)
        _count(self.update_interval, "update_interval", 1)
        return self


def settings_from(settings: AttributionSettings | None, **keywords: object) -> AttributionSettings:
    """The settings of a call given ``settings`` and its keywords (one per field): without
    ``settings``, the keywords; with it, ``settings`` — a keyword left at its default defers
    to it, and one set to another value than ``settings``' is refused
    (:class:`~..errors.InputError` naming every such keyword)."""
    return merge_settings(AttributionSettings, settings, keywords)
