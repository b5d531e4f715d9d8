"""Symbolic positions, layers and components of a spec, resolved to numbers and module paths.

    resolve_positions("last_subject", prompt, "$.interventions[1].positions")   # [3]
    resolve_layers({"center": 5, "window": 4}, 30, "$.interventions[1].layers")  # [3, 4, 5, 6]
    component_path("mlp_output", 5, adapter)      # "model.layers[5].mlp.output"

A component is a site name of the adapter's vocabulary (:data:`~pyvene_causaltrace.models.SITES`)
or a raw pyvene module path ending in ``.output``/``.input`` (``{layer}`` replaced per layer).

Errors are :class:`~pyvene_causaltrace.errors.SpecError` naming the JSON path given.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError, SpecError
from .models import SITES, ArchAdapter
from .prompts import TokenizedPrompt


def window_layers(center: int, window: int, n_layers: int) -> list[int]:
    """ROME's window of ``window`` layers around ``center``, clipped to the model."""
    if window <= 0:
        raise InputError(f"window must be positive, got {window}")
    if not 0 <= center < n_layers:
        raise InputError(f"centre layer {center} is outside 0..{n_layers - 1}")
    return list(range(max(0, center - window // 2), min(n_layers, center - (-window // 2))))


def resolve_positions(value: Any, prompt: TokenizedPrompt, path: str) -> list[int]:
    """Token positions named by ``value`` (see the schema's ``positions``), in order, unique."""
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for i, item in enumerate(items):
        item_path = f"{path}[{i}]" if isinstance(value, list) else path
        for p in _resolve_position(item, prompt, item_path):
            if p not in out:
                out.append(p)
    return out


def _resolve_position(item: Any, prompt: TokenizedPrompt, path: str) -> list[int]:
    n = prompt.seq_len
    if isinstance(item, str):
        if item == "all":
            return list(range(n))
        if item == "last":
            return [n - 1]
        if prompt.subject_range is None:
            raise SpecError(path, f"{item!r} needs a subject")
        start, stop = prompt.subject_range
        if item == "after_subject" and stop >= n:
            raise SpecError(path, "the subject ends the prompt: no token follows it")
        named = {"subject": list(range(start, stop)), "first_subject": [start],
                 "last_subject": [stop - 1], "after_subject": [stop]}
        if item not in named:
            raise SpecError(path, f"unknown position name {item!r}")
        return named[item]
    if isinstance(item, int):
        return [_index(item, n, path, "position")]
    return _span(item, n, path, "position")


def resolve_layers(value: Any, n_layers: int, path: str) -> list[int]:
    """Layer indices named by ``value`` (see the schema's ``layers``)."""
    if value == "all":
        return list(range(n_layers))
    if isinstance(value, int):
        return [_index(value, n_layers, path, "layer")]
    if isinstance(value, list):
        return [_index(v, n_layers, f"{path}[{i}]", "layer") for i, v in enumerate(value)]
    if "center" in value:
        center = _index(value["center"], n_layers, path + ".center", "layer")
        return window_layers(center, value["window"], n_layers)
    return _span(value, n_layers, path, "layer")


def _span(value: dict, size: int, path: str, what: str) -> list[int]:
    """``{"start", "stop"}`` as the indices ``[start, stop)`` of ``size`` (stop may be ``size``);
    a negative bound counts from the end, as in Python's ``range(size)[start:stop]``."""
    start = _bound(value["start"], size, path + ".start", what)
    stop = _bound(value["stop"], size, path + ".stop", what)
    if stop <= start:
        raise SpecError(path, f"empty {what} range [{start}, {stop})")
    return list(range(start, stop))


def _bound(value: int, size: int, path: str, what: str) -> int:
    """A range bound: ``0..size``, or negative from the end (``-1`` is ``size - 1``)."""
    index = value + size if value < 0 else value
    if not 0 <= index <= size:
        raise SpecError(path, f"{what} bound {value} is outside -{size}..{size}")
    return index


def _index(value: int, size: int, path: str, what: str) -> int:
    index = value + size if value < 0 else value
    if not 0 <= index < size:
        raise SpecError(path, f"{what} {value} is outside 0..{size - 1}")
    return index


def component_path(component: str, layer: int | None, adapter: ArchAdapter) -> str:
    """The pyvene component string (a module path ending in ``.output``/``.input``)."""
    if component in SITES:
        return adapter.site(component, layer)
    return component.replace("{layer}", str(layer)) if layer is not None else component


def component_layers(component: str, layers: Any, n_layers: int, path: str,
                     adapter: ArchAdapter, default: Any = None) -> list[int | None]:
    """The layers a component spans (``layers``, else ``default`` for a component that has
    layers): ``[None]`` for layer-free components."""
    if component in SITES and not adapter.has_site(component):
        raise SpecError(path + ".component", f"{adapter.model_type} has no {component!r}")
    layered = adapter.layered(component) if component in SITES else "{layer}" in component
    if not layered:
        if layers is not None:
            raise SpecError(path + ".layers", f"component {component!r} has no layers")
        return [None]
    layers = default if layers is None else layers
    if layers is None:
        raise SpecError(path, f"component {component!r} needs layers")
    return resolve_layers(layers, n_layers, path + ".layers")
