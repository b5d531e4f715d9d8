"""Spec → registered interventions → ``pv.IntervenableConfig`` → run → :class:`SpecRunResult`.

    spec = load_spec("intervention_specs/residual_trace.json")
    model, tokenizer = load_model(spec.model)
    result = run_spec(spec, model, tokenizer)
    result.to_dataframe()

For composing a spec with other pyvene interventions, :func:`build_interventions` returns the
resolved ``(component, intervention)`` pairs and :func:`to_pv_config` a ``pv.IntervenableConfig``
(its representations hold the intervention instances); add yours to it and build
``IntervenableModel(config, model)``. Batch rows are the noise seeds: feed ``plan.base_inputs``.

The clean run (for restore donors and the clean probability) and the noise-only run (for
``freeze`` of the corrupted run and the corrupted probability) are one forward each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..capture import capture
from ..defaults import NOISE_SCALE
from ..interventions import get_intervention
from ..interventions.frozen import FrozenLayerNorm
from ..interventions.noise import NoiseAdd, seed_list
from ..interventions.restore import CleanRestore, Freeze, WindowRestore, window_layers
from ..locations import component_layers, component_path, resolve_layers, resolve_positions
from ..models import get_adapter, get_module
from ..prompts import TokenizedPrompt, answer_token_id, tokenize_prompt
from ..pyvene_compat import import_pyvene, intervenable_model_class
from ..specs import ExperimentSpec, InterventionSpec, SpecError, load_spec
from .metrics import answer_probs, recovery
from .noise_scale import resolve_sigma
from .results import SpecRunResult

_SUBLAYER_COMPONENT = {"mlp": "mlp_output", "attn": "attn_output"}
_NORM_PART = {"pre_attn": "pre_attn_norm", "pre_mlp": "pre_mlp_norm", "final": "final_norm"}


@dataclass
class Plan:
    """A spec resolved against one model and tokenizer."""

    spec: ExperimentSpec
    prompt: TokenizedPrompt
    answer_id: int
    answer: str
    seeds: list[int] | None
    sigma: float | None
    scale: float | None
    clean_probs: torch.Tensor  # [vocab] float64 at the last position
    corrupt_probs: torch.Tensor | None  # [rows, vocab] float64 with only the noise
    interventions: list[tuple[str, Any]]  # (pyvene component, intervention instance)
    noise: tuple[str, NoiseAdd] | None

    @property
    def rows(self) -> int:
        return len(self.seeds) if self.seeds else 1

    @property
    def base_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.prompt.input_ids.repeat(self.rows, 1)}


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@dataclass(frozen=True)
class _Site:
    """One spec entry at one layer: where it acts and at which positions."""

    item: InterventionSpec
    layer: int | None
    component: str
    positions: list[int]

    @property
    def donor_run(self) -> str | None:
        """Which run's states this site needs: ``"clean"``, ``"corrupted"`` or none."""
        if self.item.type in ("clean_restore", "window_restore"):
            return "clean"
        if self.item.type == "freeze":
            return self.item.get("run", "corrupted")
        return None


def build_interventions(spec: ExperimentSpec | dict | str, model: nn.Module, tokenizer) -> Plan:
    """Resolve ``spec`` on ``model``: tokens, answer, sigma, and one intervention per site."""
    spec = spec if isinstance(spec, ExperimentSpec) else load_spec(spec)
    if spec.trace is not None:
        raise SpecError("$.trace", "this is a trace spec: run it with tracer_from_spec "
                        "(or `pyvene-causaltrace run`)")
    adapter = get_adapter(model)
    prompt = tokenize_prompt(tokenizer, spec.prompt, spec.subject, spec.subject_occurrence or 0)
    ids = prompt.input_ids.to(_device(model))
    sites = _sites(spec, prompt, adapter, adapter.n_layers(model))
    _check_modules(spec, sites, model)

    # One clean forward gives the clean probabilities and every clean donor.
    box: dict[str, torch.Tensor] = {}
    clean_states = capture(
        model, {}, [s.component for s in sites if s.donor_run == "clean"],
        run=lambda: box.setdefault("logits", model(input_ids=ids).logits),
    )
    clean_probs = box["logits"][0, -1].double().softmax(-1)
    answer_id = (answer_token_id(tokenizer, spec.answer) if spec.answer is not None
                 else int(clean_probs.argmax()))

    noise, seeds, sigma, scale = _noise(spec, prompt, adapter, model, tokenizer)
    corrupt_states, corrupt_probs = _corrupted_run(
        model, ids, noise, [s.component for s in sites if s.donor_run == "corrupted"], seeds)
    donors = {"clean": clean_states, "corrupted": corrupt_states}

    interventions = ([noise] if noise else []) + [
        (site.component, _make(site, donors)) for site in sites]
    for index, item in enumerate(spec.interventions):
        if item.type == "frozen_layernorm":
            interventions.extend(_frozen_norms(item, adapter, adapter.n_layers(model), index))
        if item.type == "clt_splice":
            interventions.extend(_clt_splice(spec, item, model, index))
    return Plan(spec, prompt, answer_id, tokenizer.decode([answer_id]), seeds, sigma, scale,
                clean_probs, corrupt_probs, interventions, noise)


