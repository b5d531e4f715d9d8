"""A user's own pyvene interventions in a spec: the ``model_interventions`` field, so a spec
written from a run on a ``pv.IntervenableModel`` repeats it bit for bit on the bare model.

    entries = describe(bind(pv_model, interventions=True))   # [] for a bare model
    pv_model = rebuild(entries, model, base_dir)

One entry per intervention, in pyvene's order, tensors inline or in a safetensors file beside
the spec (:mod:`~pyvene_causaltrace.spec_tensors`; the format: docs/specs.md). :func:`describe`
writes an intervention only when rebuilding it gives back the same module bit for bit, else
refuses saying why; :func:`rebuild` imports only ``pyvene.Intervention`` subclasses."""

from __future__ import annotations

import copy
import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .bound import BoundModel
from .errors import PyveneModelError, SpecError, UnknownInterventionError
from .interventions import get_intervention, list_interventions
from .interventions.base import CausalTraceIntervention
from .models import is_intervenable
from .pyvene_boundary.intervenable import intervenable_model_class
from .pyvene_boundary.quiet_import import import_pyvene
from .pyvene_boundary.user_edits import user_edits
from .spec_tensors import ENTRY_PATH, decode_tensor, digest, encode_tensor, inline

#: pyvene ``RepresentationConfig`` fields an entry carries (where set): where it acts.
REPRESENTATION_FIELDS = ("component", "layer", "unit", "max_number_of_units",
                         "low_rank_dimension", "subspace_partition", "group_key",
                         "intervention_link_key", "moe_key", "latent_dim")

_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
#: Our types keep their state in ``_config`` and their state dict; their other private
#: attributes are live objects or caches (a transcoder or splice session given as an object —
#: the state holds its source path and session id —, a generation counter, cached noise), and
#: ``leaf`` is one run's tensor.
_OURS_TRANSIENT = frozenset({"leaf"})


def _refuse(message: str) -> PyveneModelError:
    return PyveneModelError(message + ". The spec a trace or run_spec writes must reproduce "
                            "the run, so this model is refused: keep the intervention's state "
                            "in the buffers, parameters and JSON attributes of an importable "
                            "pyvene.Intervention subclass")


# ----------------------------------------------------------------------------- describe

def describe(bound: BoundModel) -> list[dict[str, Any]]:
    """The ``model_interventions`` entries of the pyvene ``IntervenableModel`` ``bound`` was
    bound from (``[]`` for a plain model): every intervention our runs apply, in pyvene's
    order. Refuses (``PyveneModelError``) an intervention our runs cannot apply or a spec
    cannot rebuild exactly, saying why."""
    return [_describe_one(key, made, representation)
            for key, made, representation in user_edits(bound)]


def _class_path(key: str, made: nn.Module) -> str:
    ours = _registered_name(made)
    if ours is not None:
        return ours
    cls = type(made)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if "<locals>" in cls.__qualname__:
        raise _refuse(f"{key}: {name} is defined inside a function, so no other process can "
                      "import it; define it at a module's top level")
    if cls.__module__ == "__main__":
        raise _refuse(f"{key}: {cls.__qualname__} is defined in __main__ (a script), so no "
                      "other process can import it; move it into an importable module")
    try:
        found = _import_class(name)
    except ImportError as error:
        raise _refuse(f"{key}: {name} cannot be imported again ({error})") from None
    if found is not cls:
        raise _refuse(f"{key}: {name} imports as another class than the one in this model "
                      "(a class made at run time?)")
    return name


def _registered_name(made: nn.Module) -> str | None:
    """Our registered name for one of our own types (or a plugin type on our base)."""
    if not isinstance(made, CausalTraceIntervention) or not made.registered_name:
        return None
    try:
        registered = get_intervention(made.registered_name)
    except (UnknownInterventionError, NotImplementedError):
        return None
    return made.registered_name if isinstance(made, registered) else None


