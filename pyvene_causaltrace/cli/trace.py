"""``trace``, ``run``, ``validate`` and ``interventions``: causal traces and specs."""

from __future__ import annotations

from pathlib import Path

from ..atomic import replacing, write_text
from ..errors import CausalTraceError, InputError
from ..execute import check_on_model, run_spec
from ..interventions import get_intervention, list_interventions
from ..models import OFFLINE_DEFAULT, load_model
from ..specs import load_spec
from ..tracing.engine import get_kind
from ..tracing.faithfulness import FAITHFUL_KINDS, trace_faithfulness
from ..tracing.settings import TraceFaithfulnessSettings, TraceSettings
from ..tracing.tracer import Tracer, tracer_from_spec
from .common import fact_default, number_or_name, out_dir, resolve_device, settings_of


def trace_command(args) -> int:
    out_dir(args.out)
    device = resolve_device(args.device)
    faith = faithfulness_settings(args)  # refused before the model loads
    if args.spec is not None:
        return trace_spec(args.spec, args.model, args.out, args.budget_mb, args.controls,
                          progress=not args.no_progress, device=device, faithfulness=faith)
    kinds = [k.strip() for k in args.kind.split(",")]
    for kind in kinds:  # every flag before the model loads
        get_kind(kind)
        check_faithful(kind, faith)
    settings = trace_settings(args)
    model, tokenizer = load_model(args.model or OFFLINE_DEFAULT, device=device)
    tracer = Tracer(model, tokenizer, args.prompt, args.subject,
                    answer=fact_default("answer", args.prompt, args.answer), settings=settings)
    return report_traces(tracer, kinds, settings.window, args.out, args.controls,
                         progress=not args.no_progress, faithfulness=faith)


#: The ``--faithfulness`` flags that are :class:`~..tracing.settings.TraceFaithfulnessSettings`'
#: fields (``trace``, ``dataset``): argparse dest -> field.
TRACE_FAITH_FLAGS = {"faith_sizes": "sizes", "faith_top": "top", "faith_draws": "draws",
                     "faith_seed": "seed", "faith_rows": "rows_per_forward",
                     "faith_cells": "cells"}


def faithfulness_settings(args) -> TraceFaithfulnessSettings | None:
    """The faithfulness settings the flags ask for (None without ``--faithfulness``),
    checked before anything loads."""
    if not args.faithfulness:
        return None
    values = {field: getattr(args, dest) for dest, field in TRACE_FAITH_FLAGS.items()}
    for dest, kind in (("faith_sizes", float), ("faith_top", int)):
        try:
            values[TRACE_FAITH_FLAGS[dest]] = tuple(
                kind(v) for v in str(getattr(args, dest)).split(","))
        except ValueError:
            raise InputError(f"--{dest.replace('_', '-')}: give numbers separated by commas, "
                             f"got {getattr(args, dest)!r}") from None
    return settings_of(TraceFaithfulnessSettings, values, TRACE_FAITH_FLAGS)


def check_faithful(kind: str, faithfulness: TraceFaithfulnessSettings | None) -> None:
    if faithfulness is not None and kind not in FAITHFUL_KINDS:
        raise InputError(f"--faithfulness: a {kind} trace holds a sublayer at every layer; "
                         f"faithfulness reads the {', '.join(FAITHFUL_KINDS)} traces")


#: The ``trace`` flags that are :class:`~..tracing.settings.TraceSettings`' fields:
#: argparse dest -> field (the other flags: the spec, the model, the prompt and its
#: answer, the kinds, the controls and the output).
TRACE_FLAGS = {"seeds": "seeds", "scale": "scale", "sigma": "sigma", "window": "window",
               "budget_mb": "memory_budget_mb"}


def trace_settings(args) -> TraceSettings:
    """The :class:`~..tracing.settings.TraceSettings` the flags ask for (checked: a flag it
    refuses is refused before the model loads, naming the flag)."""
    given = {field: getattr(args, dest) for dest, field in TRACE_FLAGS.items()}
    given.update(scale=number_or_name(args.scale), sigma=number_or_name(args.sigma))
    return settings_of(TraceSettings, given, TRACE_FLAGS)


