"""Read module outputs during a forward, with hooks we add and remove ourselves.

    states = capture(model, {"input_ids": ids}, ["model.layers[3].output", "model.norm.input"])

Only the hooks added here are removed afterwards (unlike pyvene, which strips all of them).
Tuple outputs (attention, GPT-2 blocks) give their first element. Values are copied after the
forward, so they include in-place edits that pyvene interventions make on the same output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .errors import InputError
from .hooking import installed
from .models import get_module


def capture(
    model: nn.Module, inputs: dict[str, Any], components: Iterable[str],
    run: Callable[[], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Detached copies of ``components`` (``"<module path>.output"`` or ``.input``).

    ``run`` performs the forward (default ``model(**inputs)`` under ``no_grad``); pass one to
    capture inside another call, e.g. an intervened pyvene run.
    """
    found: dict[str, torch.Tensor] = {}
    hooks = []
    for component in dict.fromkeys(components):
        module_path, _, kind = component.rpartition(".")
        module = get_module(model, module_path)
        if kind == "output":
            def hook(_module, _args, output, _key=component):
                found[_key] = output[0] if isinstance(output, tuple) else output
            hooks.append((module, "forward", hook))
        elif kind == "input":
            def pre_hook(_module, args, _key=component):
                found[_key] = args[0]
            hooks.append((module, "forward_pre", pre_hook))
        else:
            raise InputError(f"component {component!r} must end in .output or .input")
    with installed(hooks), torch.no_grad():
        run() if run is not None else model(**inputs)
    return {key: value.detach().clone() for key, value in found.items()}
