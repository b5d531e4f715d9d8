"""Settings shared by the commands: the default fact, and small argument helpers."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Annotated, TypeVar

from ..arguments import Pattern, PositiveInt, Seed, flag
from ..errors import InputError

T = TypeVar("T")

EIFFEL = {
    "prompt": "The Eiffel Tower is in the city of",
    "subject": "The Eiffel Tower",
    "answer": " Paris",
}


#: ``--device``'s values: the CPU, CUDA (the current device, or device N), Apple's MPS, or
#: ``auto`` (CUDA when available, else the CPU). The parser checks the form only (it imports no
#: torch); whether the device exists is :func:`resolve_device`'s, in the handler.
DEVICE_CHOICES = "cpu, cuda, cuda:N, mps or auto"
Device = Annotated[str, Pattern(r"cpu|cuda(:\d+)?|mps|auto", f"one of {DEVICE_CHOICES}")]


def resolve_device(name: str) -> str:
    """``--device`` as the loaders take it: :func:`~..models.resolve_device`, its refusal
    naming the flag."""
    from ..models import resolve_device as resolve  # imports torch: the handler's, not --help's

    return resolve(name, "--device ")


def fact_default(key: str, prompt: str | None, given: str | None) -> str | None:
    """``given``, or else the default fact's ``key`` when ``prompt`` is the default prompt."""
    return EIFFEL[key] if given is None and prompt == EIFFEL["prompt"] else given


def number_or_name(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def settings_of(cls: type[T], values: dict[str, object], flags: dict[str, str]) -> T:
    """``cls(**values)``, a settings object built from flags (``flags``: argparse dest ->
    field); a refusal that opens with a field's name is prefixed with that field's flag."""
    try:
        return cls(**values)
    except InputError as error:
        by_field = {field: "--" + dest.replace("_", "-") for dest, field in flags.items()}
        first = re.match(r"\w+", str(error))
        flag = by_field.get(first.group(0)) if first else None
        if flag is None:
            raise
        raise InputError(f"{flag}: {error}") from None


def out_dir(path: Path | None) -> Path | None:
    """``--out``, refused early when it names a file."""
    if path is not None and path.exists() and not path.is_dir():
        raise InputError(f"--out {path} is a file; give a directory")
    return path


_TRACE_FAITH_HELP = ("also each trace's top cells restored together in the noised run "
                     "(sufficiency) and noised in the clean run (necessity), beside random "
                     "cells; CPR and CMD")
#: ``dataset --faithfulness``: the faithfulness of everything the run builds.
_DATASET_FAITH_HELP = (
    "measure the faithfulness of everything the run builds: each traced kind's curves "
    "(residual, mlp, attn; the --faith-* flags) in faithfulness.jsonl/.json/.csv, and with "
    "--graphs each graph's curve too (MIB's f(k), CPR, CMD; as `evaluate`, with its flags) in "
    "its graphs.jsonl row, CPR and CMD per fact and their mean in aggregate.json; --ablation "
    "counterfactual patches from the next kept fact of the same length in tokens (another "
    "answer: the foil); mean and zero need --metric prob or kl")


def trace_faithfulness_flags(parser: argparse.ArgumentParser, given: dict,
                             dataset: bool = False) -> None:
    """``--faithfulness`` and its settings (``trace``, ``dataset``; ``given``: the parser's
    ``defaults.TRACE_FAITH``): docs/tracing.md, "Faithfulness"; ``dataset``'s also sets the
    graphs' curves (docs/datasets.md)."""
    parser.add_argument("--faithfulness", action="store_true",
                        help=_DATASET_FAITH_HELP if dataset else _TRACE_FAITH_HELP)
    group = parser.add_argument_group("trace faithfulness" if dataset else "faithfulness",
                                      "with --faithfulness")
    for name, default, extra, text in (
            ("sizes", ",".join(f"{s:g}" for s in given["sizes"]), {},
             "circuit sizes, percent of the ranked cells (CPR and CMD integrate over them)"),
            ("top", ",".join(map(str, given["top"])), {}, "numbers of top cells beside"),
            ("draws", given["draws"], {"type": flag(PositiveInt)}, "random rankings, the floor"),
            ("seed", given["seed"], {"type": flag(Seed)}, "the random rankings' seed"),
            ("rows", given["rows"], {"type": flag(PositiveInt)},
             "rows (seed x circuit) per forward"),
            ("cells", given["cells"], {"choices": ("all", "subject")},
             "rank every cell, or the subject's")):
        group.add_argument(f"--faith-{name}", default=default, **extra,
                           help=f"{text} (default %(default)s)")
