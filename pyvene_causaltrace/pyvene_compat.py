"""What pyvene 0.1.8 needs around it on transformers 5.

- :func:`import_pyvene` imports pyvene without its import-time ``print``.
- :func:`register_architectures` adds the architectures our adapters support but pyvene's
  tables lack (Qwen3, Gemma-3 text), reusing the entries of their closest relative.
- pyvene hands an intervention only the module's output; :func:`pyvene_call` (and
  :func:`hooked_call`) give the module, its inputs and the call's ``unit_locations``
  (``frozen_layernorm``, ``frozen_attention``, positions in ``generate``), announced by a
  wrapper around each hook pyvene registers: :func:`import_pyvene` wraps
  ``pv.IntervenableModel._intervention_setter`` once (:func:`announce_setter_calls`), so every
  ``IntervenableModel`` — a user's plain one, ours, one loaded by pyvene — announces its calls.
  Nothing reads a frame.
- pyvene removes *every* forward hook on the model before and after each call (its
  ``_remove_forward_hooks``), including transformers 5's output-capturing hooks
  (``output_hidden_states`` then returns nothing) and any hook the user registered.
  :class:`IntervenableModel` is ``pv.IntervenableModel`` whose calls remove only the hooks they
  registered — so the others are never taken off — and that leaves the user's model's
  ``requires_grad`` flags as they were. The hooks it registers act only on the forwards of the
  thread that calls it (:func:`~pyvene_causaltrace.hooking.gated`). :func:`preserve_hooks` does
  the same for a block of calls of a plain ``pv.IntervenableModel``. Nothing here writes torch's
  hook tables: hooks are added through the modules' ``register_*`` methods and removed through
  their handles.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .applier import Edit, Site, applying
from .errors import InputError, PyveneModelError
from .hooking import register, release
from .models import ADAPTERS, is_intervenable


@dataclass(frozen=True)
class PyveneCall:
    """What pyvene's hook knows about the call of an intervention and does not pass it.

    ``module``, ``args``, ``kwargs``: the hooked module and its inputs; ``unit_locations``: this
    intervention's base locations in this call (None: every position); ``owner``: the
    ``IntervenableModel``; ``key``: the intervention's key in it.
    """

    module: nn.Module
    args: tuple
    kwargs: dict
    unit_locations: Any
    owner: Any
    key: str

    @property
    def generating(self) -> bool:
        """Inside ``IntervenableModel.generate``."""
        return bool(getattr(self.owner, "_is_generation", False))

    @property
    def generation_round(self) -> object:
        """An object that is the same for every step of one ``generate`` call and new for the
        next: pyvene replaces its hook counters at the start of each call."""
        return getattr(self.owner, "_key_setter_call_counter", None)


#: The call of the pyvene setter hook running now in this context, as the hook wrapper of our
#: ``IntervenableModel`` (and of :func:`preserve_hooks`) announces it; None outside one.
_CALL: contextvars.ContextVar[PyveneCall | None] = contextvars.ContextVar("pvct_pyvene_call",
                                                                          default=None)


@contextlib.contextmanager
def calling(call: PyveneCall) -> Iterator[None]:
    """Inside the block :func:`pyvene_call` returns ``call``: for a hook runner that applies
    an intervention itself (:func:`~pyvene_causaltrace.runtime.intervened`)."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


def pyvene_call() -> PyveneCall | None:
    """The :class:`PyveneCall` of the pyvene setter hook that is calling the caller, or None
    outside one (a direct call).

    pyvene 0.1.8 hands an intervention only the (gathered) output — ``as_adaptor`` adds the
    gathered positional input, never the module or its keyword inputs — and its hook closure
    (``hook_callback(model, args, kwargs, output)`` in ``_intervention_setter``) holds the rest.
    Each such hook is wrapped when pyvene registers it (:func:`announce_setter_calls`): the
    wrapper has the module and its inputs as arguments and the rest in the hook's closure, and
    sets them in a context variable for the hook's run. ``tests/test_pyvene_setter.py`` fails,
    naming pyvene's version, if pyvene moves them.
    """
    return _CALL.get()


