"""What pyvene 0.1.8 needs around it on transformers 5.

- :func:`import_pyvene` imports pyvene without its import-time ``print``.
- :func:`register_architectures` adds the architectures our adapters support but pyvene's
  tables lack (Qwen3, Gemma-3 text), reusing the entries of their closest relative.
- pyvene hands an intervention only the module's output; :func:`hooked_call` finds the module
  and its inputs in the hook frame that calls it (``frozen_layernorm``, ``frozen_attention``).
- pyvene removes *every* forward hook on the model before and after each call, including
  transformers 5's output-capturing hooks (``output_hidden_states`` then returns nothing) and any
  hook the user registered. :func:`preserve_hooks` puts them back; :class:`IntervenableModel` is
  ``pv.IntervenableModel`` with that done around every call, and without switching the user's
  model to ``requires_grad=False``.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


def hooked_call() -> tuple[nn.Module, tuple, dict]:
    """The module, positional and keyword inputs of the pyvene forward hook calling the caller.

    pyvene 0.1.x hands an intervention only the module's output; its hook closure
    (``hook_callback(model, args, kwargs, output)``) holds the module and its inputs, a few
    frames up the stack.
    """
    frame = sys._getframe(1)
    for _ in range(14):
        if frame is None:
            break
        if frame.f_code.co_name == "hook_callback" and "args" in frame.f_locals:
            local = frame.f_locals
            if local.get("output") is not None:
                return local["model"], tuple(local["args"]), dict(local.get("kwargs") or {})
        frame = frame.f_back
    raise RuntimeError(
        "frozen_layernorm / frozen_attention must run on a module's output inside a pyvene "
        "IntervenableModel"
    )


def import_pyvene():
    """``import pyvene`` with its import-time print about nnsight swallowed."""
    with contextlib.redirect_stdout(io.StringIO()):
        import pyvene
    register_architectures()
    return pyvene


_registered = False


def register_architectures() -> None:
    """Teach pyvene the architectures its 0.1.8 wheel does not know (idempotent)."""
    global _registered
    if _registered:
        return
    import transformers.models as hf

    with contextlib.redirect_stdout(io.StringIO()):
        from pyvene.models import intervenable_modelcard as card
    # (module, our class, pyvene-known relative class) -- same module layout and dimensions
    pairs = [
        ("qwen3", "Qwen3ForCausalLM", "qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3Model", "qwen2", "Qwen2Model"),
        ("gemma3", "Gemma3ForCausalLM", "gemma2", "Gemma2ForCausalLM"),
        ("gemma3", "Gemma3TextModel", "gemma2", "Gemma2Model"),
    ]
    for module, name, relative_module, relative_name in pairs:
        ours = getattr(getattr(getattr(hf, module, None), f"modeling_{module}", None), name, None)
        theirs = getattr(getattr(hf, relative_module), f"modeling_{relative_module}")
        theirs = getattr(theirs, relative_name)
        if ours is None:  # an older transformers without this architecture
            continue
        card.type_to_module_mapping.setdefault(ours, card.type_to_module_mapping[theirs])
        card.type_to_dimension_mapping.setdefault(ours, card.type_to_dimension_mapping[theirs])
    _registered = True


def snapshot_hooks(model: nn.Module) -> list[tuple[dict, dict]]:
    """Copies of every module's forward and pre-forward hook dicts."""
    return [
        (getattr(module, name), dict(getattr(module, name)))
        for module in model.modules()
        for name in _HOOK_DICTS
    ]


def restore_hooks(snapshot: list[tuple[dict, dict]]) -> None:
    """Put back every hook of ``snapshot`` that has gone, in its original order.

    The dicts are mutated in place so that the hooks' ``RemovableHandle``\\ s stay valid.
    """
    for live, saved in snapshot:
        if all(key in live for key in saved):
            continue
        extra = {k: v for k, v in live.items() if k not in saved}
        live.clear()
        live.update(saved)
        live.update(extra)


@contextlib.contextmanager
def preserve_hooks(model: nn.Module) -> Iterator[None]:
    """Run a block that may call pyvene; afterwards the model has all its earlier hooks back.

    >>> with preserve_hooks(model):                                       # doctest: +SKIP
    ...     pv_model(base=inputs)
    """
    snapshot = snapshot_hooks(model)
    try:
        yield
    finally:
        restore_hooks(snapshot)


