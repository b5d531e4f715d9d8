"""A device spy: a second device on a CPU-only machine, so that a test catches what a GPU run
would refuse (a tensor the package makes on the CPU meeting the model's tensors on the GPU).

:class:`Spied` is a tensor that says it lives on ``meta`` and holds a plain CPU tensor; under
:func:`spy_device` every aten op runs on the held CPU tensors, and an op that meets a spied tensor
and a plain CPU tensor raises :class:`DeviceMix`, as CUDA would. What CUDA lets through passes:
copies between devices (``.to``, ``copy_``), CPU index tensors in indexing, and 0-dim CPU tensors
in pointwise ops (CUDA's TensorIterator takes them as scalars; ``searchsorted`` or ``matmul``
does not). A factory call or ``.to`` that names ``meta`` makes a spied tensor; ``.cpu()``,
``.to("cpu")``, ``.item()`` and ``.tolist()`` give plain values back, as from a GPU.

``meta`` rather than a fake ``cuda``: a CPU-only torch has no device guard for ``cuda``, and
autograd aborts the process on a tensor that claims it; ``meta`` has one. Code that asks
``device.type == "cuda"`` therefore takes its non-CUDA branch here (the GPU script covers those)."""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

SPY = torch.device("meta")
_CPU = torch.device("cpu")
_aten = torch.ops.aten
#: Ops whose index tensors (argument 1) CUDA accepts on the CPU.
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default}
#: Constructors from data, which place their result on ``device=`` below the dispatcher.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
#: Ops that move data between devices.
_MOVES = {_aten.copy_.default, _aten._to_copy.default, _aten.copy.default}


class DeviceMix(RuntimeError):
    """An op met a tensor on the model's device and a CPU tensor that CUDA would refuse."""


class Spied(torch.Tensor):
    """A tensor reported on :data:`SPY`, computed on the CPU tensor it holds (``inner``)."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=SPY,
            requires_grad=inner.requires_grad)
        out.inner = inner.detach() if inner.requires_grad else inner
        return out

    def tolist(self):
        return self.inner.tolist()

    # Python indexing turns a list index into a tensor on the indexed tensor's device below the
    # dispatcher, where the spy cannot see: a real, empty meta tensor. CUDA takes CPU indices.
    def __getitem__(self, index):
        return super().__getitem__(_host_index(index))

    def __setitem__(self, index, value):
        super().__setitem__(_host_index(index), value)

    def __repr__(self):
        return f"Spied({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs)


def _host_index(index):
    """``index`` with its lists as CPU tensors (what CUDA indexing accepts from the host)."""
    if isinstance(index, tuple):
        return tuple(_host_index(part) for part in index)
    return torch.tensor(index) if isinstance(index, list) else index


def _names(tensors) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)


class _SpyMode(TorchDispatchMode):
    """Factory calls and moves of plain tensors that name :data:`SPY`; ops on spied tensors."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return _run(func, args, kwargs)


class _FromData(TorchFunctionMode):
    """``torch.tensor(data, device=SPY)`` and its kin (``spied.new_tensor(data)``): made on
    the CPU, then spied."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func is torch.Tensor.new_tensor and isinstance(args[0], Spied) and device is None:
            return Spied(args[0].inner.new_tensor(*args[1:], **kwargs))
        if func in _FROM_DATA and device is not None and torch.device(device).type == SPY.type:
            kwargs["device"] = _CPU
            return Spied(func(*args, **kwargs))
        return func(*args, **kwargs)


def _unwrap(t):
    return t.inner if isinstance(t, Spied) else t


def _run(func, args, kwargs):
    """``func`` on the held CPU tensors; its tensors spied if it met one or names :data:`SPY`."""
    kwargs = dict(kwargs or {})
    leaves = tree_leaves((args, kwargs))
    spied = [t for t in leaves if isinstance(t, Spied)]
    if any(type(t) is torch.Tensor and t.device.type == SPY.type for t in leaves):
        raise RuntimeError(f"{func} got a real {SPY.type} tensor (no data), made where the spy "
                           "does not look: teach the spy its maker")
    wrap = bool(spied)
    if kwargs.get("device") is not None:  # a factory or a move: its device decides
        wrap = torch.device(kwargs["device"]).type == SPY.type
        if wrap:
            kwargs["device"] = _CPU
            if kwargs.get("generator") is not None:  # a CPU generator cannot draw on CUDA
                raise DeviceMix(f"{func} draws on the model's device from a CPU generator")
    if spied and func not in _MOVES:
        scan = (args[:1] + args[2:], kwargs) if func in _INDEXING else (args, kwargs)
        scalars_ok = torch.Tag.pointwise in func.tags
        plain = [t for t in tree_leaves(scan) if isinstance(t, torch.Tensor)
                 and not isinstance(t, Spied) and (t.dim() > 0 or not scalars_ok)]
        if plain:
            raise DeviceMix(f"{func} meets tensors on the model's device ({_names(spied)}) "
                            f"and CPU tensors ({_names(plain)})")
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if not wrap:
        return out
    held = {id(t.inner): t for t in spied}  # an in-place op returns its own input

    def rewrap(t):
        if not isinstance(t, torch.Tensor):
            return t
        return held[id(t)] if id(t) in held else Spied(t)

    return tree_map(rewrap, out)


def spy_module(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s parameters and buffers replaced, in place, by spied copies."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(Spied(p.detach().clone()),
                                                           requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = Spied(b.clone())
    return module


@contextlib.contextmanager
def spy_device():
    """Run the block with :class:`Spied` tensors live (module docstring); yields the mode, whose
    ``ops`` counts the aten ops it saw."""
    mode = _SpyMode()
    autocast = torch.autocast

    def any_autocast(device_type, *args, **kwargs):  # meta has no autocast: the CPU's stands in
        return autocast("cpu" if device_type == SPY.type else device_type, *args, **kwargs)

    optimizer = importlib.import_module("torch.optim.optimizer")  # torch.optim hides the name
    fused = optimizer._get_fused_kernels_supported_devices  # fused Adam: CUDA's too
    with mock.patch.object(torch, "autocast", any_autocast), \
            mock.patch.object(optimizer, "_get_fused_kernels_supported_devices",
                              lambda: [*fused(), SPY.type]), _FromData(), mode:
        yield mode