def _closure(fn) -> dict[str, Any]:
    """The variables ``fn`` closes over, by name (those bound now)."""
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    found = {}
    for name, cell in cells.items():
        try:
            found[name] = cell.cell_contents
        except ValueError:  # not bound yet
            continue
    return found


def _announcing(hook):
    """pyvene's setter ``hook_callback(model, args, kwargs[, output])``, run with its
    :class:`PyveneCall` set for :func:`pyvene_call`; any other hook as it is."""
    code = getattr(hook, "__code__", None)
    if (getattr(hook, "_pvct_announced", False)
            or getattr(hook, "__name__", "") != "hook_callback" or code is None
            or not {"unit_locations_base", "key_i"} <= set(code.co_freevars)):
        return hook

    def announced(module, args, kwargs, *output):
        scope = _closure(hook)
        call = PyveneCall(module, tuple(args), dict(kwargs or {}),
                          scope["unit_locations_base"][scope["key_i"]], scope.get("self"),
                          scope.get("key", ""))
        token = _CALL.set(call)
        try:
            return hook(module, args, kwargs, *output)
        finally:
            _CALL.reset(token)

    announced.__name__ = announced.__qualname__ = hook.__name__
    announced._pvct_announced = True
    return announced


class _AnnouncingRegister:
    """A register method of ``intervention_hooks`` whose setter hooks announce their calls
    (:func:`_announcing`); ``__self__`` and ``__name__`` are the wrapped method's."""

    def __init__(self, register_method) -> None:
        self.register = register_method
        self.__self__ = getattr(register_method, "__self__", None)
        self.__name__ = getattr(register_method, "__name__", "register")

    def __call__(self, hook, *args: Any, **kwargs: Any):
        return self.register(_announcing(hook), *args, **kwargs)


def _setter_announcing(setter):
    """pyvene's ``IntervenableModel._intervention_setter``, with the register methods of the
    keys it sets wrapped for its run (:class:`_AnnouncingRegister`) and put back after."""

    @functools.wraps(setter)
    def _intervention_setter(self, keys, *args: Any, **kwargs: Any):
        hooks = self.intervention_hooks
        saved = {key: hooks[key] for key in keys if callable(hooks.get(key))}
        hooks.update({key: _AnnouncingRegister(method) for key, method in saved.items()})
        try:
            return setter(self, keys, *args, **kwargs)
        finally:
            hooks.update(saved)

    _intervention_setter._pvct_announcing = True
    return _intervention_setter


def announce_setter_calls(pv) -> None:
    """Make every ``pv.IntervenableModel``'s setter hooks announce their calls to
    :func:`pyvene_call` (idempotent; :func:`import_pyvene` calls it). The one change this
    package makes to a pyvene class: a wrapper around ``_intervention_setter`` that leaves its
    arguments, results and the hooks' behaviour as they are."""
    klass = pv.IntervenableModel
    if not getattr(klass._intervention_setter, "_pvct_announcing", False):
        klass._intervention_setter = _setter_announcing(klass._intervention_setter)


def hooked_call() -> tuple[nn.Module, tuple, dict]:
    """The module, positional and keyword inputs of the pyvene forward hook calling the caller
    (``frozen_layernorm``, ``frozen_attention``: they recompute the module)."""
    call = pyvene_call()
    if call is None:
        raise RuntimeError(
            "frozen_layernorm / frozen_attention must run on a module's output inside a pyvene "
            "IntervenableModel")
    return call.module, call.args, call.kwargs


def import_pyvene():
    """``import pyvene`` with its import-time print about nnsight swallowed."""
    with contextlib.redirect_stdout(io.StringIO()):
        import pyvene  # pyvene prints on import: only import_pyvene() imports it, quietly
    register_architectures()
    announce_setter_calls(pyvene)
    return pyvene


_registered = False


def register_architectures() -> None:
    """Teach pyvene the architectures its 0.1.8 wheel does not know (idempotent)."""
    global _registered
    if _registered:
        return
    import transformers.models as hf  # transformers is slow to import: it loads when a model does

    with contextlib.redirect_stdout(io.StringIO()):
        # pyvene prints on import: loaded here, its output swallowed
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


