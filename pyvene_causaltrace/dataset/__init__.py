"""Causal tracing over datasets: average indirect effects by token role, other tasks,
resumable runs and sharding; with a transcoder, each fact's attribution graph beside its
traces.

    from pyvene_causaltrace.dataset import DatasetSettings, read_records, trace_dataset
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "FactRecord": ".records", "RecordError": ".records", "read_records": ".records",
    "TASKS": ".tasks", "get_task": ".tasks", "DatasetResult": ".results",
    "trace_dataset": ".run", "trace_dataset_distributed": ".run", "merge_shards": ".run",
    "load_dataset_result": ".run", "aggregate_rows": ".aggregate",
    "role_curves": ".aggregate", "bootstrap_interval": ".aggregate",
    "DatasetSettings": ".settings", "GraphSettings": ".graphs",
    "aggregate_graphs": ".graph_aggregate", "aggregate_schema": ".results",
})
