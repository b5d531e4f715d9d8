"""Attribution at its edges: damaged checkpoints, exports killed or out of disk mid-write, flags
and label files refused before any work, malformed transcoder configs and held-out data. Each
ends in one ``error:`` line (exit 2) on the command line, and never costs a computed row."""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from transcoder_fixtures import random_set, write_circuit_tracer

from pyvene_causaltrace.attribution import AttributionGraph, GraphFileError, MemoryCapError
from pyvene_causaltrace.attribution import budget as budget_module
from pyvene_causaltrace.attribution.budget import feature_budget, row_bytes
from pyvene_causaltrace.attribution.checkpoint import Checkpoint, file_digest, remove_checkpoint
from pyvene_causaltrace.attribution.export import read_labels
from pyvene_causaltrace.attribution.store import RowStore
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import CheckpointMismatchError, InputError, TranscoderFormatError
from pyvene_causaltrace.transcoders import load_transcoder

attribute_module = importlib.import_module("pyvene_causaltrace.attribution.attribute")
cli_module = importlib.import_module("pyvene_causaltrace.cli.attribute")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)``: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def one_error(code: int, out: str, err: str, *needles: str) -> str:
    """Exit 2, exactly one ``error:`` line holding every needle, and no traceback."""
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err
    return lines[0]


def edges(graph: AttributionGraph) -> pd.DataFrame:
    """Every stored edge, in a fixed order."""
    frame = graph.to_dataframe()[["target", "source", "weight"]]
    return frame.sort_values(["target", "source"]).reset_index(drop=True)


@pytest.fixture(scope="module", autouse=True)
def small_batches():
    """8 rows per backward in every run here: several batches, so several shards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(budget_module.DEFAULT_MAX_BATCH, "cpu", 8)
        yield


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """A tiny Llama and a fixture CLT on disk; an uninterrupted ``attribute`` run (``ref``);
    and a run whose export hit a full disk after every row was computed (``partial``, saved
    after each batch: several shards)."""
    root = tmp_path_factory.mktemp("faults")
    make_tiny_model("llama").save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    clt = write_clt(root / "clt", random_clt_tensors(3, 32, 48, threshold=0.1))
    base = ["attribute", "--model", root / "tiny", "--clt", clt, "--prompt", PROMPT,
            "--answer", " the"]
    (root / "texts.txt").write_text(PROMPT + " Paris\n")
    assert run_cli([*base, "--out", root / "ref"])[0] == 0

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attribute_module, "SAVE_EVERY_S", 0.0)
        patch.setattr(AttributionGraph, "to_json", full_disk)
        partial = run_cli([*base, "--out", root / "partial"])
    return SimpleNamespace(root=root, base=base, ref=AttributionGraph.load(
        root / "ref" / "graph.safetensors"), partial=partial)


@pytest.fixture
def out(world, tmp_path):
    """A copy of the interrupted run's output directory (its checkpoint complete)."""
    shutil.copytree(world.root / "partial", tmp_path / "out")
    return tmp_path / "out"


def count_rows(monkeypatch) -> list[int]:
    """Rows per feature-row backward from now on."""
    real, calls = attribute_module.feature_rows, []

    def counting(run, index):
        calls.append(len(index))
        return real(run, index)

    monkeypatch.setattr(attribute_module, "feature_rows", counting)
    return calls


def assert_resumes_whole(world, out: Path, monkeypatch) -> None:
    """A rerun computes no row and writes the uninterrupted run's graph; the checkpoint then
    goes."""
    calls = count_rows(monkeypatch)
    code, printed, err = run_cli([*world.base, "--out", out])
    assert code == 0, err
    assert calls == [] and "computed 0" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metadata"]["rows_computed"] == 0
    assert summary["metadata"]["rows_resumed"] == world.ref.n_explored + world.ref.n_logits
    graph = AttributionGraph.load(out / "graph.safetensors")
    pd.testing.assert_frame_equal(edges(graph), edges(world.ref), check_exact=True)
    assert graph.closure == world.ref.closure
    assert not (out / "rows.partial").exists()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


# ------------------------------------------------------------------ exports that fail