class _RecordedRegister:
    """A module's ``register_forward_hook`` / ``register_forward_pre_hook`` as pyvene keeps it
    in ``intervention_hooks``, with each handle it returns noted in ``handles`` so that the
    hooks pyvene registered — and only those — can be removed. ``gate``: each hook acts only
    on the registering thread's forwards (:func:`~pyvene_causaltrace.hooking.register`; our
    :class:`IntervenableModel`), or — a user's plain ``pv.IntervenableModel`` in
    :func:`preserve_hooks` — registered as pyvene would. ``__self__`` and ``__name__`` are the
    bound method's."""

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


def bind_shared_state(pv_model) -> None:
    """Let the interventions of ``pv_model`` that share state by id (a splice built one by one,
    or loaded) bind it among themselves: a class that shares so defines a class method
    ``bind_shared(interventions)`` (:meth:`~.interventions.splice_session.SpliceIntervention.
    bind_shared`), called once with all of the model's interventions."""
    made = list(pv_model.interventions.values())
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
def uniform_grad_flags(model: nn.Module) -> Iterator[None]:
    """Inside the block every floating parameter of ``model`` has ``requires_grad=True`` (the
    state a model is loaded in); afterwards each flag is as it was.

    A forward's last bits depend on these flags even under ``torch.no_grad()``: torch's matmul
    folds a 3-d input differently when the weight requires grad (``logits_to_keep=1`` slices
    give such an input), which moves logits by ~5e-7 and probabilities by ~1e-8. A plain
    ``pv.IntervenableModel`` lowers every flag of the model it wraps, so without this a trace
    of it and the same trace rerun from its spec on a freshly loaded model would differ in
    those bits. Our runs need no gradients (they run under ``no_grad``)."""
    lowered = [p for p in model.parameters()
               if not p.requires_grad and (p.is_floating_point() or p.is_complex())]
    for parameter in lowered:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in lowered:
            parameter.requires_grad_(False)


@contextlib.contextmanager
def weights_without_gradients(model: nn.Module, keep: bool = False) -> Iterator[None]:
    """Inside the block, under autograd, the model's weights record no gradient (their
    ``requires_grad`` flags lowered, and put back after), as pyvene's ``IntervenableModel``
    does for a call; ``keep``: the flags stay as they are (our attribution's forward)."""
    if keep or not torch.is_grad_enabled():
        yield
        return
    lowered = [p for p in model.parameters() if p.requires_grad]
    for parameter in lowered:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in lowered:
            parameter.requires_grad_(True)


def _make_intervenable_class():
    pv = import_pyvene()

    class IntervenableModel(pv.IntervenableModel):
        """``pv.IntervenableModel`` that leaves the user's model as it found it.

        pyvene strips every hook on the model around each call and sets all parameters to
        ``requires_grad=False`` (and the model to eval mode). In this subclass a call removes
        only the hooks it registered (pyvene's ``_remove_forward_hooks``, overridden; each hook
        it registers is noted, through its handle), so the hooks that were on the model stay on
        it, inside the call too (``output_hidden_states`` works in an intervened run); and the
        parameters' ``requires_grad`` flags and train/eval mode stay as they were. Training is
        still pyvene's: unless ``enable_model_gradients()`` was called,
        ``get_trainable_parameters()``, ``named_parameters()`` and ``count_parameters()`` hold
        only the interventions' parameters, and a forward under autograd records no gradient
        for the model's weights (their flags are lowered for the call and put back after).
        ``keep_model_gradients=True`` (our attribution, which differentiates by the model's
        biases) keeps the flags on during the call too. Saved with ``save()``, it loads back
        with plain ``pv.IntervenableModel.load``. (pyvene's ``train_alignment`` still calls
        pyvene's module-level hook removal directly, on every hook.)

        Its hooks act only on the forwards of the thread that called it: a forward of the
        wrapped model from another thread meanwhile sees the bare model.
        """

        def __init__(self, config: Any, model: nn.Module, *,
                     keep_model_gradients: bool = False, **kwargs: Any) -> None:
            flags = [(p, p.requires_grad) for p in model.parameters()]
            training = model.training
            # before pyvene's __init__: whatever of it removes hooks removes only these
            object.__setattr__(self, "_pyvene_handles", [])
            super().__init__(config, model, **kwargs)
            for parameter, flag in flags:
                parameter.requires_grad_(flag)
            model.train(training)
            self._keep_model_gradients = keep_model_gradients
            _record_registers(self, self._pyvene_handles, gate=True)
            bind_shared_state(self)

        def _remove_forward_hooks(self) -> None:
            _remove_handles(self._pyvene_handles)

        # -- pyvene's training surface: the model's weights count only once enabled
        def _model_trains(self) -> bool:
            return bool(self.model_has_grad or self._keep_model_gradients)

        def get_trainable_parameters(self):
            ours = [p for made in self.interventions.values()
                    if isinstance(made, pv.TrainableIntervention) for p in made.parameters()]
            if self._model_trains():
                ours += [p for p in self.model.parameters() if p.requires_grad]
            return ours

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

        def _pyvene_gradients(self):
            """The model's weights record no gradient in this call unless they train."""
            return weights_without_gradients(self.model, keep=self._model_trains())

        def forward(self, *args: Any, **kwargs: Any):
            try:
                with self._pyvene_gradients():
                    return super().forward(*args, **kwargs)
            finally:  # pyvene removes them in its own finally: nothing should be left
                self._remove_forward_hooks()

        def generate(self, *args: Any, **kwargs: Any):
            try:
                with self._pyvene_gradients():
                    return super().generate(*args, **kwargs)
            finally:
                self._remove_forward_hooks()

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


