"""Tracing meets attribution: each method checks the other on the same prompt and model.

    check = cross_check(graph, tracer, transcoder)
    check.summary(); check.plot("cross_check.png"); check.to_json("cross_check.json")

:mod:`.sites` and :mod:`.features` -> :mod:`.check` -> :mod:`.result` -> :mod:`.plots`;
:mod:`.settings` holds :class:`CrossCheckSettings`."""

from .check import check_pair, cross_check
from .features import MODES, PatchRunner, noised_activations, total_effects
from .result import CrossCheckResult, cross_check_schema
from .settings import SITE_KINDS, CrossCheckSettings
from .sites import SITE_PARTS, compare_grids, reachable_cells, site_influence, spearman

__all__ = ["MODES", "SITE_KINDS", "SITE_PARTS", "CrossCheckResult", "CrossCheckSettings",
           "PatchRunner", "check_pair", "compare_grids", "cross_check", "cross_check_schema",
           "noised_activations", "reachable_cells", "site_influence", "spearman",
           "total_effects"]
