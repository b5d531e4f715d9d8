"""NaN and inf stop a run with an error that says where they came from — never a grid of NaN
reported as fine.

    check_weights(model)                            # a damaged checkpoint: names the tensor
    check_finite(probs, "the clean run's probabilities", hint="...")
    positive_number(scale, "scale")                 # numeric arguments at the boundary
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .errors import InputError, NonFiniteError


def check_weights(model: nn.Module) -> None:
    """Refuse a model with NaN or inf in a parameter or buffer, naming the first one.

    A model that passed and whose tensors have not been written since (same storage, same
    version counter) is not scanned again: a dataset run builds a tracer per fact."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    stamp = tuple((t.data_ptr(), t._version) for _, t in tensors)
    if model.__dict__.get("_pvct_finite_stamp") == stamp:
        return
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise NonFiniteError(
                f"the model's weights hold NaN/inf: {name} has {bad} of {tensor.numel()} "
                "values non-finite (a damaged checkpoint, or one saved from a diverged run)")
    model.__dict__["_pvct_finite_stamp"] = stamp


def check_finite(tensor: torch.Tensor, what: str, hint: str = "") -> None:
    """Refuse ``tensor`` if it holds NaN or inf; ``what`` says where it came from."""
    if not bool(torch.isfinite(tensor).all()):
        raise NonFiniteError(f"{what} hold NaN/inf" + (f": {hint}" if hint else ""))


def positive_number(value: object, name: str) -> float:
    """``value`` as a finite positive float, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise InputError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)