def _needs_source(intervention: nn.Module) -> bool:
    return not getattr(intervention, "is_source_constant", False)


#: Why pyvene's NoiseIntervention cannot act where we apply a type at every position.
NOISE_INTERVENTION_REFUSAL = (
    "pyvene's NoiseIntervention adds a fixed draw for exactly 4 positions (seed 1, GPT-2-XL's "
    "noise level), and {where} applies it at every position: use noise_add (NoiseAdd) for "
    "seeded noise at chosen positions")


def _refusal(key: str, made: nn.Module, representation: Any) -> str | None:
    """Why our runs cannot apply the user's intervention ``key`` as pyvene would, or None."""
    if isinstance(made, import_pyvene().NoiseIntervention):
        return f"{key}: " + NOISE_INTERVENTION_REFUSAL.format(where="each of our runs")
    if "h" in str(getattr(representation, "unit", "pos") or "pos").split("."):
        return (f"{key}: unit {representation.unit!r} picks heads through unit_locations, which "
                "our runs cannot give (they apply your interventions at every position, where "
                "pyvene hands the whole module output). Put the head edit in a hand hook on "
                "pv_model.model, or run it with pv_model yourself")
    return None


def _is_collect(made: nn.Module) -> bool:
    pv = import_pyvene()
    return isinstance(made, pv.CollectIntervention)


def _residual_norm_names(model: nn.Module) -> set[str]:
    """Module names of the norms that read the residual stream inside the blocks (each
    block's pre-attention and pre-MLP norm), from the adapter table's row for the model (no
    row: none; such a model is refused with its architecture later)."""
    row = ADAPTERS.get(getattr(model.config, "model_type", None))
    if row is None:
        return set()
    n_layers = int(getattr(model.config, row.n_layers_key))
    return {row.module_path(part, layer).replace("[", ".").replace("]", "")
            for layer in range(n_layers) for part in ("pre_attn_norm", "pre_mlp_norm")}


def _shared_input_refusal(key: str, register: Any, shared: set[str],
                          model: nn.Module) -> str | None:
    """Why a user's edit of a residual norm's *input* cannot run in our runs, or None.

    pyvene writes an input edit in place into the module's first argument. A block's norm
    may read the residual stream tensor itself (Llama's do), and then the edit also reaches
    the skip path around the sublayer; our runs replace the norm's input (and a trace replays
    stored block outputs that an in-place write would alter), so they would compute another
    model than pyvene's. Which tensors alias is the architecture code's business, so every
    residual norm's input edit is refused rather than possibly silently different."""
    if getattr(register, "__name__", "") != "register_forward_pre_hook":
        return None
    module = getattr(register, "__self__", None)
    name = next((n for n, m in model.named_modules() if m is module), "")
    if name not in shared:
        return None
    return (f"{key}: edits the input of {name}, a norm that reads the residual stream: pyvene "
            "writes such an edit in place into the tensor the norm reads, in some "
            "architectures the residual stream itself (the skip path around the sublayer "
            "then sees it too), which our runs do not reproduce. Put the edit "
            "on the block's input or output (block_input / block_output), or on the norm's "
            "output")