def _sites(spec: ExperimentSpec, prompt, adapter, n_layers: int) -> list[_Site]:
    sites = []
    for index, item in enumerate(spec.interventions):
        path = f"$.interventions[{index}]"
        if item.type in ("noise_add", "frozen_layernorm", "clt_splice", "feature_ablate"):
            continue
        positions = resolve_positions(item.get("positions", "all"), prompt, path + ".positions")
        if item.type == "window_restore":
            center = resolve_layers(item.get("center"), n_layers, path + ".center")[0]
            component = _SUBLAYER_COMPONENT[item.get("sublayer")]
            layers = window_layers(center, item.get("window"), n_layers)
        else:
            component = item.get("component", "block_output")
            default = "all" if item.type == "freeze" else None
            layers = component_layers(component, item.get("layers", default), n_layers, path)
        sites.extend(_Site(item, layer, component_path(component, layer, adapter), positions)
                     for layer in layers)
    return sites


def _check_modules(spec: ExperimentSpec, sites: list[_Site], model: nn.Module) -> None:
    """A site whose module the model lacks is a :class:`SpecError` at its entry's path."""
    for site in sites:
        module_path, _, kind = site.component.rpartition(".")
        try:
            get_module(model, module_path)
        except (AttributeError, IndexError, TypeError):
            index = next(i for i, item in enumerate(spec.interventions) if item is site.item)
            raise SpecError(f"$.interventions[{index}].component",
                            f"{model.config.model_type} has no module {module_path!r} "
                            f"(from {site.item.get('component')!r})") from None
        if kind not in ("input", "output"):
            index = next(i for i, item in enumerate(spec.interventions) if item is site.item)
            raise SpecError(f"$.interventions[{index}].component",
                            f"{site.component!r} must end in .output or .input")


def _noise(spec: ExperimentSpec, prompt, adapter, model, tokenizer):
    """``((component, NoiseAdd) | None, seeds, sigma, scale)`` for the spec's noise entry."""
    item = spec.noise
    if item is None:
        return None, None, None, None
    path = f"$.interventions[{spec.interventions.index(item)}]"
    try:
        seeds = seed_list(item.get("seeds"))
    except (TypeError, ValueError) as error:
        raise SpecError(path + ".seeds", str(error)) from None
    try:
        _, sigma = resolve_sigma(item.get("sigma", "rome"), model, tokenizer, spec.subject)
    except ValueError as error:
        raise SpecError(path + ".sigma", str(error)) from None
    scale = float(item.get("scale", NOISE_SCALE))
    positions = resolve_positions(item.get("positions", "subject"), prompt, path + ".positions")
    noise = NoiseAdd(seeds=seeds, positions=positions, scale=scale, sigma=sigma,
                     distribution=item.get("distribution", "gaussian"))
    return (component_path("embed", None, adapter), noise), seeds, sigma, scale


def _make(site: _Site, donors: dict[str, dict[str, torch.Tensor]]):
    item = site.item
    states = donors[site.donor_run][site.component] if site.donor_run else None
    if item.type == "clean_restore":
        return CleanRestore(positions=site.positions, states=states)
    if item.type == "window_restore":
        return WindowRestore(positions=site.positions, states=states,
                             sublayer=item.get("sublayer"), window_layer=site.layer,
                             center=item.get("center"), window=item.get("window"))
    if item.type == "freeze":
        return Freeze(positions=site.positions, states=states, run=site.donor_run)
    # a third-party registered type
    return get_intervention(item.type)(positions=site.positions, **item.get("params", {}))