def _json_value(value: Any) -> bool:
    """Whether ``value`` is JSON data that reads back as itself (no tuples, NaN, objects)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_json_value(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_value(v) for k, v in value.items())
    return False


def _as_json(key: str, what: str, value: Any) -> Any:
    if hasattr(value, "__index__") and not isinstance(value, (bool, torch.Tensor)):
        value = int(value.__index__())  # numpy integers
    if not _json_value(value):
        raise _refuse(f"{key}: {what} is {value!r} ({type(value).__name__}), which is not JSON "
                      "data (lists, numbers, strings, booleans, null)")
    return copy.deepcopy(value)


def _describe_one(key: str, made: nn.Module, representation: Any) -> dict[str, Any]:
    pv = import_pyvene()
    if not isinstance(made, pv.Intervention):
        raise _refuse(f"{key}: a {type(made).__name__} is not a pyvene Intervention (a plain "
                      "function holds no state a spec can carry)")
    if made._forward_hooks or made._forward_pre_hooks:
        raise _refuse(f"{key}: the intervention has forward hooks of its own")
    head: dict[str, Any] = {"class": _class_path(key, made)}  # then "init", then the state
    for name in REPRESENTATION_FIELDS:
        value = getattr(representation, name, None)
        if value is not None:
            head[name] = _as_json(key, f"its representation's {name}", value)
    ours = _registered_name(made) is not None
    settings: dict[str, Any] = {}
    tensor_attributes: dict[str, Any] = {}
    for name, value in _attributes(made, ours).items():
        if ours and name == "_config":
            continue  # our types keep their configuration in their state dict
        if isinstance(value, torch.Tensor):
            tensor_attributes[name] = _encode(key, f"attribute {name!r}", value)
        else:
            settings[name] = _as_json(key, f"attribute {name!r}", value)
    settings["training"] = made.training
    state = {"settings": settings,
             "tensors": {name: _encode(key, f"state {name!r}", tensor)
                         for name, tensor in made.state_dict().items()},
             **({"tensor_attributes": tensor_attributes} if tensor_attributes else {})}
    # rebuild it from the entry; write the entry only if that gives the same module back
    reasons = []
    for init in _init_candidates(made, representation):
        trial = {**head, **({"init": init} if init else {}), **state}
        try:
            rebuilt = _build(trial, key, None)
        except (SpecError, TypeError, ValueError, RuntimeError, AttributeError, KeyError
                ) as error:
            reasons.append(f"rebuilding it with {init or 'no arguments'} failed: {error}")
            continue
        difference = _difference(made, rebuilt, ours)
        if difference is None:
            return trial
        reasons.append(difference)
    raise _refuse(f"{key}: {head['class']} cannot be rebuilt from what a spec holds "
                  f"(its class, constructor keywords, JSON attributes and tensors): "
                  f"{reasons[-1]}")


def _encode(key: str, what: str, tensor: torch.Tensor) -> dict[str, Any]:
    try:
        return encode_tensor(tensor)
    except ValueError as error:
        raise _refuse(f"{key}: {what}: {error}") from None


def _init_candidates(made: nn.Module, representation: Any) -> list[dict[str, Any]]:
    """Constructor keywords to try: the fewest first (``embed_dim`` when it has one), then
    what pyvene passes when it builds a class (the representation's fields too)."""
    embed = getattr(made, "embed_dim", None)
    minimal = {"embed_dim": int(embed)} if isinstance(embed, torch.Tensor) else {}
    pyvene_style = {name: getattr(representation, name) for name in REPRESENTATION_FIELDS
                    if getattr(representation, name, None) is not None
                    and _json_value(getattr(representation, name))}
    pyvene_style.update(minimal)
    pyvene_style["use_fast"] = bool(getattr(made, "use_fast", False))
    return [minimal, pyvene_style]


# ----------------------------------------------------------------------------- compare

def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and digest(a) == digest(b)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and _same_tensor(a, b))
    if _json_value(a) and _json_value(b):
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == raises is not the same
        return False


def _attributes(module: nn.Module, ours: bool) -> dict[str, Any]:
    """``module``'s attributes past ``nn.Module``'s; of our types, not those that are no state
    (``_OURS_TRANSIENT``, and the private ones but ``_config``)."""
    return {name: value for name, value in vars(module).items()
            if name not in _MODULE_INTERNALS and not (ours and (
                name in _OURS_TRANSIENT or (name.startswith("_") and name != "_config")))}


