"""Causal tracing over datasets: average indirect effects by token role, other tasks,
resumable runs and sharding.

    from pyvene_causaltrace.dataset import read_records, trace_dataset
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "FactRecord": ".records", "RecordError": ".records", "read_records": ".records",
    "TASKS": ".tasks", "get_task": ".tasks", "DatasetResult": ".results",
    "trace_dataset": ".run", "trace_dataset_distributed": ".run", "merge_shards": ".run",
    "load_dataset_result": ".run", "aggregate_rows": ".aggregate",
    "role_curves": ".aggregate", "bootstrap_interval": ".aggregate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
