"""Spec → registered interventions → ``pv.IntervenableConfig`` → run → :class:`SpecRunResult`.

    spec = load_spec("intervention_specs/residual_trace.json")
    model, tokenizer = load_model(spec.model)
    result = run_spec(spec, model, tokenizer)
    result.to_dataframe()

The executor knows no intervention type by name. For each entry it asks the registered type
(:mod:`~pyvene_causaltrace.interventions.spec_entry`) where it acts — its sites, and whose
states (the clean run's, the corrupted run's) it needs — then makes those two runs, one forward
each, and asks the type to build one intervention per site. An entry whose type ``spec_corrupts``
(``noise_add``) makes the corrupted run; its seeds are the batch rows.

:func:`build_interventions` and :func:`to_pv_config` give the resolved interventions to compose
with yours (docs/specs.md); :func:`resolve_sites` resolves a spec's sites without running it, and
:func:`check_on_model` is everything ``validate --model`` checks. A spec's
``model_interventions`` (:mod:`~pyvene_causaltrace.model_interventions`) act in every run of
:func:`run_spec`; :func:`build_interventions`, which builds only the spec's own entries, refuses
such a spec rather than leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .arguments import checked
from .bound import BoundModel, bind
from .capture import capture
from .errors import InputError, SpecError
from .finite import check_finite
from .interventions import get_intervention
from .interventions.spec_entry import Site, SpecContext, SpecEntry, entry_of
from .model_guard import measured, measurement
from .model_interventions import describe, model_for_spec, rebuild
from .models import get_module, model_name
from .prompts import TokenizedPrompt, answer_token_id, tokenize_prompt
from .pyvene_boundary.intervenable import intervenable_model_class
from .pyvene_boundary.quiet_import import import_pyvene
from .runtime import intervened
from .specs import ExperimentSpec, load_spec
from .tracing.metrics import answer_probs, recovery
from .tracing.results import SpecRunResult
from .transcoders.formats import load_transcoder
from .transcoders.transcoder import check_fits

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer


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
    sites: list[Site]  # where each of ``interventions`` acts, in the same order

    @property
    def rows(self) -> int:
        return len(self.seeds) if self.seeds else 1

    @property
    def base_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.prompt.input_ids.repeat(self.rows, 1)}

    def to_spec(self) -> list[dict[str, Any]]:
        """Each intervention's own single-site entry (``to_spec``), in order."""
        return [made.to_spec(site) for (_, made), site in zip(self.interventions, self.sites,
                                                             strict=True)]


@measured
def resolve_sites(spec: ExperimentSpec | dict | str, model: BoundModel,
                  tokenizer: Tokenizer) -> tuple[SpecContext, list[tuple[SpecEntry, list[Site]]]]:
    """The context and each entry's (answerer, sites) of ``spec`` on ``model``; checks layers,
    positions and that every site's module exists (errors are :class:`SpecError` with the
    entry's JSON path). Runs nothing."""
    spec = spec if isinstance(spec, ExperimentSpec) else load_spec(spec)
    ctx, _, resolved = _resolve(spec, model, tokenizer)
    return ctx, resolved


def _resolve(spec: ExperimentSpec, bound: BoundModel, tokenizer
             ) -> tuple[SpecContext, list[dict[str, Any]], list[tuple[SpecEntry, list[Site]]]]:
    """:func:`resolve_sites`, with each entry as the dict its type is handed."""
    prompt = tokenize_prompt(tokenizer, spec.prompt, spec.subject, spec.subject_occurrence or 0)
    bound.check_inputs(prompt.input_ids)
    ctx = SpecContext(spec, bound, tokenizer, prompt)
    items = [item.to_dict() for item in spec.interventions]
    resolved = []
    for index, item in enumerate(items):
        entry = entry_of(get_intervention(item["type"]))
        sites = entry.spec_sites(item, index, ctx)
        for site in sites:
            _check_module(bound, site, item)
        resolved.append((entry, sites))
    return ctx, items, resolved


