"""Every flag of every command is read or refused in each of its modes (issue 51, item 5): the
parser's actions are read, so a new flag is covered without editing this file."""

from __future__ import annotations

import argparse
import json
import typing
from typing import Annotated

import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.cli import main
from pyvene_causaltrace.cli.flags import (
    IGNORED_WITH,
    MODES,
    NEEDS,
    NEEDS_TOO,
    check_flags,
    given_flags,
)
from pyvene_causaltrace.cli.parser import build_parser

ANSWER = " city"  # one token of the fixture tokenizer


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _dests(command: str) -> set[str]:
    return {a.dest for a in _commands()[command]._actions if a.dest != "help"}


def _tokens(action: argparse.Action) -> list[str]:
    """The action's flag and a value argparse accepts."""
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(list(action.choices)[0])]
    if flag == "--device":  # a form (arguments.Pattern), not any text
        return [flag, "cpu"]
    annotation = getattr(action.type, "annotation", action.type)  # arguments.flag converters
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated \
        else annotation
    return [flag, {int: "1", float: "0.5"}.get(base, "x")]


def _refusal(capsys, argv: list[str]) -> str:
    """The one ``error:`` line of ``main(argv)``, which must exit 2."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, (argv, code, err)
    return lines[0]


def test_the_table_names_every_flag_of_every_command_and_no_other():
    """Old code: no table; a flag no mode reads was ignored."""
    assert set(MODES) == set(_commands())
    for command, modes in MODES.items():
        named = set().union(*(m.flags for m in modes))
        assert named == _dests(command), command
        for table in (NEEDS, NEEDS_TOO, IGNORED_WITH):
            assert set(table.get(command, {})) <= named


def _needs(command: str, dest: str) -> list[str]:
    """The flags ``dest`` is read only beside (dataset --sizes: --faithfulness, --graphs)."""
    return [table[command][dest][0] for table in (NEEDS, NEEDS_TOO)
            if dest in table.get(command, {})]


CASES = [(command, mode) for command, modes in MODES.items() for mode in modes]


@pytest.mark.parametrize("command,mode", CASES, ids=[m.name for _, m in CASES])
def test_every_flag_is_read_or_refused_in_every_mode(capsys, command, mode):
    """Old code: ``attribute --prompts FILE`` ignored --labels, --node-threshold, --max-links,
    --answer and --prompt (and more); ``trace --spec`` ignored --prompt, --seeds and the rest."""
    parser = _commands()[command]
    selecting = {m.selects for m in MODES[command]} - {None}
    base = [command, *mode.example]
    base_given = given_flags(build_parser(), base)
    exclusive = {a.dest for g in parser._mutually_exclusive_groups for a in g._group_actions
                 if any(b.dest in base_given for b in g._group_actions)}
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest == "help" or dest in selecting \
                or dest in exclusive or dest in base_given:
            continue
        argv = base + _tokens(action)
        given = given_flags(build_parser(), argv)
        assert dest in given
        if dest not in mode.flags:
            line = _refusal(capsys, argv)
            assert action.option_strings[-1] in line and f"`{mode.name}`" in line, line
            continue
        needed, first = _needs(command, dest), True
        while needed:  # refused until every flag it needs (and what they need) is given
            line = _refusal(capsys, argv)
            assert "read only with" in line and (action.option_strings[-1] in line
                                                 or not first), line
            flag, first = needed.pop(0), False
            argv += _tokens(next(a for a in parser._actions if a.dest == flag))
            given = given_flags(build_parser(), argv)
            needed += [n for n in _needs(command, flag) if n not in given and n not in needed]
            needed = [n for n in needed if n not in given]
        moot = IGNORED_WITH.get(command, {}).get(dest, (None,))[0]
        if moot is not None and moot in mode.flags:
            moot_argv = argv + _tokens(next(a for a in parser._actions if a.dest == moot))
            assert action.option_strings[-1] in _refusal(capsys, moot_argv)
        check_flags(build_parser(), command, given)  # read here: not refused


def test_given_flags_sees_a_flag_given_at_its_default():
    """``--node-threshold 0.8`` (the default) beside --prompts is still refused."""
    argv = ["attribute", "--prompts", "p.jsonl", "--out", "o", "--node-threshold", "0.8"]
    assert "node_threshold" in given_flags(build_parser(), argv)


# ------------------------------------------------ the case, on a real run's files

@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("cli_flags")
    make_tiny_model("llama").save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    write_clt(root / "clt", random_clt_tensors(3, 32, 8))
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT, "answer": ANSWER}) + "\n")
    (root / "labels.csv").write_text("layer,feature,label\n0,1,a label\n")
    return root


@pytest.mark.parametrize("flag,value", [
    ("--labels", "{root}/labels.csv"), ("--node-threshold", "0.5"), ("--max-links", "10"),
    ("--answer", ANSWER), ("--prompt", "Another prompt"), ("--edge-threshold", "0.9"),
    ("--spec", "{root}/spec.json"), ("--seeds", "2")])
def test_prompts_mode_refuses_the_one_graph_flags(root, capsys, flag, value):
    """Old code: exit 0, the graphs built without the flag (--seeds: ignored without
    --cross-check in every mode)."""
    argv = ["attribute", "--model", f"{root}/llama", "--clt", f"{root}/clt", "--prompts",
            f"{root}/prompts.jsonl", "--out", f"{root}/many", flag,
            value.replace("{root}", str(root))]
    line = _refusal(capsys, argv)
    assert flag in line and ("attribute --prompts FILE" in line or "--cross-check" in line)
    assert not (root / "many").exists()


def test_a_spec_setting_given_as_a_flag_too_is_refused(root, capsys):
    """Old code: the spec's node_threshold won, --node-threshold ignored."""
    spec = {"schema_version": 1, "prompt": PROMPT, "answer": ANSWER, "interventions": [],
            "attribution": {"clt": str(root / "clt"), "node_threshold": 0.8}}
    (root / "spec.json").write_text(json.dumps(spec))
    line = _refusal(capsys, ["attribute", "--spec", f"{root}/spec.json", "--node-threshold",
                             "0.5", "--out", f"{root}/spec_out"])
    assert "--node-threshold" in line and "the spec sets node_threshold" in line


@pytest.mark.parametrize("extra,needle", [
    (["--split", "rows", "--answer", ANSWER], "--split"),
    (["--target", "demeaned_vocab", "--k", "5", "--answer", ANSWER], "--k"),
    (["--direction", "{root}/d.json", "--target", "demeaned_vocab"], "--target")])
def test_flags_a_one_graph_run_does_not_read_are_refused(root, capsys, extra, needle):
    """Old code: --split ignored in one process, --k by a target that is not top-k demeaned,
    --target by a direction."""
    (root / "d.json").write_text(json.dumps([1.0] * 32))
    argv = ["attribute", "--model", f"{root}/llama", "--clt", f"{root}/clt", "--out",
            f"{root}/one", *[e.replace("{root}", str(root)) for e in extra]]
    assert needle in _refusal(capsys, argv)
    assert not (root / "one").exists()
