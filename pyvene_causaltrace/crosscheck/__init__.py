"""Tracing meets attribution: each method checks the other on the same prompt and model.

:mod:`.sites` compares, per (layer, position), the graph's influence with the trace's indirect
effect.
"""

from .sites import SITE_PARTS, compare_grids, reachable_cells, site_influence, spearman

__all__ = ["SITE_PARTS", "compare_grids", "reachable_cells", "site_influence", "spearman"]