def check_on_model(spec: ExperimentSpec | dict | str, model: nn.Module,
                   tokenizer: Tokenizer) -> None:
    """What ``validate --model`` checks beyond the schema, without running the model: the
    subject is in the prompt, every layer, position and module of every entry exists on
    ``model``, the answer tokenizes, and an attribution spec's transcoder loads and fits."""
    spec = spec if isinstance(spec, ExperimentSpec) else load_spec(spec)
    if spec.answer is not None:
        try:
            answer_token_id(tokenizer, spec.answer, strict=spec.attribution is not None)
        except ValueError as error:
            raise SpecError("$.answer", str(error)) from None
    if spec.model_interventions:  # their classes import, their tensors read, pyvene places them
        rebuild(spec.model_interventions, model, spec.base_dir)
    if spec.attribution is None:
        try:
            resolve_sites(spec, model, tokenizer)
        except ValueError as error:  # the subject is not in the prompt
            if isinstance(error, SpecError):
                raise
            raise SpecError("$.subject" if spec.subject else "$.prompt", str(error)) from None
        return
    block = spec.attribution
    try:
        check_fits(model, load_transcoder(block["clt"], format=block.get("format")))
    except (OSError, ValueError) as error:
        raise SpecError("$.attribution.clt", str(error)) from None


def _check_module(bound: BoundModel, site: Site, item: dict) -> None:
    """A site whose module the model lacks is a :class:`SpecError` at the field that named it."""
    module_path, _, kind = site.component.rpartition(".")
    if kind not in ("input", "output"):
        raise SpecError(site.where, f"{site.component!r} must end in .output or .input")
    try:
        get_module(bound.model, module_path)
    except InputError:
        raise SpecError(site.where, f"{bound.model_type} has no module {module_path!r}"
                        + (f" (from {item['component']!r})" if "component" in item else "")
                        ) from None


@measured
def build_interventions(spec: ExperimentSpec | dict | str, model: BoundModel,
                        tokenizer: Tokenizer) -> Plan:
    """Resolve ``spec`` on ``model``: tokens, answer, the noise, and one intervention per site.

    A spec with ``model_interventions`` is refused: they act in every run (the clean and
    corrupted runs this makes too), which a plan of the spec's own entries cannot hold; run it
    with :func:`run_spec`."""
    spec = spec if isinstance(spec, ExperimentSpec) else load_spec(spec)
    if spec.model_interventions:
        raise SpecError("$.model_interventions", "build_interventions builds the spec's own "
                        "entries only, and these pyvene interventions of its model act in "
                        "every run: run the spec with run_spec, or rebuild them with "
                        "model_interventions.rebuild(spec.model_interventions, model, "
                        "spec.base_dir) and pass that IntervenableModel to run_spec or trace")
    return _plan(spec, model, tokenizer)


def _plan(spec: ExperimentSpec, model: BoundModel, tokenizer: Tokenizer) -> Plan:
    if spec.trace is not None:
        raise SpecError("$.trace", "this is a trace spec: run it with tracer_from_spec "
                        "(or `pyvene-causaltrace run`)")
    if spec.attribution is not None:
        raise SpecError("$.attribution", "an attribution spec builds a graph: use "
                        "pyvene_causaltrace.attribute or the attribute command")
    if not spec.interventions:
        raise SpecError("$.interventions", "empty: a run needs at least one intervention")
    ctx, items, resolved = _resolve(spec, model, tokenizer)
    model = ctx.bound.model
    ctx.bound.check_weights()
    ids = ctx.prompt.input_ids.to(ctx.bound.device)

    def build(index: int, states: dict[str, dict[str, torch.Tensor]]) -> list:
        entry, sites = resolved[index]
        try:
            return [entry.from_spec(items[index], site, ctx,
                                    states[site.donor][site.component] if site.donor else None)
                    for site in sites]
        except (TypeError, ValueError) as error:
            if isinstance(error, SpecError):
                raise
            raise SpecError(ctx.path(index), f"{items[index]['type']}: {error}") from None

    corrupting = [i for i, (entry, _) in enumerate(resolved) if entry.spec_corrupts]
    made = {i: build(i, {}) for i in corrupting}
    needs = {run: [s.component for _, sites in resolved for s in sites if s.donor == run]
             for run in ("clean", "corrupted")}

    # One clean forward gives the clean probabilities and every clean donor.
    box: dict[str, torch.Tensor] = {}
    clean_states = capture(model, {}, needs["clean"],
                           run=lambda: box.setdefault("logits", model(input_ids=ids).logits))
    clean_probs = box["logits"][0, -1].double().softmax(-1)
    check_finite(clean_probs, "the clean run's probabilities",
                 "the weights are finite, so the activations overflow")
    answer_id = (answer_token_id(ctx.tokenizer, spec.answer) if spec.answer is not None
                 else int(clean_probs.argmax()))
    ctx.bound.check_answer(answer_id)

    noise = [(site.component, m) for i in corrupting
             for site, m in zip(resolved[i][1], made[i], strict=True)]
    rows = max((int(getattr(m, "seeds", torch.zeros(1)).numel()) for _, m in noise), default=1)
    corrupt_states, corrupt_probs = _corrupted_run(ctx.bound, ids, noise, needs["corrupted"], rows)
    if corrupt_probs is not None:
        check_finite(corrupt_probs, "the corrupted run's probabilities", "the noise is too large")
    states = {"clean": clean_states, "corrupted": corrupt_states}
    made.update({i: build(i, states) for i in range(len(resolved)) if i not in made})

    order = corrupting + [i for i in range(len(resolved)) if i not in corrupting]
    placed = [(site, m) for i in order for site, m in zip(resolved[i][1], made[i], strict=True)]
    interventions, sites = [(site.component, m) for site, m in placed], [s for s, _ in placed]
    # what the result reports of the noise: its seeds (the batch rows), sigma and scale
    first = noise[0][1] if noise else None
    seeds = getattr(first, "seeds", None)
    settings = first.config() if hasattr(first, "config") else {}
    return Plan(spec, ctx.prompt, answer_id, ctx.tokenizer.decode([answer_id]),
                seeds.tolist() if seeds is not None else None, settings.get("sigma"),
                settings.get("scale"), clean_probs, corrupt_probs, interventions, sites)