def _difference(made: nn.Module, rebuilt: nn.Module, ours: bool) -> str | None:
    """Why ``rebuilt`` is not ``made`` (None: the same, bit for bit)."""
    # ours: ``made`` may be a ``configured`` subclass of the registered class
    if not (isinstance(made, type(rebuilt)) if ours else type(made) is type(rebuilt)):
        return f"it rebuilt as a {type(rebuilt).__name__}"
    if ours and getattr(made, "_config", {}).get("source", "-") is None \
            and made.__dict__.get("_clt_object") is not None:
        return "its transcoder was given as an object, not a path or hub id a spec can name"
    state, again = made.state_dict(), rebuilt.state_dict()
    if list(state) != list(again):
        return f"its state dict keys {list(state)} came back as {list(again)}"
    for name, tensor in state.items():
        if not _same_tensor(tensor, again[name]):
            return f"its state {name!r} came back different"
    mine, theirs = dict(made.named_modules()), dict(rebuilt.named_modules())
    if list(mine) != list(theirs):
        return f"its submodules {list(mine)} came back as {list(theirs)}"
    for path, module in mine.items():
        other = theirs[path]
        where = f"{path}." if path else ""
        if type(module).__name__ != type(other).__name__:
            return f"submodule {path!r} came back as a {type(other).__name__}"
        for kind, get in (("buffer", "named_buffers"), ("parameter", "named_parameters")):
            a = dict(getattr(module, get)(recurse=False))
            b = dict(getattr(other, get)(recurse=False))
            if list(a) != list(b):
                return f"its {kind}s {where}{list(a)} came back as {list(b)}"
            for name, tensor in a.items():
                if not _same_tensor(tensor, b[name]):
                    return (f"{kind} {where}{name} is not in its state dict (persistent=False?) "
                            "and its constructor does not make it again")
        a, b = _attributes(module, ours), _attributes(other, ours)
        if path == "":
            a["training"], b["training"] = module.training, other.training
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b or not _same_value(a[name], b[name]):
                return (f"attribute {where}{name} = {a.get(name, '<absent>')!r} came back as "
                        f"{b.get(name, '<absent>')!r}")
    return None


# ----------------------------------------------------------------------------- rebuild