def trace_spec(path: Path, model_name: str | None, out: Path | None, budget_mb: float,
               controls: bool, *, device: str, progress: bool = True,
               faithfulness: TraceFaithfulnessSettings | None = None) -> int:
    spec = load_spec(path)
    if spec.trace is not None:
        check_faithful(spec.trace["kind"], faithfulness)
    model, tokenizer = load_model(model_name or spec.model or OFFLINE_DEFAULT, device=device)
    tracer = tracer_from_spec(spec, model, tokenizer, memory_budget_mb=budget_mb)
    window = spec.trace.get("window", TraceSettings.window)
    return report_traces(tracer, [spec.trace["kind"]], window, out, controls, progress=progress,
                         faithfulness=faithfulness)


def report_traces(tracer, kinds: list[str], window: int, out: Path | None,
                  controls: bool, *, progress: bool = True,
                  faithfulness: TraceFaithfulnessSettings | None = None) -> int:
    """Run ``kinds`` on ``tracer``: progress bar, terminal table (every layer, the sites'
    peaks marked), JSON and PNG under ``out``; with ``faithfulness``, each trace's curves."""
    if tracer.sweep is not None:
        print(tracer.sweep.summary() + "\n")
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        result = tracer.trace(kind, window=window, progress=progress)
        print(result.summary())
        print(result.table(layers_down=True))
        print()
        if out:
            write_text(result.to_json(), out / f"trace_{kind}.json")
            with replacing(out / f"trace_{kind}.png") as tmp:
                result.plot(str(tmp))
            print(f"wrote {out / f'trace_{kind}.json'} and .png\n")
        if faithfulness is not None:
            curve = trace_faithfulness(tracer, result, settings=faithfulness)
            print(curve.text() + "\n")
            if out:
                curve.to_json(out / f"faithfulness_{kind}.json")
                with replacing(out / f"faithfulness_{kind}.csv") as tmp:
                    curve.to_dataframe().to_csv(tmp, index=False)
                with replacing(out / f"faithfulness_{kind}.png") as tmp:
                    curve.plot(str(tmp))
                print(f"wrote {out / f'faithfulness_{kind}.json'}, .csv and .png\n")
    if controls:
        report = tracer.controls(window=window)
        print(report.summary())
        if not report.passed:
            return 1
    return 0


def run_command(args) -> int:
    out_dir(args.out)
    device = resolve_device(args.device)
    spec = load_spec(args.spec)
    if spec.trace is not None:
        return trace_spec(args.spec, args.model, args.out, budget_mb=TraceSettings.memory_budget_mb,
                          controls=False, device=device)
    if spec.attribution is not None:
        raise InputError(f"{args.spec} is an attribution spec: run "
                         f"pyvene-causaltrace attribute --spec {args.spec} --out DIR")
    model, tokenizer = load_model(args.model or spec.model or OFFLINE_DEFAULT, device=device)
    result = run_spec(spec, model, tokenizer)
    print(result.summary())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(result.to_json(), args.out / "result.json")
        print(f"wrote {args.out / 'result.json'}")
    return 0


def validate_command(args) -> int:
    loaded = None if args.model is None else load_model(
        args.model, device=resolve_device(args.device))
    failed = 0
    for path in args.specs:
        try:
            spec = load_spec(path)
            if loaded is not None:
                check_on_model(spec, *loaded)
            print(f"ok      {path}" + (f" (on {args.model})" if loaded else ""))
        except (CausalTraceError, OSError) as error:
            failed += 1
            print(f"invalid {path}: {error}")
    return 1 if failed else 0


def interventions_command(args) -> int:
    for name in list_interventions():
        cls = get_intervention(name)
        print(f"{name:<18} {cls.__module__}.{cls.__qualname__}")
    return 0
