"""``pyvene-causaltrace``: the command line. Parses arguments, calls the library, writes files.

    pyvene-causaltrace trace --kind residual,mlp,attn --seeds 10 --out out/
    pyvene-causaltrace run intervention_specs/residual_trace.json --out out/
    pyvene-causaltrace dataset --data known_1000.json --limit 200 --out runs/known
    pyvene-causaltrace attribute --clt DIR --prompt "..." --answer " Paris" --out out/
    pyvene-causaltrace evaluate out/graph.safetensors --clt DIR --counterfactual "..."
    pyvene-causaltrace fit-lorsa --layers 2,5,8 && pyvene-causaltrace attribute --clt DIR \
        --lorsa ~/.cache/pyvene_causaltrace/lorsas/smollm2-135m-lorsa-k32 --qk-tracing --out out/

A flag the command's mode does not read is refused (:mod:`.flags`). A user's mistake
(:class:`~pyvene_causaltrace.errors.CausalTraceError`, or an ``OSError``) ends in one
``error:`` line and exit 2, Ctrl-C in one line and exit 130; anything else is a bug and keeps
its traceback. Each command's module is imported only when it runs, so ``--help`` loads
neither torch nor pyvene."""

from __future__ import annotations

import importlib
import sys

from ..errors import CausalTraceError
from .flags import check_flags, given_flags
from .parser import build_parser

#: command → (module under ``cli/``, its handler): ``handler(args) -> exit code``.
COMMANDS = {
    "trace": ("trace", "trace_command"),
    "run": ("trace", "run_command"),
    "validate": ("trace", "validate_command"),
    "interventions": ("trace", "interventions_command"),
    "dataset": ("dataset", "dataset_command"),
    "aggregate": ("dataset", "aggregate_command"),
    "attribute": ("attribute", "attribute_command"),
    "clt-check": ("attribute", "clt_check_command"),
    "evaluate": ("evaluate", "evaluate_command"),
    "serve": ("serve", "serve_command"),
    "steer": ("steer", "steer_command"),
    "fit": ("fit", "fit_command"),
    "fit-lorsa": ("lorsa", "fit_lorsa_command"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # a refused flag (its error: line printed) or --help
        return exit_.code if isinstance(exit_.code, int) else 2
    module, name = COMMANDS[args.command]
    try:
        args.given = given_flags(build_parser(), argv)  # what was typed, defaults or not
        check_flags(parser, args.command, args.given)  # a flag this mode ignores: refused
        if hasattr(args, "plugins"):  # the commands that read specs or list the types
            from ..interventions.registry import load_plugins  # loads pyvene: not for --help

            load_plugins(args.plugins)
        handler = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        return handler(args)
    except (CausalTraceError, OSError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: what was finished is saved; rerun the same command to resume",
              file=sys.stderr)
        return 130


def one_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type when it has none)."""
    text = str(error).strip()
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    return text.splitlines()[0] if text else type(error).__name__
