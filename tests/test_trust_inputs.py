"""Every number refused where it enters (issue 37, cases 5-9): a direction's scale does not
change a graph and a direction too small to compute with is refused; NaN and infinities in run
files are damage; a generation is checked against the model's positions and memory before any
forward; values that overflow the model's dtype, damaged direction files and non-string answers
are one error; flags and labels that cannot apply are refused, not ignored."""

from __future__ import annotations

import json

import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.checkpoint import Checkpoint
from pyvene_causaltrace.attribution.export import read_labels
from pyvene_causaltrace.attribution.store import RowStore
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.dataset.store import GRAPHS, RESULTS, read_jsonl
from pyvene_causaltrace.errors import CausalTraceError, MemoryCapError
from pyvene_causaltrace.steering import intervene_features
from pyvene_causaltrace.transcoders import load_from_disk

D, F, L = 32, 8, 3  # the tiny models' width; the CLI fixture CLT's features and layers
ANSWER = " city"  # one token of the fixture tokenizer (" Paris" is two)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer):
    """A tiny Llama (256 positions), the same with 16 positions, a tiny GPT-2, a CLT of 8
    features per layer, labels files and a damaged direction file."""
    root = tmp_path_factory.mktemp("trust_inputs")
    for arch, name in (("llama", "llama"), ("gpt2", "gpt2"), ("llama", "short")):
        model = make_tiny_model(arch)
        if name == "short":
            model.config.max_position_embeddings = 16
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    write_clt(root / "clt", random_clt_tensors(L, D, F))
    (root / "feature_labels.json").write_text(json.dumps({"0/1": "fine", "0/999": "none"}))
    (root / "layer_labels.csv").write_text("layer,feature,label\n0,1,fine\n7,2,no layer 7\n")
    (root / "damaged.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    return root


def _cli(root, capsys, *args: str) -> tuple[object, list[str], str]:
    """``main([...])``: its exit code (or the exception it let out), the ``error:`` lines on
    stderr, and all of its output."""
    argv = [a.replace("{root}", str(root)) for a in args]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    except Exception as error:  # noqa: BLE001 -- the old code let tracebacks out
        code = error
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    return code, errors, captured.out + captured.err


def _refused(result, needle: str) -> None:
    code, errors, output = result
    assert code == 2, (code, output)
    assert len(errors) == 1 and needle in errors[0], output
    assert "Traceback" not in output


# --------------------------------------------------------------- case 5: a direction's scale

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model = make_tiny_model("llama", init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path_factory.mktemp("clt"),
                                       random_clt_tensors(L, D, 48, threshold=0.1))))
    return model, clt


@pytest.mark.numerics
def test_a_directions_scale_does_not_change_the_graph(world, tokenizer):
    """Old code: completeness and replacement moved once the target row's scale fell under
    the readers' 1e-10 clamp (s = 1e-12 .. 1e-15 on SmolLM2)."""
    model, clt = world
    graphs = {s: attribute(model, tokenizer, clt, PROMPT, target=torch.full((D,), s),
                           batch_size=16) for s in (1.0, 1e-3, 1e-10, 1e-13, 1e-16)}
    base = graphs[1.0]
    scores = {s: {name: graph.scores()[name] for name in ("replacement", "completeness")}
              for s, graph in graphs.items()}
    for s in graphs:
        for name in ("replacement", "completeness"):
            assert scores[s][name] == pytest.approx(scores[1.0][name], abs=1e-6), scores
    for s, graph in graphs.items():
        assert graph.closure.target == pytest.approx(base.closure.target, rel=1e-5), s
        assert torch.allclose(graph.target_row(), base.target_row(),
                              atol=1e-6 * float(base.target_row().abs().max()))
    # the node is the projection on the unit direction: |c| = 1 whatever the scale given
    coefficients = torch.tensor(list(base.target["coefficients"].values()))
    assert float(coefficients.norm()) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("vector", [torch.zeros(D), torch.full((D,), 1e-42),
                                    torch.full((D,), 1e-20),
                                    torch.full((D,), float("nan")),
                                    torch.tensor([float("inf")] + [1.0] * (D - 1))],
                         ids=["zero", "subnormal", "underflows", "nan", "inf"])
def test_a_direction_too_small_or_not_finite_is_refused(world, tokenizer, vector):
    model, clt = world
    with pytest.raises(CausalTraceError, match="direction"):
        attribute(model, tokenizer, clt, PROMPT, target=vector, batch_size=16)


# ----------------------------------------------------------- case 6: NaN in run files

