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


def weights_stamp(model: nn.Module) -> tuple:
    """What changes when a parameter or buffer of ``model`` is replaced or written: each
    tensor's storage and version counter."""
    return tuple((t.data_ptr(), t._version)
                 for t in (*model.parameters(), *model.buffers()))


def check_weights(model: nn.Module) -> None:
    """Refuse a model with NaN or inf in a parameter or buffer, naming the first one (every
    call scans; :meth:`~.bound.BoundModel.check_weights` scans only weights written since)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise NonFiniteError(
                f"the model's weights hold NaN/inf: {name} has {bad} of {tensor.numel()} "
                "values non-finite (a damaged checkpoint, or one saved from a diverged run)")


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
