"""Which flags apply in which mode of each command. A flag given where it does not apply is
refused (one ``error:`` line naming the flag and the mode), never ignored.

A command has one mode or several, chosen by a flag (``attribute --prompts FILE`` builds one
graph per prompt; ``attribute --spec FILE`` takes its prompt from the spec). Each mode lists
every flag it reads; :data:`NEEDS` lists the flags read only beside another (``dataset --clt``
only with ``--graphs``), :data:`NEEDS_TOO` those read only beside a second one as well
(``dataset --sizes``: with ``--faithfulness`` and ``--graphs``), :data:`IGNORED_WITH` those
another makes moot. tests/test_cli_flags.py
checks that every flag of the parser is in this table, so a new flag cannot be silently ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class Mode:
    """One way a command runs: ``name`` as the errors say it, the flag that chooses it
    (``selects``; None: the command's default mode), the flags it reads (argparse dests), why
    the others do not apply, and an argv (after the command) that parses in this mode."""

    name: str
    selects: str | None
    flags: frozenset[str]
    why: str
    example: tuple[str, ...]


def _mode(name, selects, flags: str, example: str, why: str = "") -> Mode:
    return Mode(name, selects, frozenset(flags.split()), why, tuple(example.split()))


#: ``--faithfulness``'s settings (``trace``, ``dataset``).
TRACE_FAITHFULNESS = "faith_sizes faith_top faith_draws faith_seed faith_rows faith_cells"
_TRACE_SPEC = ("plugins spec model device out budget_mb controls no_progress faithfulness "
               + TRACE_FAITHFULNESS)
_TRACE_FLAGS = "prompt subject answer kind seeds scale sigma window"
FAITHFULNESS_SETTINGS = ("sizes level rank_by ablation errors metric draws seed "
                         "circuits_per_forward")
FAITHFULNESS = "counterfactual reference foil " + FAITHFULNESS_SETTINGS
_ATTRIBUTE_COMMON = ("plugins model device clt format target other k max_n_logits "
                     "desired_logit_prob bos_errors bos memory_mb max_feature_nodes dtype "
                     "deterministic out")
_ATTRIBUTE_ONE = ("labels direction node_threshold edge_threshold max_links validate heads "
                  "lorsa qk_tracing split cross_check subject seeds scale check_features "
                  "check_window check_modes faithfulness " + FAITHFULNESS)
_STEER_COMMON = "plugins model device clt format max_new_tokens memory_mb no_progress top_k out"

#: command -> its modes, the first whose ``selects`` flag is given first (the default last).
MODES: dict[str, tuple[Mode, ...]] = {
    "trace": (
        _mode("trace --spec FILE", "spec", _TRACE_SPEC, "--spec s.json",
              "the spec gives the prompt, subject, answer, kind and noise settings"),
        _mode("trace", None, f"{_TRACE_SPEC} {_TRACE_FLAGS}", ""),
    ),
    "run": (_mode("run", None, "plugins spec model device out", "s.json"),),
    "validate": (_mode("validate", None, "plugins specs model device", "s.json"),),
    "interventions": (_mode("interventions", None, "plugins", ""),),
    "clt-check": (_mode("clt-check", None,
                        "model device clt format data limit prompt answer out bos",
                        "--clt c --data d.txt"),),
    "dataset": (_mode("dataset", None,
                      "data task model device limit kinds seeds scale sigma window known budget_mb "
                      "boot no_progress graphs clt format max_feature_nodes graph_memory_mb "
                      "bos save_graphs faithfulness out " + FAITHFULNESS_SETTINGS + " "
                      + TRACE_FAITHFULNESS,
                      "--data d.json --out o"),),
    "aggregate": (_mode("aggregate", None, "out boot", "o"),),
    "attribute": (
        _mode("attribute --prompts FILE", "prompts", f"{_ATTRIBUTE_COMMON} prompts",
              "--prompts p.jsonl --out o",
              "each line gives a prompt, its answer and target; each graph is saved as "
              "graph.safetensors and summary.json: no graph.json, pruning, labels, spec, "
              "direction, validation, heads, Lorsa or cross-check"),
        _mode("attribute --spec FILE", "spec", f"{_ATTRIBUTE_COMMON} {_ATTRIBUTE_ONE} spec",
              "--spec s.json --out o", "the spec gives the prompt and the answer"),
        _mode("attribute", None,
              f"{_ATTRIBUTE_COMMON} {_ATTRIBUTE_ONE} prompt answer", "--out o"),
    ),
    "fit-lorsa": (_mode("fit-lorsa", None, "model device layers top_k per_qk_head steps lr batch "
                        "length texts data seed out refit", "--layers 1"),),
    "fit": (_mode("fit", None,
                  "model device quality kind features activation k steps lr data texts seed out "
                  "refit no_progress", ""),),
    "steer": (
        _mode("steer --spec FILE", "spec", f"{_STEER_COMMON} spec", "--spec s.json",
              "the spec gives the prompt, the interventions, the error and attention "
              "settings and the first spliced position"),
        _mode("steer", None,
              f"{_STEER_COMMON} prompt set no_hold_errors freeze_attention bos", ""),
    ),
    "serve": (_mode("serve", None, "dir port no_open", "d"),),
    "evaluate": (
        _mode("evaluate --budget", "budget",
              "graph model device clt format out counterfactual reference rank_by ablation "
              "errors draws seed circuits_per_forward budget budgets",
              "g.safetensors --clt c --budget",
              "the budget curve keeps K features and reads KL and P(answer): no sizes, level, "
              "metric or foil"),
        _mode("evaluate", None, f"graph model device clt format out {FAITHFULNESS}",
              "g.safetensors --clt c", "--budgets sets the K of the feature-budget curve, "
              "which --budget measures"),
    ),
}

#: command -> {flag: (the flag it needs, what that flag does)}: read only beside it.
NEEDS: dict[str, dict[str, tuple[str, str]]] = {
    "trace": {name: ("faithfulness", "add --faithfulness to measure the traces' faithfulness")
              for name in TRACE_FAITHFULNESS.split()},
    "validate": {"device": ("model", "add --model to check the specs on a model there")},
    "dataset": {name: ("graphs", "add --graphs to build each fact's attribution graph")
                for name in ("clt", "format", "max_feature_nodes", "graph_memory_mb", "bos",
                             "save_graphs")}
    | {name: ("faithfulness", "add --faithfulness to measure each trace's faithfulness")
       for name in TRACE_FAITHFULNESS.split()}
    | {name: ("faithfulness", "add --faithfulness to measure each graph's faithfulness curve")
       for name in FAITHFULNESS_SETTINGS.split()},
    "attribute": {**{name: ("cross_check", "add --cross-check to trace the prompt and compare")
                     for name in ("subject", "seeds", "scale", "check_features", "check_window",
                                  "check_modes")},
                  **{name: ("faithfulness", "add --faithfulness to measure the graph's "
                                            "faithfulness curve")
                     for name in FAITHFULNESS.split()},
                  "qk_tracing": ("lorsa", "add --lorsa DIR: QK tracing reads Lorsa heads")},
}

#: command -> {flag: (a second flag it needs, what that flag does)}: read only beside both.
NEEDS_TOO: dict[str, dict[str, tuple[str, str]]] = {
    "dataset": {name: ("graphs", "it sets the graphs' faithfulness curves: add --graphs to "
                                 "build each fact's attribution graph")
                for name in FAITHFULNESS_SETTINGS.split()},
}

#: command -> {flag: (the flag that makes it moot, why)}.
IGNORED_WITH: dict[str, dict[str, tuple[str, str]]] = {
    "attribute": {name: ("direction", "--direction explains a direction, not a logit target")
                  for name in ("target", "k")}
    | {name: ("lorsa", "it ablates, patches or splits by head in the model spliced with the "
                       "transcoder alone, and does not splice Lorsa yet; --qk-tracing explains "
                       "the Lorsa heads' attention")
       for name in ("validate", "cross_check", "faithfulness", "heads")},
}


def flag_name(parser: argparse.ArgumentParser, command: str, dest: str) -> str:
    """The flag a user types for ``dest`` of ``command`` (its longest option string)."""
    for action in _subparser(parser, command)._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return dest


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """The dests of the options ``argv`` gives (whatever their value, the default included):
    ``argv`` parsed again with every default suppressed. ``parser`` is spent afterwards."""
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            action.default = argparse.SUPPRESS
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    namespace, _ = parser.parse_known_args(list(argv))
    options = {a.dest for a in _subparser(parser, namespace.command)._actions if a.option_strings}
    return frozenset(set(vars(namespace)) & options)


def check_flags(parser: argparse.ArgumentParser, command: str, given: frozenset[str]) -> None:
    """Refuse (:class:`InputError`) the first given flag that ``command``'s mode does not read,
    or that :data:`NEEDS`, :data:`NEEDS_TOO` or :data:`IGNORED_WITH` say is not read here."""
    mode = next(m for m in MODES[command] if m.selects is None or m.selects in given)
    for dest in sorted(given):
        flag = flag_name(parser, command, dest)
        if dest not in mode.flags:
            why = f" ({mode.why})" if mode.why else ""
            raise InputError(f"{flag} does not apply to `{mode.name}`{why}: drop {flag}")
        for table in (NEEDS, NEEDS_TOO):
            needed, what = table.get(command, {}).get(dest, (None, ""))
            if needed is not None and needed not in given:
                raise InputError(f"{flag} is read only with "
                                 f"{flag_name(parser, command, needed)}: `{mode.name}` without "
                                 f"it would ignore it ({what})")
        moot, why = IGNORED_WITH.get(command, {}).get(dest, (None, ""))
        if moot is not None and moot in given:
            raise InputError(f"{flag} does not apply to `{mode.name} "
                             f"{flag_name(parser, command, moot)}` ({why}): drop it")
