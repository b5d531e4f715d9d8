"""Nothing derived is paired with other inputs (issues 57 and 51 case 5): a rerun of
``attribute --prompts`` after the prompts or the transcoder changed is refused, attention
annotations of one graph are refused on another, and labels of features the graph's transcoder
does not have are refused."""

from __future__ import annotations

import json

import pytest
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.attention import attention_annotations
from pyvene_causaltrace.attribution.identity import graph_identity, text_digest
from pyvene_causaltrace.attribution.many import INDEX, attribute_many
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import InputError, ManifestMismatchError
from pyvene_causaltrace.transcoders import load_from_disk

OTHER = "The Space Needle is in the city of"
ANSWER = " city"  # one token of the fixture tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """A tiny Llama on disk, two CLTs (other seeds), and the graphs of two prompts."""
    root = tmp_path_factory.mktemp("identity")
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    model.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    for name, seed in (("clt", 0), ("clt_b", 5)):
        write_clt(root / name, random_clt_tensors(3, 32, 48, threshold=0.1, seed=seed))
    clt = load_from_disk(str(root / "clt"))
    graphs = [attribute(model, tokenizer, clt, text) for text in (PROMPT, OTHER)]
    return root, model, clt, graphs


# ---------------------------------------------------------------- attention annotations

def test_annotations_of_one_graph_are_refused_on_another(world, tmp_path):
    """Old code: graph B's JSON carried graph A's head parts on B's links."""
    _, model, clt, (a, b) = world
    annotations = attention_annotations(model, clt, a, max_edges=5, max_qk=1)
    with pytest.raises(InputError, match="computed on another graph"):
        b.to_json(attention=annotations)
    a.save(tmp_path / "a.safetensors")  # the same graph, saved and loaded: still its own
    loaded = AttributionGraph.load(tmp_path / "a.safetensors")
    assert graph_identity(loaded) == graph_identity(a) == annotations.graph
    payload = loaded.to_json(attention=annotations)
    assert payload["metadata"]["info"]["inputs"]["graph"] == annotations.graph


def test_a_graph_and_its_json_record_what_they_were_made_from(world):
    _, _, clt, (a, b) = world
    assert set(a.metadata["fingerprints"]) == {"model", "transcoder"}
    inputs = a.to_json()["metadata"]["info"]["inputs"]
    assert inputs["prompt_sha256"] == text_digest(PROMPT)
    assert inputs["model"] == a.metadata["fingerprints"]["model"]
    assert graph_identity(a) != graph_identity(b)


# ------------------------------------------------------------------------------- labels

@pytest.mark.parametrize("labels,needle", [
    ({(0, 999): "x"}, "(0, 999)"), ({(7, 1): "x"}, "(7, 1)"), ({"0/1": "x"}, "'0/1'"),
    ({(0, i): "x" for i in range(100, 110)}, "and 5 more")])
def test_labels_of_features_the_graph_does_not_have_are_refused(world, labels, needle):
    """Old code: written, labelling nothing."""
    graph = world[3][0]
    with pytest.raises(InputError, match="transcoder does not have") as caught:
        graph.to_json(labels={(0, 1): "fine", **labels})
    assert needle in str(caught.value)


def test_labels_of_the_transcoders_features_are_kept(world):
    """A labels table covers the transcoder; a feature this prompt leaves off is no error."""
    graph = world[3][0]
    layer, feature = int(graph.feature_layer[0]), int(graph.feature_id[0])
    payload = graph.to_json(labels={(layer, feature): "first", (2, 47): "inactive here"},
                            node_threshold=1.0, edge_threshold=1.0)
    assert any(node.get("clerp") == "first" for node in payload["nodes"]) or \
        graph.n_features == 0


# --------------------------------------------------------------------- attribute --prompts

def _prompts(path, *texts):
    path.write_text("".join(json.dumps({"prompt": t, "answer": ANSWER}) + "\n" for t in texts))
    return path


def _run(root, capsys, prompts, out, clt="clt") -> tuple[int, list[str]]:
    code = main(["attribute", "--model", f"{root}/llama", "--clt", f"{root}/{clt}",
                 "--prompts", str(prompts), "--out", str(out)])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


def test_a_rerun_with_other_prompts_or_transcoder_is_refused_not_paired(world, tmp_path,
                                                                         capsys):
    """Old code: exit 0, and index.json paired the new prompt text with the old graph."""
    root = world[0]
    prompts, out = _prompts(tmp_path / "p.jsonl", PROMPT), tmp_path / "many"
    assert _run(root, capsys, prompts, out) == (0, [])
    index = json.loads((out / INDEX).read_text())
    assert index["prompts"][0]["prompt_sha256"] == text_digest(PROMPT)
    assert _run(root, capsys, prompts, out) == (0, [])  # the same inputs: done, kept
    _prompts(prompts, OTHER)
    code, errors = _run(root, capsys, prompts, out)
    assert code == 2 and len(errors) == 1 and "00000: prompt text" in errors[0], errors
    assert "remove those directories" in errors[0]
    _prompts(prompts, PROMPT)
    code, errors = _run(root, capsys, prompts, out, clt="clt_b")
    assert code == 2 and len(errors) == 1 and "00000: transcoder" in errors[0], errors
    assert json.loads((out / INDEX).read_text()) == index  # untouched by the refusals


def test_attribute_many_refuses_other_prompts_before_building_any(world, tmp_path, tokenizer):
    _, model, clt, _ = world
    out = tmp_path / "many"
    attribute_many(model, tokenizer, clt, [{"prompt": PROMPT}], out)
    summary = json.loads((out / "00000" / "summary.json").read_text())
    assert summary["inputs"]["prompt_sha256"] == text_digest(PROMPT)
    with pytest.raises(ManifestMismatchError, match="00000: prompt text"):
        attribute_many(model, tokenizer, clt, [{"prompt": OTHER}, {"prompt": PROMPT}], out)
    assert not (out / "00001").exists()
    del summary["inputs"]  # a graph an older version made: what it was made from is unknown
    (out / "00000" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ManifestMismatchError, match="not recorded"):
        attribute_many(model, tokenizer, clt, [{"prompt": PROMPT}], out)


def test_a_rerun_without_cross_check_removes_the_earlier_one(world, tmp_path, capsys):
    """Old code: an earlier run's cross_check.json stayed beside the new graph.json."""
    root, out = world[0], tmp_path / "one"
    out.mkdir()
    for name in ("cross_check.json", "cross_check.png"):
        (out / name).write_text("{}")
    assert main(["attribute", "--model", f"{root}/llama", "--clt", f"{root}/clt", "--answer",
                 ANSWER, "--out", str(out)]) == 0
    capsys.readouterr()
    assert (out / "graph.json").exists() and not (out / "cross_check.json").exists()
    assert not (out / "cross_check.png").exists()