_ROWS = {
    RESULTS: {"index": 0, "fact": "f0", "kind": "residual", "seed": 0, "subject_range": [1, 3],
              "clean": 0.5, "corrupt": 0.1, "restored": [[0.2, 0.3]]},
    GRAPHS: {"index": 0, "fact": "f0", "tokens": ["a"], "subject_range": [0, 1], "answer": "b",
             "n_features": 3, "n_explored": 3, "closure": 1e-7, "error_share": 0.1,
             "replacement": 0.9, "completeness": 0.95, "seconds": 1.0,
             "influence": {"all": [[0.5]]}},
}


@pytest.mark.parametrize("name", [RESULTS, GRAPHS])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_non_finite_number_in_a_run_file_is_refused_naming_file_and_line(tmp_path, name,
                                                                          number):
    """Old code: Python's json read them, and the NaN left the means without a word."""
    good = json.dumps(_ROWS[name])
    key = "restored" if name == RESULTS else "influence"
    bad = json.dumps({**_ROWS[name], key: "@"}).replace('"@"', {
        RESULTS: f"[[0.2, {number}]]", GRAPHS: f'{{"all": [[{number}]]}}'}[name])
    path = tmp_path / name
    path.write_text(f"{good}\n{bad}\n")
    with pytest.raises(CausalTraceError) as caught:
        list(read_jsonl(path))
    message = str(caught.value)
    assert str(path) in message and "line 2" in message and "finite" in message


def test_a_non_finite_number_in_a_checkpoint_manifest_is_refused(tmp_path):
    key = {"input_ids": [1, 2]}
    Checkpoint(tmp_path, key, 0.0).maybe_save(_empty_store(), torch.zeros(0, dtype=torch.long),
                                              force=True)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    text = json.dumps({**manifest, "saved_at": "@"}).replace('"@"', "NaN")
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(CausalTraceError) as caught:
        Checkpoint(tmp_path, key, 0.0).load(n_columns=4, n_logits=0)
    assert "manifest.json" in str(caught.value) and "finite" in str(caught.value)


def _empty_store() -> RowStore:
    return RowStore(4)


# -------------------------------------------------- case 7: generation limits, progress

def _count_forwards(model):
    """A list that grows by one per forward of ``model``'s embedding, and the hook's handle."""
    calls: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


def test_a_generation_past_the_positions_is_refused_before_any_forward(root, tokenizer):
    """Old code: a rotary model was not checked (100000000 tokens ran for ever); GPT-2 was."""
    clt = load_from_disk(str(root / "clt"))
    model = make_tiny_model("llama")
    model.config.max_position_embeddings = 16
    calls, handle = _count_forwards(model)
    try:
        for steps in (40, 100_000_000):
            with pytest.raises(CausalTraceError, match="max_position_embeddings"):
                intervene_features(model, tokenizer, clt, PROMPT, [(0, -1, 1, 2.0)],
                                   max_new_tokens=steps)
        assert calls == []
        fits = 16 - len(tokenizer(PROMPT)["input_ids"])
        intervene_features(model, tokenizer, clt, PROMPT, [(0, -1, 1, 2.0)],
                           max_new_tokens=fits, progress=False)
        assert calls
    finally:
        handle.remove()
    gpt2 = make_tiny_model("gpt2")
    with pytest.raises(CausalTraceError, match="n_positions"):
        intervene_features(gpt2, tokenizer, clt, PROMPT, [(0, -1, 1, 2.0)], max_new_tokens=300)


def test_a_generation_over_the_memory_budget_is_refused_before_any_forward(root, tokenizer):
    clt = load_from_disk(str(root / "clt"))
    model = make_tiny_model("llama")
    calls, handle = _count_forwards(model)
    try:
        with pytest.raises(MemoryCapError, match="new tokens fit"):
            intervene_features(model, tokenizer, clt, PROMPT, [(0, -1, 1, 2.0)],
                               max_new_tokens=200, memory_mb=0.5)
        assert calls == []
    finally:
        handle.remove()


def test_a_long_generation_shows_a_progress_bar_unless_silenced(root, tokenizer, capsys):
    clt = load_from_disk(str(root / "clt"))
    model = make_tiny_model("llama")
    item = [(0, -1, 1, 2.0)]
    intervene_features(model, tokenizer, clt, PROMPT, item, max_new_tokens=40)
    assert "steered generation" in capsys.readouterr().err
    intervene_features(model, tokenizer, clt, PROMPT, item, max_new_tokens=40, progress=False)
    assert "generation" not in capsys.readouterr().err
    code, errors, output = _cli(root, capsys, "steer", "--model", "{root}/llama", "--clt",
                                "{root}/clt", "--set", "0:-1:1=2", "--max-new-tokens", "40",
                                "--no-progress")
    assert code == 0 and not errors and "generation:" not in output, output