def _import_class(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module prefix, then attributes."""
    import_pyvene()  # pyvene's own import prints; this swallows it
    parts = path.split(".")
    if any(not part or part.startswith("_") for part in parts):
        raise ImportError(f"{path!r}: a private or special name is not an intervention class")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not (module_name == error.name or
                                               module_name.startswith(error.name + ".")):
                raise  # the module exists but something it imports does not
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(f"no module of {path!r} can be imported")


def resolve_class(name: str, where: str) -> type:
    """The intervention class an entry's ``class`` names: a registered name of ours, or an
    import path. Anything that is not a ``pyvene.Intervention`` subclass is refused."""
    pv = import_pyvene()
    if not isinstance(name, str) or not name:
        raise SpecError(where, "expected a registered intervention name or an import path")
    if "." not in name:
        try:
            found = get_intervention(name)
        except (UnknownInterventionError, NotImplementedError):
            raise SpecError(where, f"{name!r} is no registered intervention type (registered: "
                            f"{', '.join(list_interventions())}); another class is named by "
                            "its import path, e.g. 'pyvene.models.interventions."
                            "ZeroIntervention'") from None
    else:
        try:
            found = _import_class(name)
        except (ImportError, AttributeError) as error:
            raise SpecError(where, f"cannot import {name!r}: {error} (install or import the "
                            "package that defines it)") from None
    if not (isinstance(found, type) and issubclass(found, pv.Intervention)):
        raise SpecError(where, f"{name!r} is not a pyvene Intervention subclass; a spec's "
                        "model interventions are rebuilt only from those")
    return found


def _build(entry: dict[str, Any], where: str, base_dir: str | Path | None) -> nn.Module:
    """One intervention instance from its entry (on the CPU)."""
    cls = resolve_class(entry["class"], where + ".class")
    init = entry.get("init", {})
    try:
        made = cls(**copy.deepcopy(init))
    except Exception as error:  # noqa: BLE001 - a user's constructor may raise anything
        raise SpecError(where + (".init" if init else ".class"),
                        f"{entry['class']}(**{init}) failed: {error}") from None
    state = {name: decode_tensor(encoded, f"{where}.tensors.{name}", base_dir)
             for name, encoded in entry.get("tensors", {}).items()}
    fresh = made.state_dict()
    for name, tensor in state.items():
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = made.get_submodule(owner_path) if owner_path else made
        except AttributeError:
            raise SpecError(f"{where}.tensors.{name}", f"{entry['class']} has no submodule "
                            f"{owner_path!r}") from None
        if name not in fresh:  # a buffer given after construction (a constant source)
            if leaf in owner.__dict__:
                delattr(owner, leaf)
            owner.register_buffer(leaf, tensor)
        elif leaf in owner._buffers and owner._buffers[leaf] is not None:
            owner._buffers[leaf] = tensor  # its own shape and dtype, not the constructor's
    settings = dict(entry.get("settings", {}))
    made.train(bool(settings.pop("training", True)))
    for name, value in settings.items():
        setattr(made, name, copy.deepcopy(value))
    for name, encoded in entry.get("tensor_attributes", {}).items():
        setattr(made, name, decode_tensor(encoded, f"{where}.tensor_attributes.{name}",
                                          base_dir))
    try:
        made.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:
        raise SpecError(where + ".tensors", f"{entry['class']} does not take this state: "
                        f"{str(error).strip().splitlines()[0]}") from None
    return made


def rebuild(entries: list[dict[str, Any]], model: nn.Module, base_dir: str | Path | None = None,
            *, path: str = ENTRY_PATH):
    """A hook-preserving ``IntervenableModel`` (:func:`~pyvene_causaltrace.pyvene_boundary.
    intervenable.intervenable_model_class`) holding ``entries``' interventions around the bare
    ``model``. File references are relative to ``base_dir`` (the spec file's folder). Errors
    are :class:`SpecError` at the entry's JSON path."""
    if is_intervenable(model):
        raise PyveneModelError("rebuild needs the bare model (pv_model.model), not an "
                               "IntervenableModel")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    built, representations = [], []
    for index, entry in enumerate(entries):
        made = _build(entry, f"{path}[{index}]", base_dir).to(device)
        built.append(made)
        representations.append({**{name: copy.deepcopy(entry[name])
                                   for name in REPRESENTATION_FIELDS if name in entry},
                                "intervention": made})
    try:
        pv_model = intervenable_model_class()(representations, model)
    except (ValueError, KeyError, AttributeError, IndexError, TypeError) as error:
        raise SpecError(path, f"pyvene cannot place these interventions on a "
                        f"{type(model).__name__}: {error}") from None
    for made, entry in zip(built, entries, strict=True):
        if "use_fast" in entry.get("settings", {}):  # pyvene sets its own on every instance
            made.use_fast = entry["settings"]["use_fast"]
    return pv_model


def model_for_spec(spec: Any, bound: BoundModel) -> BoundModel:
    """The bound model to run ``spec`` on: ``bound`` itself, or — when the spec carries
    ``model_interventions`` — carrying an ``IntervenableModel`` that rebuilds them around its
    model. A given ``IntervenableModel`` holding other interventions than the spec's is refused
    (which set would be meant?); one holding exactly the spec's is used as it is."""
    entries = getattr(spec, "model_interventions", None)
    if not entries:
        return bound
    base_dir = getattr(spec, "base_dir", None)
    if bound.carries_interventions and len(bound.given.interventions):
        if describe(bound) != inline(list(entries), base_dir):
            raise PyveneModelError(
                f"this spec carries {len(entries)} pyvene intervention(s) of its model "
                f"($.model_interventions) and the model given is an IntervenableModel "
                f"holding {len(bound.given.interventions)} other(s): which set is meant is "
                "ambiguous. Pass the bare model (pv_model.model) to rerun the spec's, or "
                "drop model_interventions from the spec to run yours")
        return bound
    return bound.carrying(rebuild(list(entries), bound.model, base_dir))


__all__ = ["describe", "model_for_spec", "rebuild", "resolve_class"]
