"""Causal tracing and CLT attribution graphs as registered pyvene interventions.

    from pyvene_causaltrace import load_model, trace
    model, tokenizer = load_model("smollm2-135m")
    result = trace(model, tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower")
    graph = attribute(model, tokenizer, clt, "The Eiffel Tower is in the city of", " Paris")

Names are imported lazily: importing the package imports neither pyvene nor transformers and
changes nothing but this package's own registry.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("pyvene-causaltrace")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

_EXPORTS = {
    "load_model": ".models",
    "get_adapter": ".models",
    "ADAPTERS": ".models",
    "UnsupportedModelError": ".models",
    "load_spec": ".specs",
    "save_spec": ".specs",
    "validate_spec": ".specs",
    "SpecError": ".specs",
    "ExperimentSpec": ".specs",
    "trace": ".tracing.trace",
    "Tracer": ".tracing.trace",
    "TraceResult": ".tracing.results",
    "run_spec": ".tracing.run",
    "build_intervenable": ".tracing.run",
    "build_interventions": ".tracing.run",
    "to_pv_config": ".tracing.run",
    "Transcoder": ".transcoders",
    "CrossLayerTranscoder": ".transcoders",
    "load_transcoder": ".transcoders",
    "attribute": ".attribution",
    "AttributionGraph": ".attribution",
    "register_intervention": ".interventions",
    "get_intervention": ".interventions",
    "list_interventions": ".interventions",
    "IntervenableModel": ".pyvene_compat",
    "preserve_hooks": ".pyvene_compat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "IntervenableModel":
        from .pyvene_compat import intervenable_model_class

        return intervenable_model_class()
    return getattr(import_module(_EXPORTS[name], __name__), name)
