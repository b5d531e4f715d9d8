"""The precision and the determinism of a graph: :class:`~.settings.AttributionSettings`'
``compute_dtype`` and ``deterministic``.

``compute_dtype="bfloat16"`` on a float32 (or float64) model runs the local replacement forward
under ``torch.autocast``: the matrix products, the model's and the transcoder's, in bfloat16;
what autocast keeps in float32 (the residual stream's additions, norms, softmax) in float32.
The backward follows the forward's dtypes. The user's model is not cast or copied. Where sums
feed the edges and the closure check they are float32 or wider: each edge ``x_i * g_i`` and the
error and token edges' sums over ``d_model`` in float32 (:func:`~.edges.edges_from_grads`), the
feature leaves' gradients from the transcoder's own (float32) decoder rows
(:mod:`.leaf_grads`), each row's closure in float64 against the feature's pre-activation
recomputed in float32 from its live input (:func:`~.edges.feature_targets_and_magnitudes`). So
a bfloat16 graph's closure measures bfloat16's own rounding in the forward and backward; it is
checked against :data:`~.edges.BF16_CLOSURE_TOLERANCE`. The clean forward that picks the
targets runs in the model's dtype, so a bfloat16 graph explains the same logits as the float32
graph of the prompt (:func:`~.compare.graph_deviation` compares the two).

``deterministic=True`` (:func:`deterministic_algorithms`) turns torch's deterministic
algorithms on for the call and sets ``CUBLAS_WORKSPACE_CONFIG`` where it is unset, restoring
both after. On the CPU two runs with the same settings and thread count are already
bit-identical (tests/test_attribution_precision.py); on CUDA it is what makes them so."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from ..errors import InputError

__all__ = ["DTYPES", "compute_dtype", "deterministic_algorithms", "dtype_name", "precision"]

#: The dtypes a graph can be computed in, by the name settings, flags and metadata use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Model dtypes autocast can lower to bfloat16.
_WIDE = (torch.float32, torch.float64)
#: What ``deterministic=True`` sets ``CUBLAS_WORKSPACE_CONFIG`` to where it is unset (one of
#: the two values torch's deterministic mode accepts for cuBLAS).
CUBLAS_WORKSPACE = ":4096:8"


def dtype_name(value: object) -> str | None:
    """``value`` (a name of :data:`DTYPES`, a ``torch.dtype`` among them, or None: the
    model's) as its name; anything else refused, naming the field ``dtype``."""
    if value is None:
        return None
    for name, dtype in DTYPES.items():
        if value == name or value is dtype:
            return name
    raise InputError(f"compute_dtype (--dtype) must be one of {', '.join(DTYPES)} (or a torch "
                     f"dtype among them; None: the model's), got {value!r}")


def compute_dtype(model_dtype: torch.dtype, dtype: str | None) -> torch.dtype:
    """The dtype a graph is computed in: ``dtype``'s, or the model's (``None``). float32 needs
    a float32 model (a lower dtype's weights have lost their precision already; autocast
    lowers, never raises); bfloat16 a bfloat16, float32 or float64 one."""
    if dtype is None:
        return model_dtype
    wanted = DTYPES[dtype]
    if wanted != model_dtype and (wanted == torch.float32 or model_dtype not in _WIDE):
        raise InputError(f"compute_dtype={dtype!r}: the model's weights are {model_dtype}; pass "
                         f"dtype=None (the model's) or a {dtype} graph's model: "
                         f"model.to(torch.{dtype})")
    return wanted


def precision(device: torch.device, model_dtype: torch.dtype,
              dtype: torch.dtype) -> AbstractContextManager:
    """The context a forward of the local replacement model runs in: nothing where ``dtype``
    is the model's, else autocast to ``dtype`` on ``device`` (module docstring)."""
    if dtype == model_dtype:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Inside the block: torch's deterministic algorithms on (``warn_only``: an op without a
    deterministic implementation warns, naming itself, rather than failing the graph), cuDNN's
    benchmark off, ``CUBLAS_WORKSPACE_CONFIG`` set where unset (:data:`CUBLAS_WORKSPACE`;
    cuBLAS sizes its workspace when first used, so a script that wants it sets it before its
    first CUDA call, as benchmarks/bf16_deviation.py does). Each restored after, on any
    exit."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        if workspace is None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        # a caller's own strict mode stays strict
        torch.use_deterministic_algorithms(True, warn_only=not before[0] or before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
