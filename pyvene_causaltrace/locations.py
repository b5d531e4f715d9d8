"""Symbolic positions, layers and components of a spec, resolved to numbers and module paths.

    resolve_positions("last_subject", prompt, "$.interventions[1].positions")   # [3]
    resolve_layers({"center": 5, "window": 4}, 30, "$.interventions[1].layers")  # [3, 4, 5, 6]
    component_path("mlp_output", 5, adapter)      # "model.layers[5].mlp.output"

Errors are :class:`~pyvene_causaltrace.specs.SpecError` naming the JSON path given.
"""

from __future__ import annotations

from typing import Any

from .interventions.restore import window_layers
from .models import ArchAdapter
from .prompts import TokenizedPrompt
from .specs import SpecError

SYMBOLIC_COMPONENTS = {
    "embed": None,  # the input-embedding module's output; has no layers
    "block_output": "block",
    "mlp_output": "mlp",
    "attn_output": "attn",
}


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
        if item == "subject":
            return list(range(start, stop))
        if item == "first_subject":
            return [start]
        if item == "last_subject":
            return [stop - 1]
        if item == "after_subject":
            if stop >= n:
                raise SpecError(path, "the subject ends the prompt: no token follows it")
            return [stop]
        raise SpecError(path, f"unknown position name {item!r}")
    if isinstance(item, int):
        return [_index(item, n, path, "position")]
    start = _index(item["start"], n + 1, path + ".start", "position")
    stop = _index(item["stop"], n + 1, path + ".stop", "position")
    if stop <= start:
        raise SpecError(path, f"empty position range [{start}, {stop})")
    return list(range(start, stop))


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
    start = _index(value["start"], n_layers + 1, path + ".start", "layer")
    stop = _index(value["stop"], n_layers + 1, path + ".stop", "layer")
    if stop <= start:
        raise SpecError(path, f"empty layer range [{start}, {stop})")
    return list(range(start, stop))


def _index(value: int, size: int, path: str, what: str) -> int:
    index = value + size if value < 0 else value
    if not 0 <= index < size:
        raise SpecError(path, f"{what} {value} is outside 0..{size - 1}")
    return index


def component_path(component: str, layer: int | None, adapter: ArchAdapter) -> str:
    """The pyvene component string (a module path ending in ``.output``/``.input``)."""
    if component in SYMBOLIC_COMPONENTS:
        part = SYMBOLIC_COMPONENTS[component]
        if part is None:
            return adapter.embed + ".output"
        return adapter.module_path(part, layer) + ".output"
    return component.replace("{layer}", str(layer)) if layer is not None else component


def component_layers(component: str, layers: Any, n_layers: int, path: str) -> list[int | None]:
    """The layers a component spans: ``[None]`` for layer-free components."""
    layered = component in ("block_output", "mlp_output", "attn_output") or "{layer}" in component
    if not layered:
        if layers is not None:
            raise SpecError(path + ".layers", f"component {component!r} has no layers")
        return [None]
    if layers is None:
        raise SpecError(path, f"component {component!r} needs layers")
    return resolve_layers(layers, n_layers, path + ".layers")
