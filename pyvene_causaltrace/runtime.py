"""Our own forwards with registered intervention types applied: representations as edits.

    with intervened(bound, [{"component": bound.site("embed"), "intervention": noise}]):
        logits = bound.model(input_ids=ids).logits

Users compose through pyvene (:mod:`.pyvene_boundary`); the package's own forwards need
nothing an ``IntervenableModel`` adds around a call. :func:`intervened` hands the same
representation dicts to the one applier (:mod:`.applier`), each applied as pyvene 0.1.8 does
with ``unit_locations=None`` and announcing its call (:func:`~.pyvene_boundary.calls.pyvene_call`)
so recomputing types read no frame. The numbers are pyvene's bit for bit
(``tests/test_runtime.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .applier import Call, Edit, applying
from .bound import BoundModel
from .pyvene_boundary.calls import apply_like_pyvene, calling
from .pyvene_boundary.intervenable import bind_shared_state, weights_without_gradients

__all__ = ["intervened"]


def intervention_edit(made: nn.Module, key: str):
    """The edit applying ``made`` as pyvene 0.1.8's setter does with ``unit_locations=None``:
    on a clone of the value (:func:`~.pyvene_boundary.calls.apply_like_pyvene`), its call
    announced."""
    def edit(value: torch.Tensor, call: Call) -> torch.Tensor:
        with calling(call.module, call.args, call.kwargs, key=key):
            return apply_like_pyvene(made, value)
    return edit


@contextlib.contextmanager
def intervened(bound: BoundModel, representations: Sequence[dict[str, Any]], *,
               keep_model_gradients: bool = False) -> Iterator[nn.Module]:
    """Inside the block, this thread's forwards of ``bound``'s model run with
    ``representations`` applied (module docstring); yields the ``nn.Module`` to call.
    ``keep_model_gradients``: the weights' ``requires_grad`` flags stay as they are (else they
    are lowered for the block, as pyvene does, so a forward under autograd records no graph
    through the weights)."""
    module = bound.model
    made = {f"{index}:{rep['component']}": rep["intervention"]
            for index, rep in enumerate(representations)}
    bind_shared_state(made.values())
    edits = [Edit(bound.site_of(rep["component"]), intervention_edit(intervention, key))
             for (key, intervention), rep in zip(made.items(), representations, strict=True)]
    with weights_without_gradients(module, keep_model_gradients), applying(module, edits):
        yield module
