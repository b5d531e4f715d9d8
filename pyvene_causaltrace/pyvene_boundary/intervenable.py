"""Our ``IntervenableModel``: pyvene's, leaving the user's model as it found it (its hooks, its
``requires_grad`` flags), its setter hooks announcing their calls, loading as itself;
:func:`preserve_hooks` keeps the hooks for a block of calls of a user's plain
``pv.IntervenableModel``. Nothing here writes torch's hook tables: hooks are added through the
modules' ``register_*`` methods and removed through their handles.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import PyveneModelError
from ..hooking import register, release
from ..models import is_intervenable
from .calls import announcing_setter
from .quiet_import import import_pyvene


class _RecordedRegister:
    """A module's ``register_forward_hook`` / ``register_forward_pre_hook`` as pyvene keeps it
    in ``intervention_hooks``, noting each handle in ``handles`` so that the hooks pyvene
    registered, and only those, can be removed. ``gate``: each hook acts only on the
    registering thread's forwards (ours), else registered as pyvene would (a user's plain one
    in :func:`preserve_hooks`). ``__self__`` and ``__name__`` are the bound method's."""

    def __init__(self, register_method, handles: list, gate: bool = True) -> None:
        self.register, self.handles, self.gate = register_method, handles, gate
        self.__self__, self.__name__ = register_method.__self__, register_method.__name__

    def __call__(self, hook, *args: Any, **kwargs: Any):
        if self.gate:
            handle = register(self.register, hook, *args, **kwargs)
        else:
            handle = self.register(hook, *args, **kwargs)
        self.handles.append(handle)
        return handle


def _record_registers(pv_model, handles: list, gate: bool) -> None:
    """Wrap each of ``pv_model.intervention_hooks`` (pyvene's bound register methods) in a
    :class:`_RecordedRegister` noting into ``handles``."""
    for key, method in list(pv_model.intervention_hooks.items()):
        if callable(method) and hasattr(method, "__self__"):  # not ndif's tuples
            pv_model.intervention_hooks[key] = _RecordedRegister(method, handles, gate)


def bind_shared_state(interventions: Iterable[nn.Module]) -> None:
    """Let ``interventions`` (one model's) that share state by id (a splice built one by one,
    or loaded) bind it among themselves: a class that shares so has a ``bind_shared``
    (``SpliceIntervention``'s), called once with all of them."""
    made = list(interventions)
    binders = {}
    for klass in {type(m) for m in made}:
        bind = getattr(klass, "bind_shared", None)
        if bind is not None:
            binders.setdefault(getattr(bind, "__func__", bind), bind)
    for bind in binders.values():
        bind(made)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        release(handle)
    handles.clear()


@contextlib.contextmanager
def preserve_hooks(pv_model) -> Iterator[None]:
    """Inside the block, the calls of a plain ``pv.IntervenableModel`` remove only the hooks
    they registered, where pyvene removes every hook on the model around each call (so the
    user's hooks and transformers' output-capturing hooks stay). When the block ends the model
    is pyvene's own again. Our :class:`IntervenableModel` needs no block: it always does this.

    >>> with preserve_hooks(pv_model):                                    # doctest: +SKIP
    ...     pv_model(base=inputs)
    """
    if not is_intervenable(pv_model):
        raise PyveneModelError(
            "preserve_hooks takes the pv.IntervenableModel whose calls would strip the hooks "
            f"(got {type(pv_model).__name__}): inside the block its calls remove only their own "
            "hooks. Constructing one strips nothing")
    if isinstance(pv_model, intervenable_model_class()) \
            or "_remove_forward_hooks" in vars(pv_model):  # ours, or already inside a block
        yield
        return
    handles: list = []
    saved = dict(pv_model.intervention_hooks)
    _record_registers(pv_model, handles, gate=False)
    # an instance attribute shadows pyvene's method for this object only
    pv_model._remove_forward_hooks = functools.partial(_remove_handles, handles)
    try:
        yield
    finally:
        del pv_model._remove_forward_hooks
        pv_model.intervention_hooks.update(saved)
        _remove_handles(handles)


@contextlib.contextmanager
def _as_found(model: nn.Module) -> Iterator[None]:
    """After the block the model's ``requires_grad`` flags and train/eval mode are as before
    it (pyvene's ``IntervenableModel.__init__`` lowers the flags and sets eval mode)."""
    flags, training = [(p, p.requires_grad) for p in model.parameters()], model.training
    try:
        yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)
        model.train(training)


@contextlib.contextmanager
def _flags(parameters: list, value: bool) -> Iterator[None]:
    """``requires_grad`` set to ``value`` on ``parameters`` inside the block, put back after."""
    for parameter in parameters:
        parameter.requires_grad_(value)
    try:
        yield
    finally:
        for parameter in parameters:
            parameter.requires_grad_(not value)


