"""Causal tracing and CLT attribution graphs as registered pyvene interventions.

    from pyvene_causaltrace import load_model, trace
    model, tokenizer = load_model("smollm2-135m")
    result = trace(model, tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower")
    graph = attribute(model, tokenizer, clt, "The Eiffel Tower is in the city of", " Paris")
    steered = intervene_features(model, tokenizer, clt, "The Eiffel Tower is in the city of",
                                 [(20, -1, 1234, 10.0)], max_new_tokens=10)
    check = cross_check(graph, Tracer(model, tokenizer, prompt, subject, answer=" Paris"), clt)

Names are imported lazily: importing the package imports neither pyvene nor transformers and
changes nothing but this package's own registry.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._lazy import lazy_exports

try:
    __version__ = version("pyvene-causaltrace")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

#: The verbs and result types most work needs; everything else lives in the subpackages
#: (``tracing``, ``dataset``, ``attribution``, ``transcoders``, ``interventions``, ``specs``,
#: ``models``, ``pyvene_boundary``).
__getattr__, __all__ = lazy_exports(__name__, {
    "load_model": ".models",
    "trace": ".tracing.tracer",
    "Tracer": ".tracing.tracer",
    "TraceResult": ".tracing.results",
    "trace_dataset": ".dataset.run",
    "load_spec": ".specs",
    "run_spec": ".execute",
    "SpecError": ".specs",
    "attribute": ".attribution.attribute",
    "AttributionGraph": ".attribution.graph",
    "intervene_features": ".steering",
    "cross_check": ".crosscheck.check",
    "load_transcoder": ".transcoders.formats",
    "fit_transcoder": ".fitting",
    "register_intervention": ".interventions",
    "IntervenableModel": ".pyvene_boundary.intervenable",
})