def test_steer_refuses_a_generation_past_the_positions(root, capsys):
    _refused(_cli(root, capsys, "steer", "--model", "{root}/short", "--clt", "{root}/clt",
                  "--set", "0:-1:1=2", "--max-new-tokens", "100000000"), "max_position")
    _refused(_cli(root, capsys, "steer", "--model", "{root}/gpt2", "--clt", "{root}/clt",
                  "--set", "0:-1:1=2", "--max-new-tokens", "300"), "n_positions")
    _refused(_cli(root, capsys, "steer", "--model", "{root}/llama", "--clt", "{root}/clt",
                  "--set", "0:-1:1=2", "--max-new-tokens", "200", "--memory-mb", "0.5"),
             "new tokens fit")


# ------------------------------------------------------------ case 8: raw tracebacks

def test_a_steering_value_that_overflows_float32_is_refused(root, tokenizer, capsys):
    """Old code: RuntimeError (value cannot be converted to float without overflow)."""
    _refused(_cli(root, capsys, "steer", "--model", "{root}/llama", "--clt", "{root}/clt",
                  "--set", "0:-1:0=1e39"), "float32")
    _refused(_cli(root, capsys, "steer", "--model", "{root}/llama", "--clt", "{root}/clt",
                  "--set", "0:-1:0=-1e39"), "--set")
    clt = load_from_disk(str(root / "clt"))
    model = make_tiny_model("llama")
    with pytest.raises(CausalTraceError, match="does not fit"):
        intervene_features(model, tokenizer, clt, PROMPT, [(0, -1, 0, 1e39)])
    half = make_tiny_model("llama").half()
    with pytest.raises(CausalTraceError, match="float16"):
        intervene_features(half, tokenizer, clt, PROMPT, [(0, -1, 0, 1e5)])


def test_a_damaged_direction_file_is_one_error_line(root, capsys):
    """Old code: safetensors' SafetensorError, a traceback."""
    _refused(_cli(root, capsys, "attribute", "--model", "{root}/llama", "--clt", "{root}/clt",
                  "--direction", "{root}/damaged.safetensors", "--out", "{root}/g_damaged"),
             "damaged.safetensors")


def test_an_answer_that_is_not_a_string_is_refused_naming_answer(world, tokenizer):
    """Old code: the tokenizer's ValueError."""
    model, clt = world
    with pytest.raises(CausalTraceError, match="answer"):
        attribute(model, tokenizer, clt, PROMPT, 5)


# ------------------------------------------- case 9: flags and labels that cannot apply

@pytest.mark.parametrize("flag,value", [("--max-n-logits", "3"),
                                        ("--desired-logit-prob", "0.5")])
def test_salient_logit_flags_with_an_answer_are_refused(root, capsys, flag, value):
    """Old code: a one-logit graph of the answer, the flag ignored without a word."""
    _refused(_cli(root, capsys, "attribute", "--model", "{root}/llama", "--clt", "{root}/clt",
                  "--answer", ANSWER, flag, value, "--out", "{root}/g_flags"), flag)


def test_salient_logit_arguments_with_an_answer_or_direction_are_refused(world, tokenizer):
    model, clt = world
    with pytest.raises(CausalTraceError, match="max_n_logits"):
        attribute(model, tokenizer, clt, PROMPT, ANSWER, max_n_logits=3)
    with pytest.raises(CausalTraceError, match="desired_logit_prob"):
        attribute(model, tokenizer, clt, PROMPT, target=torch.ones(D), desired_logit_prob=0.5)


@pytest.mark.parametrize("name,needle", [("feature_labels.json", "key '0/999'"),
                                         ("layer_labels.csv", "row 2")])
def test_labels_of_features_the_transcoder_lacks_are_refused(root, capsys, name, needle):
    """Old code: accepted, labelling nothing."""
    result = _cli(root, capsys, "attribute", "--model", "{root}/llama", "--clt", "{root}/clt",
                  "--answer", ANSWER, "--labels", f"{{root}}/{name}", "--out",
                  "{root}/g_labels")
    _refused(result, name)
    assert needle in result[1][0]
    with pytest.raises(CausalTraceError, match="transcoder has no"):
        read_labels(root / name, n_layers=L, n_features=F)
