"""JSON specs: schema, round trip, symbolic positions and layers, errors with JSON paths, and
spec -> IntervenableConfig -> IntervenableModel on tiny models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _support.data import SPEC_DIR
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace.execute import build_intervenable, run_spec, to_pv_config
from pyvene_causaltrace.locations import resolve_layers, resolve_positions
from pyvene_causaltrace.prompts import SubjectNotFoundError, tokenize_prompt
from pyvene_causaltrace.specs import (
    SCHEMA_PATH,
    SpecError,
    load_spec,
    save_spec,
    spec_schema,
    validate_spec,
)

SPEC_FILES = sorted(SPEC_DIR.glob("*.json"))

BASE = {
    "schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
    "interventions": [
        {"type": "noise_add", "seeds": [0, 1, 2], "scale": 3.0},
        {"type": "clean_restore", "component": "block_output", "layers": 1,
         "positions": "last_subject"},
    ],
}


def with_change(path: list, value):
    spec = copy.deepcopy(BASE)
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return spec


def test_shipped_specs_cover_every_current_experiment():
    names = {p.stem for p in SPEC_FILES}
    assert {"residual_trace", "mlp_window", "attn_window", "severed_mlp",
            "severed_attn"} <= names
    assert json.loads(SCHEMA_PATH.read_text()) == spec_schema()


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_round_trip_is_exact(path, tmp_path):
    spec = load_spec(path)
    save_spec(spec, tmp_path / "copy.json")
    assert json.loads((tmp_path / "copy.json").read_text()) == json.loads(path.read_text())
    assert load_spec(tmp_path / "copy.json") == spec
    assert (tmp_path / "copy.json").read_text() == path.read_text()


BAD_SPECS = [
    (with_change(["schema_version"], 2), "$.schema_version", "2 was expected|1 was expected"),
    (with_change(["interventions", 0, "scale"], -1), "$.interventions[0].scale",
     "less than or equal|minimum"),
    (with_change(["interventions", 0, "sigma"], "matrix"), "$.interventions[0].sigma", "expected"),
    (with_change(["interventions", 0, "seeds"], 0), "$.interventions[0].seeds", "expected"),
    (with_change(["interventions", 1, "positions"], "middle"), "$.interventions[1].positions",
     "expected"),
    (with_change(["interventions", 1, "layer"], 3), "$.interventions[1]",
     "Additional properties|'layer'"),
    (with_change(["interventions", 1, "component"], "mlp"), "$.interventions[1].component",
     "expected"),
    (with_change(["prompt"], ""), "$.prompt", "non-empty|too short|should be non-empty"),
    (with_change(["interventions", 0, "distribution"], "cauchy"),
     "$.interventions[0].distribution", "cauchy"),
    ({k: v for k, v in BASE.items() if k != "subject"}, "$.subject", "last_subject|subject"),
    (with_change(["interventions"], BASE["interventions"] + [BASE["interventions"][0]]),
     "$.interventions[2]", "at most one noise_add"),
    (with_change(["interventions", 1], {"type": "window_restore", "sublayer": "mlp",
                                        "center": 1, "window": 0, "positions": "last"}),
     "$.interventions[1].window", "minimum|less than"),
]


@pytest.mark.parametrize("data, path, message", BAD_SPECS)
def test_malformed_spec_names_the_json_path(data, path, message):
    with pytest.raises(SpecError) as error:
        load_spec(data)
    assert error.value.path == path
    assert pytest.importorskip("re").search(message, str(error.value)), str(error.value)


def test_invalid_json_file_is_a_spec_error(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_spec(tmp_path / "bad.json")


def test_symbolic_positions(tokenizer):
    prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
    start, stop = prompt.subject_range
    n = prompt.seq_len
    resolve = lambda v: resolve_positions(v, prompt, "$.p")  # noqa: E731
    assert resolve("subject") == list(range(start, stop))
    assert resolve("first_subject") == [start]
    assert resolve("last_subject") == [stop - 1]
    assert resolve("after_subject") == [stop]
    assert resolve("last") == [n - 1]
    assert resolve("all") == list(range(n))
    assert resolve(-2) == [n - 2]
    assert resolve({"start": 1, "stop": 3}) == [1, 2]
    assert resolve(["last", 0, "last"]) == [n - 1, 0]
    with pytest.raises(SpecError) as error:
        resolve(["last", 99])
    assert error.value.path == "$.p[1]"


def test_symbolic_layers():
    assert resolve_layers("all", 4, "$.l") == [0, 1, 2, 3]
    assert resolve_layers(-1, 4, "$.l") == [3]
    assert resolve_layers([0, 2], 4, "$.l") == [0, 2]
    assert resolve_layers({"start": 1, "stop": 3}, 4, "$.l") == [1, 2]
    assert resolve_layers({"center": 10, "window": 10}, 30, "$.l") == list(range(5, 15))
    with pytest.raises(SpecError) as error:
        resolve_layers([0, 7], 4, "$.l")
    assert error.value.path == "$.l[1]" and "outside 0..3" in str(error.value)


def test_subject_span_uses_character_offsets(tokenizer):
    prompt = tokenize_prompt(tokenizer, "Paris is the capital of France", "is the")
    assert [prompt.tokens[i] for i in range(*prompt.subject_range)] == [" is", " the"]
    # a subject that starts inside a token takes the whole token
    inner = tokenize_prompt(tokenizer, PROMPT, "iffel Tow")
    pieces = [inner.tokens[i] for i in range(*inner.subject_range)]
    assert "".join(pieces).strip().startswith("Eiffel") and "Tower" in "".join(pieces)
    second = tokenize_prompt(tokenizer, "the cat and the dog", "the", occurrence=1)
    assert second.subject_range[0] > 0
    with pytest.raises(SubjectNotFoundError, match="Louvre"):
        tokenize_prompt(tokenizer, PROMPT, "Louvre")
    with pytest.raises(SubjectNotFoundError, match="fewer than 2"):
        tokenize_prompt(tokenizer, PROMPT, SUBJECT, occurrence=1)
    with pytest.raises(ValueError, match="empty"):
        tokenize_prompt(tokenizer, "", SUBJECT)


def test_semantic_errors_name_the_path(tokenizer):
    model = make_tiny_model("llama")
    with pytest.raises(SpecError) as error:
        run_spec(with_change(["interventions", 1, "layers"], 5), model, tokenizer)
    assert error.value.path == "$.interventions[1].layers"
    with pytest.raises(SpecError) as error:
        run_spec(with_change(["interventions", 1, "positions"], 40), model, tokenizer)
    assert error.value.path == "$.interventions[1].positions"
    with pytest.raises(SubjectNotFoundError):
        run_spec(with_change(["subject"], "Louvre"), model, tokenizer)
    with pytest.warns(UserWarning, match="first token"):
        run_spec(with_change(["answer"], " Paris France"), model, tokenizer)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3"])
@pytest.mark.numerics
def test_every_kind_of_entry_runs_through_pv_config(arch, tokenizer):
    """spec -> pv.IntervenableConfig -> IntervenableModel on each architecture, with every
    built-in type; restoring the last block at every position recovers exactly 1."""
    model = make_tiny_model(arch, n_layers=3)
    spec = with_change(["interventions"], [
        {"type": "noise_add", "seeds": 3, "scale": 5.0, "sigma": "embedding_matrix"},
        {"type": "window_restore", "sublayer": "mlp", "center": 1, "window": 2,
         "positions": "subject"},
        {"type": "window_restore", "sublayer": "attn", "center": 1, "window": 3,
         "positions": "last"},
        {"type": "freeze", "component": "mlp_output", "layers": 2, "positions": "last"},
        {"type": "frozen_layernorm"},
        {"type": "clean_restore", "layers": -1, "positions": "all"},
    ])
    pv_model, plan = build_intervenable(spec, model, tokenizer)
    config = to_pv_config(plan)
    kinds = [type(r.intervention).__name__ for r in config.representations]
    assert kinds.count("WindowRestore") == 2 + 3 and kinds.count("FrozenLayerNorm") == 3 + 3 + 1
    result = run_spec(spec, model, tokenizer)
    assert len(result.recovery) == 3
    torch.testing.assert_close(torch.tensor(result.recovery, dtype=torch.float64),
                               torch.ones(3, dtype=torch.float64), atol=1e-5, rtol=0)
    assert result.corrupt_probs != result.intervened_probs


def test_spec_result_tables_and_json(tokenizer):
    model = make_tiny_model("gpt2")
    result = run_spec(BASE, model, tokenizer)
    frame = result.to_dataframe()
    assert list(frame.columns) == ["seed", "clean_prob", "corrupt_prob", "prob", "recovery"]
    assert frame["seed"].tolist() == [0, 1, 2]
    again = type(result).from_json(result.to_json())
    assert again == result
    assert "recovery" in result.summary()


def test_round_trip_keeps_every_field():
    data = dict(BASE, name="x", description="y", model="m", answer=" Paris",
                subject_occurrence=0, **{"$schema": "s.json"})
    assert load_spec(data).to_dict() == data
    assert load_spec(load_spec(data).to_dict()) == load_spec(data)


@pytest.mark.numerics
def test_third_party_type_in_a_spec(tokenizer, monkeypatch):
    from pyvene_causaltrace.interventions import register_intervention, registry
    from pyvene_causaltrace.interventions.base import (
        CausalTraceIntervention,
        fit_mask,
        positions_to_mask,
    )

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    class ScaleAt(CausalTraceIntervention):
        """Multiply the output at some positions by ``factor``."""
        registered_name = "scale_at"
        tensor_fields = ("positions",)

        def _setup(self, positions, factor=1.0):
            self._set_tensor("positions", positions_to_mask(positions))
            self._config = {"factor": factor}

        def forward(self, base, source=None, subspaces=None, **kwargs):
            mask = fit_mask(self.positions, *base.shape[:2]).unsqueeze(-1)
            return torch.where(mask, base * self._config["factor"], base)

    register_intervention("scale_at", ScaleAt)
    model = make_tiny_model("qwen3")
    spec = with_change(["interventions"], [
        {"type": "scale_at", "component": "model.layers[{layer}].mlp.output", "layers": [0, 2],
         "positions": "last", "factor": 0.0}])
    pv_model, plan = build_intervenable(spec, model, tokenizer)
    assert [c for c, _ in plan.interventions] == ["model.layers[0].mlp.output",
                                                  "model.layers[2].mlp.output"]
    with torch.no_grad():
        logits = pv_model(base=plan.base_inputs)[1].logits
        plain = model(input_ids=plan.prompt.input_ids).logits
    assert torch.equal(logits[:, :-1], plain[:, :-1])
    assert not torch.allclose(logits[:, -1], plain[:, -1])
    # the old shape, settings in a ``params`` sub-dict, is a SpecError naming the entry
    old = with_change(["interventions"], [
        {"type": "scale_at", "component": "mlp_output", "layers": [0], "positions": "last",
         "params": {"factor": 0.0}}])
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]: scale_at: .*'params'"):
        build_intervenable(old, model, tokenizer)


def test_subject_span_with_a_sentencepiece_style_tokenizer():
    """Metaspace pieces carry their leading space ('▁Tower'): the span must cover exactly the
    pieces with subject characters, not a neighbour whose offsets start at a space."""
    from _support.models import CORPUS
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=120, min_frequency=1, special_tokens=["<s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=sp)
    offsets = tokenizer(PROMPT, return_offsets_mapping=True)["offset_mapping"]
    for subject in ("Eiffel", "The Eiffel", "Tower", "Eiffel Tower is"):
        start = PROMPT.index(subject)
        stop = start + len(subject)
        span = tokenize_prompt(tokenizer, PROMPT, subject).subject_range
        text = lambda i: PROMPT[offsets[i][0]:offsets[i][1]].strip()  # noqa: E731
        inside = "".join(text(i) for i in range(*span))
        assert inside == subject.replace(" ", ""), (subject, inside)
        assert all(offsets[i][1] <= start or offsets[i][0] >= stop or not text(i)
                   for i in range(len(offsets)) if not span[0] <= i < span[1])


def test_validate_refuses_typos_specless_types_and_missing_modules(tokenizer):
    """A misspelt type is refused by validate with the closest registered names; types that only
    the attribution method builds are refused with the reason; a raw module path the model lacks
    is a SpecError at its entry's path, not an AttributeError."""
    typo = with_change(["interventions"], [{"type": "clean_restor", "positions": "last",
                                            "layers": [0], "params": {}}])
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.type.*did you mean "
                                        r"'clean_restore'"):
        validate_spec(typo)
    for kind, extra in (("frozen_attention", {}), ("gradient_leaf", {"params": {}})):
        # frozen_attention is a spec entry only with a held pattern ("pattern": "clean")
        spec = with_change(["interventions"], [{"type": kind, **extra}])
        with pytest.raises(SpecError, match=f"{kind}.*part of the attribution method"):
            validate_spec(spec)
    model = make_tiny_model("llama")
    wrong = with_change(["interventions"], [
        {"type": "clean_restore", "component": "model.layers[{layer}].mlpp.output",
         "layers": [0], "positions": "last"}])
    with pytest.raises(SpecError, match=r"\$\.interventions\[0\]\.component.*llama has no "
                                        r"module 'model.layers\[0\].mlpp'"):
        build_intervenable(wrong, model, tokenizer)
