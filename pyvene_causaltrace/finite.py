"""NaN and inf stop a run with an error that says where they came from — never a grid of NaN
reported as fine.

    check_weights(model)                            # a damaged checkpoint: names the tensor
    check_finite(probs, "the clean run's probabilities", hint="...")
    check_weight(tensor, path, "w_dec")             # a transcoder tensor as it is read
    positive_number(scale, "scale")                 # numeric arguments at the boundary
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .arguments import PositiveFloat, check_value
from .errors import InputError, NonFiniteError, TranscoderFormatError

#: The dtypes a transcoder's tensors may be stored in: the floats torch computes in everywhere.
#: Integer, bool, float8 and complex tensors are refused, not cast (a cast would hide a wrong file).
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN/inf: one ``aminmax`` pass (NaN propagates to both ends,
    inf reaches one), about as fast as reading the memory; ``isfinite().all()`` took 50x longer
    on this CPU build, and a mask the size of the tensor."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True  # integers hold no NaN/inf (what may be integer is for the caller to say)
    lo, hi = torch.aminmax(tensor)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def check_finite(tensor: torch.Tensor, what: str, hint: str = "",
                 error: type[InputError] = NonFiniteError) -> None:
    """Refuse ``tensor`` (an ``error``) if it holds NaN or inf; ``what`` says where it came
    from."""
    if not all_finite(tensor):
        raise error(f"{what} hold NaN/inf" + (f": {hint}" if hint else ""))


def check_weight(tensor: torch.Tensor, path: object, name: str) -> torch.Tensor:
    """``tensor``, tensor ``name`` of the transcoder file ``path``, or a
    :class:`~.errors.TranscoderFormatError` naming both if its dtype is not one of
    :data:`WEIGHT_DTYPES` or it holds NaN/inf. Every loader calls it on what it reads, when
    it reads it (a memory-mapped decoder's rows as they are gathered): one pass over the read."""
    if tensor.dtype not in WEIGHT_DTYPES:
        raise dtype_error(path, name, str(tensor.dtype).removeprefix("torch."))
    check_finite(tensor, f"{path}: the values of tensor {name}",
                 "a damaged file, or one saved from a diverged run", TranscoderFormatError)
    return tensor


def dtype_error(path: object, name: str, dtype: str) -> TranscoderFormatError:
    """The error for tensor ``name`` of ``path`` stored as ``dtype`` (a torch or safetensors
    dtype name) that is not one of :data:`WEIGHT_DTYPES`."""
    return TranscoderFormatError(
        f"{path}: tensor {name} is {dtype}; transcoder weights must be float32, float16, "
        "bfloat16 or float64 (integer, bool, float8 and complex tensors are refused, not cast)")


def positive_number(value: object, name: str) -> float:
    """``value`` as a finite positive float, else an InputError naming ``name`` (the
    boundary's rule for :data:`~.arguments.PositiveFloat`, for values checked in a body)."""
    return float(check_value(name, value, PositiveFloat))