def uniform_grad_flags(model: nn.Module) -> contextlib.AbstractContextManager:
    """Inside the block every floating parameter of ``model`` has ``requires_grad=True`` (the
    state a model is loaded in); afterwards each flag is as it was.

    A forward's last bits depend on these flags even under ``torch.no_grad()``: torch's matmul
    folds a 3-d input differently when the weight requires grad (``logits_to_keep=1`` slices
    give such an input), which moves logits by ~5e-7 and probabilities by ~1e-8. A plain
    ``pv.IntervenableModel`` lowers every flag of the model it wraps, so without this a trace
    of it and the same trace rerun from its spec on a freshly loaded model would differ in
    those bits. Our runs need no gradients (they run under ``no_grad``)."""
    return _flags([p for p in model.parameters()
                   if not p.requires_grad and (p.is_floating_point() or p.is_complex())], True)


def weights_without_gradients(model: nn.Module,
                              keep: bool = False) -> contextlib.AbstractContextManager:
    """Inside the block, under autograd, the model's weights record no gradient (their
    ``requires_grad`` flags lowered, and put back after), as pyvene's ``IntervenableModel``
    does for a call; ``keep``: the flags stay as they are (our attribution's forward)."""
    if keep or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    return _flags([p for p in model.parameters() if p.requires_grad], False)


@functools.cache
def intervenable_model_class():
    """The hook-preserving ``IntervenableModel`` class (built on first use: pyvene is slow
    to import)."""
    pv = import_pyvene()

    class IntervenableModel(pv.IntervenableModel):
        """``pv.IntervenableModel`` that leaves the user's model as it found it
        (docs/interventions.md, "pyvene's side effects, mended").

        A call removes only the hooks it registered (pyvene's ``_remove_forward_hooks``,
        overridden), so the model's own hooks stay, inside the call too; the parameters'
        ``requires_grad`` flags and train/eval mode stay as they were. Training is still
        pyvene's: until ``enable_model_gradients()`` only the interventions' parameters count,
        and a forward under autograd records no gradient for the model's weights;
        ``keep_model_gradients=True`` (our attribution, which differentiates by the model's
        biases) keeps their flags on during the call. It loads back with its :meth:`load`.
        (pyvene's ``train_alignment`` still calls pyvene's module-level hook removal directly.)
        Its hooks act only on the calling thread's forwards, and its setter hooks announce
        their calls (:func:`~.calls.announcing_setter`); pyvene's class is left as it is.
        """

        def __init__(self, config: Any, model: nn.Module, *,
                     keep_model_gradients: bool = False, **kwargs: Any) -> None:
            with _as_found(model):
                # before pyvene's __init__: whatever of it removes hooks removes only these
                object.__setattr__(self, "_pyvene_handles", [])
                super().__init__(config, model, **kwargs)
            self._keep_model_gradients = keep_model_gradients
            _record_registers(self, self._pyvene_handles, gate=True)
            bind_shared_state(self.interventions.values())

        def _remove_forward_hooks(self) -> None:
            _remove_handles(self._pyvene_handles)

        _intervention_setter = announcing_setter(pv.IntervenableModel._intervention_setter)

        @classmethod
        def load(cls, load_directory: str, model: nn.Module, *args: Any, **kwargs: Any):
            """pyvene's ``load`` (which builds pyvene's own class by name), giving this class."""
            with _as_found(model):
                loaded = pv.IntervenableModel.load(load_directory, model, *args, **kwargs)
            loaded.config.representations = [rep._replace(intervention=made) for rep, made in zip(
                loaded.config.representations, loaded.interventions.values(), strict=True)]
            return cls(loaded.config, model)

        # -- pyvene's training surface: the model's weights count only once enabled
        def _model_trains(self) -> bool:
            return bool(self.model_has_grad or self._keep_model_gradients)

        def get_trainable_parameters(self):
            return [p for _, p in self.named_parameters()]

        def named_parameters(self, prefix: str = "", recurse: bool = True,
                             remove_duplicate: bool = True):
            ours = [(f"{key}.{name}", p) for key, made in self.interventions.items()
                    if isinstance(made, pv.TrainableIntervention)
                    for name, p in made.named_parameters()]
            if self._model_trains():
                ours += [("model." + name, p) for name, p in self.model.named_parameters()
                         if p.requires_grad]
            return ours

        def count_parameters(self, include_model: bool = False) -> int:
            total = super().count_parameters(include_model=False)
            if include_model and self._model_trains():
                total += sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            return total

        def _pyvene_run(self, run, *args: Any, **kwargs: Any):
            """pyvene's ``run``: the model's weights record no gradient unless they train."""
            try:
                with weights_without_gradients(self.model, keep=self._model_trains()):
                    return run(*args, **kwargs)
            finally:  # pyvene removes them in its own finally: nothing should be left
                self._remove_forward_hooks()

        def forward(self, *args: Any, **kwargs: Any):
            return self._pyvene_run(super().forward, *args, **kwargs)

        def generate(self, *args: Any, **kwargs: Any):
            return self._pyvene_run(super().generate, *args, **kwargs)

    IntervenableModel.__module__ = __name__
    return IntervenableModel


def __getattr__(name: str):
    if name == "IntervenableModel":  # built on first use: it subclasses pyvene's
        return intervenable_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