def _corrupted_run(bound: BoundModel, ids, noise: list[tuple[str, Any]], components: list[str],
                   rows: int):
    """States of ``components`` and last-position probabilities with only the noise."""
    model = bound.model
    if not noise:
        if components:
            raise SpecError("$.interventions", "freeze of the corrupted run needs a noise_add")
        return {}, None
    inputs = {"input_ids": ids.repeat(rows, 1)}
    box: dict[str, Any] = {}

    def noised() -> None:
        with intervened(bound, [{"component": c, "intervention": m} for c, m in noise]):
            box["out"] = model(**inputs)

    states = capture(model, inputs, components, run=noised)
    return states, box["out"].logits[:, -1].double().softmax(-1).cpu()


def to_pv_config(plan: Plan):
    """A ``pv.IntervenableConfig`` holding the plan's intervention instances."""
    pv = import_pyvene()
    return pv.IntervenableConfig(
        [{"component": component, "intervention": made} for component, made in plan.interventions]
    )


def build_intervenable(spec: ExperimentSpec | dict | str, model: nn.Module, tokenizer: Tokenizer):
    """``(IntervenableModel, plan)`` for ``spec``; call it with ``base=plan.base_inputs``."""
    plan = build_interventions(spec, model, tokenizer)
    return intervenable_model_class()(to_pv_config(plan), model), plan


@checked
@torch.no_grad()
def run_spec(spec: ExperimentSpec | dict | str, model: nn.Module,
             tokenizer: Tokenizer) -> SpecRunResult:
    """Run a spec: clean, noise-only (if noised) and intervened probabilities of the answer.

    ``model`` may be a ``pv.IntervenableModel``: its interventions then act in every run
    (:func:`~pyvene_causaltrace.model_guard.measurement`), and the result's spec
    carries them (``model_interventions``; refused, before running, if it cannot). A spec with
    ``model_interventions`` rebuilds them around the bare ``model``. The result's spec names the
    model it ran on (``model_name``; no ``model`` when that is unknown), not the spec's."""
    spec = spec if isinstance(spec, ExperimentSpec) else load_spec(spec)
    bound = model_for_spec(spec, bind(model, interventions=True))
    entries = describe(bound)
    with measurement(bound) as model:
        plan = _plan(spec, bound, tokenizer)
        base = {k: v.to(bound.device) for k, v in plan.base_inputs.items()}
        representations = [{"component": c, "intervention": m} for c, m in plan.interventions]
        with intervened(bound, representations):
            out = model(**base)
    probs = answer_probs(out.logits, plan.answer_id).cpu()
    check_finite(probs, "the intervened run's probabilities")
    clean = float(plan.clean_probs[plan.answer_id])
    if plan.corrupt_probs is not None:
        corrupt = plan.corrupt_probs[:, plan.answer_id]
        rec = recovery(probs, corrupt, clean)
    else:
        corrupt = torch.full_like(probs, clean)
        rec = torch.full_like(probs, float("nan"))
    # the model it ran on (as Tracer.spec names it), not the one the spec named
    written = replace(plan.spec, model=model_name(bound.model) or None,
                      model_interventions=None).to_dict()
    if entries:  # what the model held, inline (a file reference belongs to the spec's folder)
        written["model_interventions"] = entries
    return SpecRunResult(
        spec=written,
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


__all__ = ["Plan", "build_intervenable", "build_interventions", "check_on_model",
           "resolve_sites", "run_spec", "to_pv_config"]