def test_rows_survive_a_full_disk_during_export(world):
    """The rows were all computed; the export failed: no graph file, the checkpoint kept."""
    one_error(*world.partial, "No space left on device")
    partial = world.root / "partial"
    manifest = json.loads((partial / "rows.partial" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2 and manifest["pending"] == []
    assert set(manifest["checksums"]) == set(manifest["shards"])
    assert not (partial / "graph.json").exists() and not (partial / "graph.safetensors").exists()
    assert leftovers(partial) == []
    assert not (world.root / "ref" / "rows.partial").exists()  # gone once all was written


def test_a_kill_during_export_loses_no_row(world, out, monkeypatch):
    def killed(self, path):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(AttributionGraph, "save", killed)
        calls = count_rows(patch)
        code, _, err = run_cli([*world.base, "--out", out])
    assert code == 130 and "interrupted" in err and calls == []
    assert (out / "graph.json").exists() and not (out / "graph.safetensors").exists()
    assert (out / "rows.partial" / "manifest.json").exists() and leftovers(out) == []
    assert_resumes_whole(world, out, monkeypatch)


def test_a_full_disk_mid_write_leaves_the_old_file_or_none(world, out, monkeypatch):
    """The disk fills halfway through graph.safetensors: the old file under that name is left
    as it was, no temporary file stays, the checkpoint survives; the rerun computes nothing."""
    import safetensors.torch

    real = safetensors.torch.save_file
    (out / "graph.safetensors").write_bytes(b"an older graph")

    def half_then_full(tensors, filename, metadata=None):
        if "graph" not in Path(filename).name:
            return real(tensors, filename, metadata=metadata)
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", half_then_full)
        error = one_error(*run_cli([*world.base, "--out", out]), "No space left on device")
    assert ".tmp" in error  # the half file was the temporary one
    assert (out / "graph.safetensors").read_bytes() == b"an older graph"
    assert leftovers(out) == [] and (out / "rows.partial" / "manifest.json").exists()
    assert_resumes_whole(world, out, monkeypatch)


def test_attribute_keeps_its_checkpoint_until_told(world, tokenizer, tmp_path, monkeypatch):
    """The API's contract: ``attribute(..., checkpoint=DIR)`` returns with DIR complete (a rerun
    computes nothing); ``remove_checkpoint`` or ``keep_checkpoint=False`` delete it."""
    model = make_tiny_model("llama")
    clt = load_transcoder(world.root / "clt")
    checkpoint = tmp_path / "ck"
    first = attribute_module.attribute(model, tokenizer, clt, PROMPT, " the",
                                       checkpoint=checkpoint)
    assert (checkpoint / "manifest.json").exists()
    assert first.metadata["rows_resumed"] == 0
    assert first.metadata["rows_computed"] == first.n_explored + 1
    calls = count_rows(monkeypatch)
    again = attribute_module.attribute(model, tokenizer, clt, PROMPT, " the",
                                       checkpoint=checkpoint, keep_checkpoint=False)
    assert calls == [] and again.metadata["rows_computed"] == 0
    pd.testing.assert_frame_equal(edges(again), edges(first), check_exact=True)
    assert not checkpoint.exists()
    attribute_module.attribute(model, tokenizer, clt, PROMPT, " the", checkpoint=checkpoint)
    remove_checkpoint(checkpoint)
    assert not checkpoint.exists()


def test_graph_writers_replace_whole_files(world, tmp_path, monkeypatch):
    """graph.save / to_json write a temporary file and rename it: a failure leaves none."""
    path = tmp_path / "graph.json"
    world.ref.to_json(path)
    before = path.read_bytes()

    def failing(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="No space"):
        world.ref.to_json(path, node_threshold=0.5)
    with pytest.raises(OSError, match="No space"):
        world.ref.save(tmp_path / "graph.safetensors")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == \
        ["graph.json"]


# ------------------------------------------------------------------ damaged checkpoints


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # past the safetensors header
    for i in (start + 3, len(data) - 5):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


DAMAGE = {"truncated": (_truncate, "damaged"), "bit-flipped": (_flip, "SHA-256"),
          "deleted": (Path.unlink, "missing")}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_shard_is_refused_naming_it(world, out, monkeypatch, kind):
    damage, needle = DAMAGE[kind]
    checkpoint = out / "rows.partial"
    shard = checkpoint / json.loads((checkpoint / "manifest.json").read_text())["shards"][1]
    damage(shard)
    calls = count_rows(monkeypatch)
    one_error(*run_cli([*world.base, "--out", out]), str(shard), needle,
              f"remove {checkpoint} to start afresh")
    assert calls == [] and not (out / "graph.json").exists()
    assert (checkpoint / "manifest.json").exists()  # nothing is cleared behind the user's back


def test_a_corrupt_manifest_is_refused_naming_it(world, out):
    manifest = out / "rows.partial" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    one_error(*run_cli([*world.base, "--out", out]), str(manifest),
              f"remove {out / 'rows.partial'}")


def _checkpoint(path: Path, n_features: int = 6) -> tuple[Checkpoint, RowStore]:
    """A checkpoint of two shards: the target row, then features 0-2; features 3-4 pending."""
    n_columns = n_features + 4
    store = RowStore(n_columns)
    point = Checkpoint(path, {"graph": "g"}, every_s=0.0)
    store.append(torch.tensor([n_columns]), torch.arange(1.0, n_columns + 1)[None],
                 torch.tensor([0.5]), torch.tensor([1.0]))
    point.maybe_save(store, torch.tensor([0, 1, 2]))
    rows = torch.tril(torch.ones(3, n_columns), diagonal=-1)
    store.append(torch.tensor([0, 1, 2]), rows, torch.zeros(3), torch.ones(3))
    point.maybe_save(store, torch.tensor([3, 4]))
    return point, store


def _rewrite(path: Path, edit) -> None:
    """Apply ``edit`` to the manifest's JSON."""
    manifest = path / "manifest.json"
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_text(json.dumps(data))


def _forge_shard(path: Path, edit) -> None:
    """Rewrite shard 1 with ``edit`` applied to its tensors and fix its checksum: damage the
    SHA-256 cannot see."""
    from safetensors.torch import load_file, save_file

    shard = path / "shard-00001.safetensors"
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    _rewrite(path, lambda m: m["checksums"].update({shard.name: {
        "bytes": shard.stat().st_size, "sha256": file_digest(shard)}}))


FORGED = {
    "node outside the graph": lambda t: t["rows.nodes"].__setitem__(0, -16777136),
    "column outside the graph": lambda t: t["rows.columns"].__setitem__(0, -3),
    "node twice": lambda t: t["rows.nodes"].__setitem__(1, 0),
    "value not finite": lambda t: t["rows.values"].__setitem__(0, float("nan")),
    "counts off": lambda t: t["rows.counts"].__setitem__(0, 99),
}
MANIFESTS = {
    "pending outside": lambda m: m.update(pending=[3, 99]),
    "pending overflows": lambda m: m.update(pending=[2**70]),
    "pending done": lambda m: m.update(pending=[1]),
    "shard name escapes": lambda m: m["shards"].__setitem__(1, "../../etc.safetensors"),
    "no checksum": lambda m: m.update(checksums={}),
    "old schema": lambda m: m.update(schema_version=1),
    "not ours": lambda m: m.update(format="other"),
}


@pytest.mark.parametrize("case", [*FORGED, *MANIFESTS])
def test_checkpoint_load_refuses_rows_that_cannot_be_this_graphs(tmp_path, case):
    """Past the checksums: rows and a queue that cannot belong to the graph are refused too
    (a node of -16777136 once reached ``scores()`` as an IndexError)."""
    point, store = _checkpoint(tmp_path / "ck")
    assert Checkpoint(tmp_path / "ck", {"graph": "g"}, 0.0).load(store.n_columns, 6)[0].n_rows \
        == 4
    if case in FORGED:
        _forge_shard(tmp_path / "ck", FORGED[case])
    else:
        _rewrite(tmp_path / "ck", MANIFESTS[case])
    with pytest.raises(CheckpointMismatchError,
                       match=re.escape(f"remove {tmp_path / 'ck'} to start afresh")):
        Checkpoint(tmp_path / "ck", {"graph": "g"}, 0.0).load(store.n_columns, 6)


def test_remove_checkpoint_deletes_only_its_own_files(tmp_path):
    _checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    remove_checkpoint(tmp_path / "ck")
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["notes.txt"]
    _checkpoint(tmp_path / "ck2")
    remove_checkpoint(tmp_path / "ck2")
    assert not (tmp_path / "ck2").exists()
    remove_checkpoint(tmp_path / "absent")  # nothing to do


def test_a_graph_file_with_rows_outside_the_graph_is_refused(world, tmp_path):
    graph = AttributionGraph.load(world.root / "ref" / "graph.safetensors")
    graph.rows.blocks[0].columns[0] = -16777136
    graph.save(tmp_path / "bad.safetensors")
    with pytest.raises(GraphFileError,
                       match=r"bad.safetensors is a damaged .*: a stored column is outside"):
        AttributionGraph.load(tmp_path / "bad.safetensors")


# ------------------------------------------------------------------ flags, before any work

BAD_FLAGS = [
    (["--max-links", "-1"], "--max-links"),
    (["--max-links", "0"], "--max-links"),
    (["--k", "0"], "--k"),
    (["--node-threshold", "1.5"], "--node-threshold"),
    (["--edge-threshold", "nan"], "--edge-threshold"),
    (["--memory-mb", "nan"], "--memory-mb"),
    (["--memory-mb", "0"], "--memory-mb"),
    (["--max-feature-nodes", "-1"], "--max-feature-nodes"),
    (["--target", "difference"], "other token"),
    (["--other", " Rome"], "only read by target='difference'"),
    (["--prompt", ""], "--prompt"),
]


@pytest.mark.parametrize("flags,needle", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_before_any_work(world, tmp_path, monkeypatch, flags, needle):
    def never(*args, **kwargs):
        raise AssertionError("loaded before the flags were checked")

    monkeypatch.setattr(cli_module, "load_model", never)
    monkeypatch.setattr(cli_module, "load_transcoder", never)
    one_error(*run_cli([*world.base, *flags, "--out", tmp_path / "g"]), needle)
    assert not (tmp_path / "g").exists()  # no rows.partial, no directory at all


def test_attribute_refuses_bad_arguments_before_the_forward(world, tokenizer):
    model = make_tiny_model("llama")
    clt = load_transcoder(world.root / "clt")
    model.forward = None  # any forward would fail with a TypeError
    for kwargs, needle in (({"k": 0}, "k=0"), ({"batch_size": 0}, "batch_size"),
                           ({"target": "difference"}, "other token"),
                           ({"target": "logit"}, "target must"),
                           ({"max_feature_nodes": 1.5}, "max_feature_nodes"),
                           ({"update_interval": 0}, "update_interval")):
        with pytest.raises(InputError, match=needle):
            attribute_module.attribute(model, tokenizer, clt, PROMPT, **kwargs)


def test_a_batch_size_that_cannot_fit_is_refused(world, tokenizer):
    model = make_tiny_model("llama")
    clt = load_transcoder(world.root / "clt")
    with pytest.raises(MemoryCapError, match="batch_size=100000"):
        attribute_module.attribute(model, tokenizer, clt, PROMPT, batch_size=100_000,
                                   memory_mb=64)


def _fake_run(n_features: int, n_layers: int = 4, n_pos: int = 10, forward_mb: float = 10,
              device: str = "cpu"):
    """What the planner reads of a run: feature coordinates and the forward's size."""
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        n_features=n_features, n_layers=n_layers, n_pos=n_pos,
        feature_layer=torch.randint(0, n_layers, (n_features,), generator=g),
        feature_position=torch.randint(0, n_pos, (n_features,), generator=g),
        encoder_rows=torch.zeros(0), forward_bytes=int(forward_mb * 2**20), decoder_bytes=0,
        n_columns=n_features + n_layers * n_pos + n_pos, inputs=lambda: [torch.zeros(100)],
        logits=torch.zeros(1, device=device))


def test_the_feature_budget_counts_what_ranking_reads(monkeypatch):
    """A budget below the active features is ranked by influence, whose edges among the rows
    cost up to 40 bytes each: the default budget leaves room for them, and a requested budget
    that fits only without them is refused before any row is computed."""
    run = _fake_run(5000)
    order = torch.arange(run.n_features)
    memory_mb = 200 + 10 + row_bytes(run) / 2**20  # 200 MB beside the forward and a row
    budget = feature_budget(run, memory_mb, 1, None, order)
    with monkeypatch.context() as patch:
        patch.setattr(budget_module, "INFLUENCE_BYTES", 0)
        rows_only = feature_budget(run, memory_mb, 1, None, order)
    assert 0 < budget < rows_only < run.n_features
    with pytest.raises(MemoryCapError, match="to rank them"):
        feature_budget(run, memory_mb, 1, rows_only, order)
    assert feature_budget(run, memory_mb, 1, budget, order) == budget
    with pytest.raises(MemoryCapError, match=" 0 MB to rank them"):  # every row: no ranking
        feature_budget(run, memory_mb, 1, run.n_features, order)


def test_a_gpu_runs_rows_are_planned_in_the_hosts_memory():
    """On the CPU the row store shares memory_mb with the forward (and a budget's store is
    kept out of the batch); a GPU's run stores its rows on the host, so memory_mb (the GPU's)
    does not refuse them (the 2,048-token refusal of issue 54)."""
    run = _fake_run(5000)
    order = torch.arange(run.n_features)
    memory_mb = 10 + 1 + row_bytes(run) / 2**20  # 1 MB beside the forward and a row
    with pytest.raises(MemoryCapError, match="max_feature_nodes=5000"):
        feature_budget(run, memory_mb, 1, run.n_features, order)
    assert budget_module.store_bytes(run, 5000, order) > 2**20
    gpu = _fake_run(5000, device="meta")
    assert feature_budget(gpu, memory_mb, 1, gpu.n_features, order) == 5000
    assert budget_module.store_bytes(gpu, 5000, order) == 0


# ------------------------------------------------------------------ labels


def test_a_labels_row_that_is_not_integers_is_refused_naming_file_and_row(world, tmp_path,
                                                                          monkeypatch):
    bad = tmp_path / "labels.csv"
    bad.write_text("layer,feature,label\n0,3,fine\n1.9,6.7,x\n")
    with pytest.raises(InputError, match=r"labels.csv: row 2 \(line 3\) has layer '1.9'"):
        read_labels(bad)
    monkeypatch.setattr(cli_module, "load_model", lambda *a: pytest.fail("model loaded"))
    one_error(*run_cli([*world.base, "--labels", bad, "--out", tmp_path / "g"]), str(bad),
              "row 2")
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("name,text,needle", [
    ("neg.csv", "layer,feature,label\n-1,3,x\n", "row 1"),
    ("word.tsv", "layer\tfeature\tlabel\n1\tsix\tx\n", "row 1"),
    ("float.json", '[{"layer": 1, "feature": 6.5, "label": "x"}]', "record 1"),
    ("bool.json", '[{"layer": true, "feature": 6, "label": "x"}]', "record 1"),
    ("clash.csv", "layer,feature,label\n1,6,a\n1,6,b\n", "row 2 (line 3) labels layer 1, "
                                                          "feature 6 'b', but row 1"),
    ("ragged.csv", "layer,feature,label\n1,6\n", "has 2 fields"),
    ("columns.csv", "layer,feat,label\n1,6,x\n", "need columns"),
    ("empty.csv", "", "empty"),
    ("header.csv", "layer,feature,label\n", "holds no labels"),
    ("broken.json", "{not json", "not valid JSON"),
    ("scalar.json", "3", "a list of records"),
    ("key.json", '{"16": "x"}', "not 'layer/feature'"),
    ("record.json", '[3]', "record 1 is a int"),
    ("null.json", '[{"layer": 1, "feature": 2, "label": null}]', "text expected"),
    ("binary.csv", b"\xff\xfe\x00layer", "not a readable CSV"),
])
def test_bad_labels_files_name_the_file(tmp_path, name, text, needle):
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    with pytest.raises(InputError) as refused:
        read_labels(path)
    assert str(path) in str(refused.value) and needle in str(refused.value)


def test_labels_accept_exact_integers_in_every_spelling(tmp_path):
    csv_file = tmp_path / "ok.csv"
    csv_file.write_text('layer,feature,clerp\n"1",6,a\n2.0,7,"b, c"\n1,6,a\n\n')
    assert read_labels(csv_file) == {(1, 6): "a", (2, 7): "b, c"}
    json_file = tmp_path / "ok.json"
    json_file.write_text(json.dumps({"1/6": "a", "2/7": "b"}))
    assert read_labels(json_file) == {(1, 6): "a", (2, 7): "b"}
    json_file.write_text(json.dumps([{"layer": "1", "feature": 6.0, "label": 3}]))
    assert read_labels(json_file) == {(1, 6): "3"}


# ------------------------------------------------------------------ transcoders and data


def test_a_malformed_config_yaml_names_the_file(world, tmp_path, monkeypatch):
    mntss = write_clt(tmp_path / "mntss", random_clt_tensors(3, 32, 8))
    (mntss / "config.yaml").write_text("model_kind: [unclosed\n  : - :")
    tracer = write_circuit_tracer(tmp_path / "tracer", random_set(3, 32, 8)).parent
    (tracer / "config.yaml").write_text("feature_input_hook: {a: 1\n")
    for root in (mntss, tracer):
        with pytest.raises(TranscoderFormatError,
                           match=re.escape(f"{root / 'config.yaml'} is not YAML")):
            load_transcoder(root)
    (tracer / "config.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TranscoderFormatError, match="config.yaml is not YAML"):
        load_transcoder(tracer / "config.yaml")
    monkeypatch.setattr(cli_module, "load_model", lambda *a: pytest.fail("model loaded"))
    for root in (mntss, tracer):
        args = [*world.base[:4], root, *world.base[5:], "--out", tmp_path / "g"]
        one_error(*run_cli(args), str(root / "config.yaml"))
        one_error(*run_cli(["clt-check", "--model", world.root / "tiny", "--clt", root,
                            "--data", world.root / "texts.txt"]), "config.yaml")


@pytest.mark.parametrize("records,needle", [
    ([{"prompt": PROMPT, "attribute": " Paris"}, {"prompt": PROMPT}], "record 1"),
    ([{"attribute": " Paris"}], "record 0"),
    ([[PROMPT, " Paris"]], "record 0 (counting from 0) is a list"),
    ({"prompt": PROMPT}, "a JSON list of records"),
    ("{not json", "not valid JSON"),
])
def test_clt_check_refuses_malformed_records(world, tmp_path, monkeypatch, records, needle):
    data = tmp_path / "facts.json"
    data.write_text(records if isinstance(records, str) else json.dumps(records))
    monkeypatch.setattr(cli_module, "load_model", lambda *a: pytest.fail("model loaded"))
    one_error(*run_cli(["clt-check", "--model", world.root / "tiny", "--clt",
                        world.root / "clt", "--data", data]), str(data), needle)


def test_ctrl_c_among_the_rows_keeps_every_finished_row(tmp_path, tokenizer, monkeypatch):
    """Ctrl-C while a batch of rows is computed (long after the last periodic save): the rows
    finished so far are saved at once, the unfinished batch goes back to the queue's head, and
    the rerun computes only what was missing, giving the uninterrupted graph exactly."""
    from pyvene_causaltrace.attribution import attribute
    from pyvene_causaltrace.transcoders import load_from_disk

    model = make_tiny_model("llama", init=0.2)
    clt = load_from_disk(str(write_clt(tmp_path / "clt", random_clt_tensors(3, 32, 48,
                                                                             threshold=0.1))))
    whole = attribute(model, tokenizer, clt, PROMPT, batch_size=16)
    monkeypatch.setattr(attribute_module, "SAVE_EVERY_S", 1e9)  # no periodic save
    real, calls, once = attribute_module.feature_rows, [], [True]

    def interrupted(run, index):
        calls.append(len(index))
        if len(calls) == 3 and once:
            once.clear()
            raise KeyboardInterrupt
        return real(run, index)

    monkeypatch.setattr(attribute_module, "feature_rows", interrupted)
    checkpoint = tmp_path / "rows.partial"
    with pytest.raises(KeyboardInterrupt):
        attribute(model, tokenizer, clt, PROMPT, batch_size=16, checkpoint=checkpoint)
    calls.clear()
    resumed = attribute(model, tokenizer, clt, PROMPT, batch_size=16, checkpoint=checkpoint)
    assert resumed.metadata["rows_resumed"] == whole.n_logits + 32  # logit rows, 2 batches
    assert sum(calls) == whole.n_features - 32
    pd.testing.assert_frame_equal(resumed.to_dataframe(), whole.to_dataframe(), check_exact=True)
