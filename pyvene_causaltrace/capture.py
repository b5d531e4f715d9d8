"""Read module outputs and inputs during a forward: readers handed to the one applier.

    states = capture(model, {"input_ids": ids}, ["model.layers[3].output", "model.norm.input"])

Each component is a reader edit (:func:`~.applier.reader`): it sees the value the module's
readers see, after every edit at its site, and it is gone when the call returns. Tuple outputs
(attention, GPT-2 blocks) give their first element. Values are copied after the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .applier import Site, applying, reader
from .errors import InputError
from .models import get_module


def capture(
    model: nn.Module, inputs: dict[str, Any], components: Iterable[str],
    run: Callable[[], Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Detached copies of ``components`` (``"<module path>.output"`` or ``.input``).

    ``run`` performs the forward (default ``model(**inputs)`` under ``no_grad``); pass one to
    capture inside another call, e.g. an intervened run.
    """
    found: dict[str, torch.Tensor] = {}
    edits = []
    for component in dict.fromkeys(components):
        module_path, _, kind = component.rpartition(".")
        if kind not in ("output", "input"):
            raise InputError(f"component {component!r} must end in .output or .input")
        edits.append(reader(Site(get_module(model, module_path), kind), found, component))
    with applying(model, edits), torch.no_grad():
        run() if run is not None else model(**inputs)
    return {key: value.detach().clone() for key, value in found.items()}