def _make_intervenable_class():
    pv = import_pyvene()
    from pyvene.models.modeling_utils import remove_forward_hooks

    class IntervenableModel(pv.IntervenableModel):
        """``pv.IntervenableModel`` that leaves the user's model as it found it.

        pyvene strips every hook on the model around each call and sets all parameters to
        ``requires_grad=False``. This subclass keeps the hooks that were there before the call
        (inside the call too, so ``output_hidden_states`` works in an intervened run) and
        restores the parameters' ``requires_grad`` flags and train/eval mode after construction.
        Saved with ``save()``, it loads back with plain ``pv.IntervenableModel.load``.
        """

        def __init__(self, config: Any, model: nn.Module, **kwargs: Any) -> None:
            flags = [(p, p.requires_grad) for p in model.parameters()]
            training = model.training
            with preserve_hooks(model):
                super().__init__(config, model, **kwargs)
            for parameter, flag in flags:
                parameter.requires_grad_(flag)
            model.train(training)
            self._hook_snapshot: list | None = None

        def _remove_forward_hooks(self) -> None:
            remove_forward_hooks(self.model)
            if getattr(self, "_hook_snapshot", None) is not None:
                restore_hooks(self._hook_snapshot)

        def forward(self, *args: Any, **kwargs: Any):
            self._hook_snapshot = snapshot_hooks(self.model)
            try:
                return super().forward(*args, **kwargs)
            finally:
                restore_hooks(self._hook_snapshot)
                self._hook_snapshot = None

    IntervenableModel.__module__ = __name__
    return IntervenableModel


_intervenable_class = None


def intervenable_model_class():
    """The hook-preserving ``IntervenableModel`` class (built on first use: pyvene is slow
    to import)."""
    global _intervenable_class
    if _intervenable_class is None:
        _intervenable_class = _make_intervenable_class()
    return _intervenable_class


def __getattr__(name: str):
    if name == "IntervenableModel":  # built on first use: it subclasses pyvene's
        return intervenable_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------- a user's IntervenableModel


def is_intervenable(model: object) -> bool:
    """Whether ``model`` is a pyvene ``IntervenableModel`` (pyvene's or ours)."""
    return any(klass.__name__ == "IntervenableModel" and
               klass.__module__.startswith(("pyvene.", __name__))
               for klass in type(model).__mro__) and hasattr(model, "interventions")


def accepts_intervenable(function):
    """Let ``function(model, ...)`` take a pyvene ``IntervenableModel`` as ``model``: it runs on
    the wrapped model with the wrapper's interventions applied (:func:`applied_interventions`)."""
    import functools

    @functools.wraps(function)
    def wrapper(model, *args, **kwargs):
        with applied_interventions(model) as inner:
            return function(inner, *args, **kwargs)

    return wrapper


def _needs_source(intervention: nn.Module) -> bool:
    return not getattr(intervention, "is_source_constant", False)


@contextlib.contextmanager
def applied_interventions(model: nn.Module) -> Iterator[nn.Module]:
    """Yield the model to run: ``model`` itself, or — for a pyvene ``IntervenableModel`` — the
    model it wraps with the wrapper's interventions applied to every forward inside the block.

    They act at every position (as with ``unit_locations=None``) in every run our calls make —
    clean, corrupted and intervened alike — so a trace or a graph is one *of the intervened
    model*. An intervention that needs a source at call time (``VanillaIntervention``, a restore
    without stored states) is refused with :class:`~pyvene_causaltrace.models.PyveneModelError`:
    our runs have no source to give it. The hooks are gone when the block ends.
    """
    if not is_intervenable(model):
        yield model
        return
    from .models import PyveneModelError

    needy = [key for key, made in model.interventions.items() if _needs_source(made)]
    if needy:
        raise PyveneModelError(
            f"this IntervenableModel's {', '.join(needy)} need a source at call time; our runs "
            "(clean, corrupted, restored) have none to give. Pass pv_model.model, or keep in "
            "the IntervenableModel only interventions that hold their own values (zero, "
            "constant, noise_add, restores with states)")
    handles = []
    try:
        for key, made in model.interventions.items():
            register = model.intervention_hooks[key]
            handles.append(register(_hook(made, register.__name__ == "register_forward_pre_hook")))
        yield model.model
    finally:
        for handle in handles:
            handle.remove()


def _hook(intervention: nn.Module, pre: bool):
    def apply(value):
        if isinstance(value, tuple):
            return (intervention(value[0], None), *value[1:])
        return intervention(value, None)

    if pre:
        return lambda module, args: (apply(args[0]), *args[1:]) if args else None
    return lambda module, args, output: apply(output)
