"""How :func:`~.attribute.attribute` builds a graph (:class:`AttributionSettings`) and how a
graph is read (:class:`ReadingSettings`: pruning and the export's link cap, taken by
``graph.prune()``, ``graph.to_json()``, ``graph.plot()``, ``attention_annotations()``), as
typed, frozen objects checked when made. Inputs (prompt, answer) and this call's files and
display (``checkpoint``, ``keep_checkpoint``, ``progress``) are not settings.
:class:`FaithfulnessSettings`: how :func:`~.faithfulness.faithfulness` measures a curve.
Defaults come from :mod:`pyvene_causaltrace.defaults`, shared with the command line and
specs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .._settings import Settings
from ..arguments import Fraction, MemoryMB, PositiveInt, Probability, Seed
from ..defaults import (
    BOS,
    EDGE_THRESHOLD,
    FAITH_ABLATION,
    FAITH_BATCH,
    FAITH_BUDGETS,
    FAITH_DRAWS,
    FAITH_ERRORS,
    FAITH_LEVEL,
    FAITH_METRIC,
    FAITH_RANK_BY,
    FAITH_SEED,
    FAITH_SIZES,
    GRAPH_BOS_ERRORS,
    GRAPH_CHECK_CLOSURE,
    GRAPH_DESIRED_LOGIT_PROB,
    GRAPH_DETERMINISTIC,
    GRAPH_DTYPE,
    GRAPH_FREEZE,
    GRAPH_K,
    GRAPH_LOOP,
    GRAPH_MAX_N_LOGITS,
    GRAPH_MEMORY_MB,
    GRAPH_TARGET,
    GRAPH_UPDATE_INTERVAL,
    MAX_LINKS,
    NODE_THRESHOLD,
)
from ..errors import InputError
from ..prompts import check_bos_mode
from .precision import dtype_name
from .targets import TARGET_KINDS, Target

__all__ = ["BOS_ERRORS", "AttributionSettings", "FaithfulnessSettings", "ReadingSettings"]

#: How the position-0 errors are treated: ``"keep"`` (nodes) or ``"drop"`` (constants,
#: circuit-tracer's convention: its graphs zero the BOS error vectors).
BOS_ERRORS = ("keep", "drop")


@dataclass(frozen=True)
class AttributionSettings(Settings):
    """The settings of one attribution graph; ``attribute(...,
    settings=AttributionSettings(...))`` or the same names as keywords.

    ``target``: a kind of :data:`~.targets.TARGET_KINDS` (``"demeaned"``: minus the top-``k``
    mean; ``"demeaned_vocab"``; ``"difference"``: minus ``other``'s logit), a ``[d_model]``
    direction or a :func:`~.targets.direction_target`. Without an answer, circuit-tracer's
    salient logits: ``max_n_logits`` (default 10) tokens at most, until their probabilities reach
    ``desired_logit_prob`` (default 0.95) (``None``: those, :meth:`salient`). ``bos``
    (:data:`~..prompts.BOS_MODES`) says whether position 0 is BOS; ``bos_errors`` keeps its
    errors as nodes or (``"drop"``) constants. Budget: ``max_feature_nodes`` feature rows
    (``None``: as many as fit ``memory_mb``, which caps forward graph, gradient rows and stored
    rows); ``batch_size`` fixes the rows per backward (``None``: as many as fit, at most
    ``max_batch`` or :data:`~.budget.DEFAULT_MAX_BATCH`); ``update_interval`` batches between
    rankings. ``freeze`` the attention patterns and norm scales, ``loop`` one backward per node
    (the reference), ``check_closure`` refuse a row that does not close. ``compute_dtype``: the
    replacement forward's and backward's, ``"float32"``, ``"bfloat16"`` (or the torch dtype;
    on a float32 model under autocast, float32 sums where edges and closure need them,
    :mod:`.precision`) or ``None`` (the model's); ``deterministic``: two runs bit-identical
    (torch's deterministic algorithms on for the call,
    :func:`~.precision.deterministic_algorithms`).

    Refused when made (:class:`~..errors.InputError`): a value its annotation does not admit, an
    unknown target kind, ``other`` missing for or given without ``"difference"``, salient-logit
    settings beside a difference or direction, an unknown ``bos_errors`` or ``bos``, a
    ``compute_dtype`` not in :data:`~.precision.DTYPES`."""

    target: str | Target | torch.Tensor = GRAPH_TARGET
    other: str | None = None
    k: PositiveInt = GRAPH_K

    max_n_logits: PositiveInt | None = None
    desired_logit_prob: Probability | None = None

    bos: str = BOS
    bos_errors: str = GRAPH_BOS_ERRORS

    max_feature_nodes: PositiveInt | None = None
    memory_mb: MemoryMB = GRAPH_MEMORY_MB
    batch_size: PositiveInt | None = None
    max_batch: PositiveInt | None = None
    update_interval: PositiveInt = GRAPH_UPDATE_INTERVAL

    freeze: bool = GRAPH_FREEZE
    loop: bool = GRAPH_LOOP
    check_closure: bool = GRAPH_CHECK_CLOSURE
    compute_dtype: str | torch.dtype | None = GRAPH_DTYPE
    deterministic: bool = GRAPH_DETERMINISTIC

    def __post_init__(self) -> None:
        super().__post_init__()
        # a name, as JSON and the flag hold it
        object.__setattr__(self, "compute_dtype", dtype_name(self.compute_dtype))
        if self.bos_errors not in BOS_ERRORS:
            raise InputError(f"bos_errors must be one of {', '.join(BOS_ERRORS)}, got "
                             f"{self.bos_errors!r}")
        check_bos_mode(self.bos)
        target, other = self.target, self.other
        if self.is_direction:
            if other is not None:
                raise InputError("other= is only read by target='difference'")
        elif target not in TARGET_KINDS:
            raise InputError(f"target must be one of {', '.join(TARGET_KINDS)}, a direction "
                             f"(a tensor [d_model]) or a Target, got {target!r}")
        elif target == "difference" and not other:
            raise InputError("a logit-difference target needs the other token (other=..., "
                             "--other)")
        elif target != "difference" and other is not None:
            raise InputError(f"other={other!r} is only read by target='difference' (--target "
                             f"difference); the target is {target!r}")
        if self.is_direction or target == "difference":
            self._refuse_choosers("a direction target (target=, --direction)"
                                  if self.is_direction else
                                  "a logit difference (target='difference')")

    @property
    def is_direction(self) -> bool:
        """Whether the target is a direction (a tensor or a :class:`~.targets.Target`)."""
        return isinstance(self.target, torch.Tensor | Target)

    def salient(self) -> tuple[int, float]:
        """``(max_n_logits, desired_logit_prob)`` of a graph without an answer, ``None`` read as
        circuit-tracer's values (:data:`~pyvene_causaltrace.defaults.GRAPH_MAX_N_LOGITS`,
        :data:`~pyvene_causaltrace.defaults.GRAPH_DESIRED_LOGIT_PROB`)."""
        return (GRAPH_MAX_N_LOGITS if self.max_n_logits is None else self.max_n_logits,
                GRAPH_DESIRED_LOGIT_PROB if self.desired_logit_prob is None
                else self.desired_logit_prob)

    def _refuse_choosers(self, why: str) -> None:
        chooser = [name for name, value in (("max_n_logits (--max-n-logits)", self.max_n_logits),
                                            ("desired_logit_prob (--desired-logit-prob)",
                                             self.desired_logit_prob)) if value is not None]
        if chooser:
            raise InputError(f"{' and '.join(chooser)} choose the salient logits of a graph "
                             f"without an answer; this graph explains {why}, so they would be "
                             "ignored: drop them, or drop the answer")

    def check_answer(self, answer: str | None) -> AttributionSettings:
        """Refuse (:class:`~..errors.InputError`) what these settings cannot do with ``answer``
        (the text of one token, or None): an answer beside a direction target, salient-logit
        settings beside an answer; returns ``self``."""
        if answer is not None and not isinstance(answer, str):
            raise InputError(f"answer must be a string (the text of one token) or None, got "
                             f"{type(answer).__name__} {answer!r}")
        if answer is None:
            return self
        if self.is_direction:
            raise InputError("--direction explains a direction, --answer a logit: pass one of "
                             "them (answer= or a direction target=)")
        self._refuse_choosers("one answer's logit (answer=, --answer)")
        return self


@dataclass(frozen=True)
class ReadingSettings(Settings):
    """How a graph is read: pruning keeps the nodes carrying
    ``node_threshold`` of the cumulative influence, then the edges carrying ``edge_threshold``
    of the cumulative edge score (circuit-tracer's 0.8 and 0.98; :func:`~.reading.prune`);
    ``graph.json`` holds at most ``max_links`` links, those of largest edge score (``None``:
    every kept link; :func:`~.export.graph_json`). Refused when made: a threshold outside
    [0, 1] (or not a finite number), a link cap below 1."""

    node_threshold: Fraction = NODE_THRESHOLD
    edge_threshold: Fraction = EDGE_THRESHOLD
    max_links: PositiveInt | None = MAX_LINKS


@dataclass(frozen=True)
class FaithfulnessSettings(Settings):
    """How a faithfulness curve is measured (module docstring): ``sizes`` in percent of the
    ranked items, each in (0, 100], increasing; ``level`` ``"nodes"`` or ``"edges"``;
    ``rank_by`` ``"influence"`` or ``"direct"`` (a node's signed direct effect on the target, an
    edge's ``|weight|``); ``ablation`` ``"counterfactual"``, ``"mean"`` or ``"zero"``;
    ``errors`` ``"held"`` or ``"ablated"``; ``metric`` ``"logit_diff"``, ``"prob"`` or ``"kl"``;
    ``draws`` random rankings (seeded by ``seed``); ``batch_size`` circuits per forward;
    ``budgets`` the numbers K of features a feature-budget curve keeps (positive, increasing;
    :mod:`.budget_curve`)."""

    sizes: tuple[float, ...] = FAITH_SIZES
    level: Literal["nodes", "edges"] = FAITH_LEVEL
    rank_by: Literal["influence", "direct"] = FAITH_RANK_BY
    ablation: Literal["counterfactual", "mean", "zero"] = FAITH_ABLATION
    errors: Literal["held", "ablated"] = FAITH_ERRORS
    metric: Literal["logit_diff", "prob", "kl"] = FAITH_METRIC
    draws: PositiveInt = FAITH_DRAWS
    seed: Seed = FAITH_SEED
    batch_size: PositiveInt = FAITH_BATCH
    budgets: tuple[int, ...] = FAITH_BUDGETS

    def __post_init__(self) -> None:
        super().__post_init__()
        budgets, sizes = tuple(self.budgets), tuple(self.sizes)
        if not budgets or any(isinstance(k, bool) or not isinstance(k, int) or k <= 0
                              for k in budgets):
            raise InputError(f"budgets must be whole numbers of features K > 0, got "
                             f"{list(budgets)}")
        if not sizes or any(not 0 < s <= 100 for s in sizes):
            raise InputError(f"sizes must be percentages in (0, 100], got {list(sizes)}")
        if len(sizes) < 2:  # one point has no area: CPR 0 and CMD 0, a "perfect" CMD
            raise InputError(f"sizes: CPR and CMD integrate between sizes; give two or more, "
                             f"got {list(sizes)}")
        for name, values in (("budgets", budgets), ("sizes", sizes)):
            if any(b <= a for a, b in zip(values, values[1:], strict=False)):
                raise InputError(f"{name} must increase, got {list(values)}")
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "sizes", tuple(float(s) for s in sizes))