def user_edits(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """``(key, intervention, representation)`` of a pyvene ``IntervenableModel`` that act on
    the output, in pyvene's order; refuses (``PyveneModelError``) any our runs cannot apply."""
    needy = [key for key, made in model.interventions.items() if _needs_source(made)]
    if needy:
        raise PyveneModelError(
            f"this IntervenableModel's {', '.join(needy)} need a source at call time; our runs "
            "(clean, corrupted, restored) have none to give. Pass pv_model.model, or keep in "
            "the IntervenableModel only interventions that hold their own values (zero, "
            "constant, noise_add, restores with states)")
    edits = []
    shared = _residual_norm_names(model.model)
    for key, made in model.interventions.items():
        representation = model.representations.get(key)
        reason = _refusal(key, made, representation) or _shared_input_refusal(
            key, model.intervention_hooks.get(key), shared, model.model)
        if reason is not None:
            raise PyveneModelError(reason)
        if not _is_collect(made):  # collecting changes nothing
            edits.append((key, made, representation))
    return edits


def apply_like_pyvene(intervention: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``intervention`` at every position of ``value`` as pyvene 0.1.8 applies it with
    ``unit_locations=None`` — on a clone of the tensor, through ``do_intervention`` — but
    returned as a new tensor: ``value`` itself (which may be an upstream module's output) is
    never written."""
    # pyvene is imported on first use (5 s): the package and the CLI's --help stay light
    from pyvene.models.interventions import InterventionOutput
    from pyvene.models.modeling_utils import do_intervention  # the same reason

    edited = do_intervention(value.clone(), None, intervention, None)
    if isinstance(edited, InterventionOutput):
        edited = edited.output
    if edited.shape != value.shape:
        raise InputError(f"{type(intervention).__name__} returned {tuple(edited.shape)} for an "
                         f"output of {tuple(value.shape)}")
    return edited


@contextlib.contextmanager
def applied_interventions(model: nn.Module) -> Iterator[nn.Module]:
    """Yield the model to run: ``model`` itself, or — for a pyvene ``IntervenableModel`` — the
    model it wraps with the wrapper's interventions applied to every forward inside the block.

    They act at every position (as with ``unit_locations=None``) in every run our calls make —
    clean, corrupted and intervened alike — so a trace or a graph is one *of the intervened
    model*. Each is applied as pyvene applies it (:func:`apply_like_pyvene`: on a clone), and
    the module's input or output is replaced, never written in place. Refused with
    :class:`~pyvene_causaltrace.errors.PyveneModelError`: an intervention that needs a source
    at call time (``VanillaIntervention``, ``SkipIntervention``, a restore without stored
    states) — our runs have no source to give it; head units (they need ``unit_locations``);
    pyvene's ``NoiseIntervention`` (a 4-position draw). ``CollectIntervention`` changes nothing
    and is left out. The hooks are gone when the block ends. Inside :func:`collect_steering`
    (the attribution graph's forward) each edit also routes its constant part ``f(0)`` through a
    gradient leaf, the value unchanged: the graph's steering nodes.
    """
    if not is_intervenable(model):
        yield model
        return
    edits = user_edits(model)
    bind_shared_state(model)
    names = {module: name for name, module in model.model.named_modules()}
    hooks = []
    for key, made, representation in edits:
        register = model.intervention_hooks[key]  # pyvene's: the module's bound register method
        pre = register.__name__ == "register_forward_pre_hook"
        module = register.__self__
        site = SteeringSite(key, type(made).__name__,
                            str(getattr(representation, "component", "")),
                            names.get(module, ""), pre)
        # a residual-stream input is refused above (_shared_input_refusal): never one here
        hooks.append(Edit(Site(module, "input" if pre else "output"), _edit(made, site),
                          group="user"))
    with applying(model.model, hooks):
        yield model.model


# ------------------------------------------------------- steering: a user edit's constant part


@dataclass(frozen=True)
class SteeringSite:
    """Where a user's intervention acts: its key in the ``IntervenableModel``, class name,
    pyvene component, the hooked module's name in the wrapped model and whether it edits the
    module's input (a pre-hook)."""

    key: str
    intervention: str
    component: str
    module: str
    pre: bool

    @property
    def layer(self) -> int | None:
        """The block index in the module's name (``model.layers.1.mlp`` -> 1), None outside
        the blocks (embeddings, final norm)."""
        numbers = [int(part) for part in self.module.split(".") if part.isdigit()]
        return numbers[0] if numbers else None

    def describe(self) -> dict:
        return {"key": self.key, "class": self.intervention, "component": self.component,
                "module": self.module, "layer": self.layer, "input": self.pre}


@dataclass
class SteeringLeaf:
    """The constant part ``c = f(0)`` of one call of a user's intervention ``f`` during a
    :func:`collect_steering` block, as a gradient leaf ``[1, P, D]`` (or whatever the edited
    tensor's shape): the edited value is ``f(x) + (leaf - leaf.detach())`` — exactly ``f(x)``,
    with the output's gradient on the leaf, so ``leaf * grad`` is the edit's constant's
    contribution. Calls whose constant is zero (``ZeroIntervention``) are recorded too, for
    ``reached``, and are never nodes.

    ``reached`` (set by the caller after the forward, None until then): whether the logits'
    gradient reaches the leaf — False when the edit ran where no gradient is recorded, or
    when the output it edits is replaced downstream by something that detaches it (then
    ``leaf`` is set to None: its constant cannot be a node)."""

    site: SteeringSite
    leaf: torch.Tensor | None
    value: torch.Tensor
    reached: bool | None = None

    @property
    def is_zero(self) -> bool:
        return not bool(self.value.ne(0).any())

    @property
    def positions(self) -> torch.Tensor:
        """Positions (axis 1) where the constant is nonzero."""
        flat = self.value.reshape(self.value.shape[0], self.value.shape[1], -1) \
            if self.value.dim() >= 2 else self.value.reshape(1, -1, 1)
        return (flat != 0).any(-1).any(0).nonzero().squeeze(-1)


_STEERING: contextvars.ContextVar[list | None] = contextvars.ContextVar("pvct_steering",
                                                                       default=None)


@contextlib.contextmanager
def collect_steering() -> Iterator[list[SteeringLeaf]]:
    """Inside the block, every call of a user's intervention applied by
    :func:`applied_interventions` appends a :class:`SteeringLeaf` (its constant part ``c =
    f(0)``) to the yielded list and, where a gradient is recorded, routes its value through the
    leaf (the attribution graph's steering nodes; a zero ``c`` is never a node). Outside such a
    block the hooks apply ``f`` and nothing else (``f(0)`` is not even computed). Each
    intervention is affine in its input for the interventions our runs accept — zero, addition,
    subtraction, a constant source, ``noise_add``, restores with states: ``f(x) = A x + c`` — so
    the leaf holds all of the edit that is not a path from ``x``."""
    collected: list[SteeringLeaf] = []
    token = _STEERING.set(collected)
    try:
        yield collected
    finally:
        _STEERING.reset(token)


def _edit(intervention: nn.Module, site: SteeringSite | None = None):
    """The :mod:`~.applier` edit of a user's intervention (a new value: the applier's rule)."""
    def steer(value: torch.Tensor, _call=None) -> torch.Tensor:
        edited = apply_like_pyvene(intervention, value)
        collected = _STEERING.get()
        if collected is None or site is None:
            return edited
        with torch.no_grad():
            constant = apply_like_pyvene(intervention, torch.zeros_like(value)).detach()
        if not torch.is_grad_enabled():  # inside a module whose output is recomputed
            collected.append(SteeringLeaf(site, None, constant, reached=False))
            return edited
        leaf = constant.clone().requires_grad_(True)
        collected.append(SteeringLeaf(site, leaf, constant))
        return edited + (leaf - leaf.detach())
    return steer