def _clt_splice(spec: ExperimentSpec, item, model, index: int) -> list[tuple[str, Any]]:
    from ..interventions.clt_splice import clt_splice_representations, resolve_transcoder

    path = f"$.interventions[{index}]"
    try:
        clt = resolve_transcoder(item.get("clt"))
    except (OSError, ValueError) as error:
        raise SpecError(path + ".clt", str(error)) from None
    layers = resolve_layers(item.get("layers", "all"), clt.n_layers, path + ".layers")
    ablations = [{k: v for k, v in entry.to_dict().items() if k != "type"}
                 for entry in spec.interventions if entry.type == "feature_ablate"]
    reps = clt_splice_representations(
        clt, model, layers=layers, from_position=item.get("from_position", 1),
        add_error=item.get("add_error", False), ablations=ablations)
    return [(rep["component"], rep["intervention"]) for rep in reps]


def _frozen_norms(item, adapter, n_layers: int, index: int) -> list[tuple[str, Any]]:
    path = f"$.interventions[{index}]"
    layers = resolve_layers(item.get("layers", "all"), n_layers, path + ".layers")
    out = []
    for norm in item.get("norms", list(_NORM_PART)):
        module_paths = ([adapter.final_norm] if norm == "final"
                        else [adapter.module_path(_NORM_PART[norm], layer) for layer in layers])
        out.extend((p + ".output", FrozenLayerNorm(kind=adapter.norm_kind)) for p in module_paths)
    return out


def _corrupted_run(model, ids, noise, components: list[str], seeds):
    """States of ``components`` and last-position probabilities with only the noise."""
    if noise is None:
        if components:
            raise SpecError("$.interventions", "freeze of the corrupted run needs a noise_add")
        return {}, None
    pv_model = intervenable_model_class()(
        [{"component": noise[0], "intervention": noise[1]}], model
    )
    inputs = {"input_ids": ids.repeat(len(seeds), 1)}
    box: dict[str, Any] = {}
    states = capture(model, inputs, components,
                     run=lambda: box.setdefault("out", pv_model(base=inputs)[1]))
    return states, box["out"].logits[:, -1].double().softmax(-1).cpu()


def to_pv_config(plan: Plan):
    """A ``pv.IntervenableConfig`` holding the plan's intervention instances."""
    pv = import_pyvene()
    return pv.IntervenableConfig(
        [{"component": component, "intervention": made} for component, made in plan.interventions]
    )


def build_intervenable(spec: ExperimentSpec | dict | str, model: nn.Module, tokenizer):
    """``(IntervenableModel, plan)`` for ``spec``; call it with ``base=plan.base_inputs``."""
    plan = build_interventions(spec, model, tokenizer)
    return intervenable_model_class()(to_pv_config(plan), model), plan


@torch.no_grad()
def run_spec(spec: ExperimentSpec | dict | str, model: nn.Module, tokenizer) -> SpecRunResult:
    """Run a spec: clean, noise-only (if noised) and intervened probabilities of the answer."""
    if isinstance(spec, ExperimentSpec) and spec.attribution is not None:
        raise ValueError("an attribution spec builds a graph: use "
                         "pyvene_causaltrace.attribution.attribute or the attribute command")
    pv_model, plan = build_intervenable(spec, model, tokenizer)
    device = _device(model)
    base = {k: v.to(device) for k, v in plan.base_inputs.items()}
    _, out = pv_model(base=base)
    probs = answer_probs(out.logits, plan.answer_id).cpu()
    clean = float(plan.clean_probs[plan.answer_id])
    if plan.corrupt_probs is not None:
        corrupt = plan.corrupt_probs[:, plan.answer_id]
        rec = recovery(probs, corrupt, clean)
    else:
        corrupt = torch.full_like(probs, clean)
        rec = torch.full_like(probs, float("nan"))
    return SpecRunResult(
        spec=plan.spec.to_dict(),
        tokens=list(plan.prompt.tokens),
        subject_range=plan.prompt.subject_range,
        answer=plan.answer,
        answer_id=plan.answer_id,
        seeds=plan.seeds,
        sigma=plan.sigma,
        scale=plan.scale,
        clean_prob=clean,
        corrupt_probs=corrupt.tolist(),
        intervened_probs=probs.tolist(),
        recovery=rec.tolist(),
        components=[component for component, _ in plan.interventions],
    )
