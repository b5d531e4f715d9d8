"""Attribution across ranks (torch.distributed, gloo on CPU) builds the one process's graph.

Two ``torchrun`` launches (2 and 3 ranks) run every case of a tiny Llama and GPT-2 with a CLT
and a per-layer set with skip, the transcoder sharded by feature (uneven: 47 features) or whole
with the rows split, and (3 ranks) on Llama a per-layer TopK set and a ByteDance joint TopK CLT
sharded by feature (their top-k a collective over the ranks), and (2 ranks) a CLT with a Lorsa
on two layers (``attention=``) sharded by OV head beside it; the graphs are compared here with one
process's: the same active features in the same order, the same logit nodes and rows computed,
every edge within 1e-6 of its row's largest, the same closure and the same nodes kept by
pruning. Then the faults: a rank killed mid-rows makes the other exit with one error line, no
graph written, and a rerun resumes from the checkpoint to the uninterrupted graph; ranks holding
other transcoders are refused.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _support.distributed_worker import lorsa_inputs
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa
from safetensors.torch import load_file
from transcoder_fixtures import (
    bytedance_tensors,
    random_set,
    write_bytedance,
    write_circuit_tracer,
)

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.attribution.many import INDEX, attribute_many, read_prompts
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.transcoders.lorsa import head_range, load_lorsa

#: Every test here but the prompts file's line checks starts processes; the graph equality and
#: the prompts spread over ranks stay in the default tier (core: the issue's acceptance), the
#: faults and the command line are slow (the extra tier).
pytestmark = pytest.mark.process

WORKER = Path(__file__).parent / "_support" / "distributed_worker.py"
ROOT = Path(__file__).parent.parent
#: Features per layer: 47 splits unevenly over 2 and 3 ranks.
FEATURES = 47
#: The Lorsa case: OV heads per layer (45 = 32 x 1.40625: 23 + 22 over 2 ranks), QK heads (3:
#: groups of 15, so rank 0's last group is cut), its layers.
LORSA_HEADS, LORSA_QK, LORSA_LAYERS = 45, 3, (0, 2)


def _case_dir(root: Path, tokenizer, arch: str, kind: str) -> Path:
    folder = root / f"{arch}-{kind}"
    model = make_tiny_model(arch, init=0.2, n_layers=3)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    if kind in ("clt", "lorsa"):
        write_clt(folder / "transcoder", random_clt_tensors(3, 32, FEATURES, threshold=0.1))
    elif kind == "topk":  # per-layer TopK: each position's 5 best of a layer's 47
        write_circuit_tracer(folder / "transcoder",
                             random_set(3, 32, FEATURES, activation="topk", k=5))
    elif kind == "joint":  # ByteDance: each position's 3 x 4 best of all layers' features
        write_bytedance(folder / "transcoder", bytedance_tensors(3, 32, FEATURES, k=4))
    else:
        write_circuit_tracer(folder / "transcoder",
                             random_set(3, 32, FEATURES, skip=True, threshold=0.05))
    if kind == "lorsa":  # a Lorsa on two layers beside the CLT
        for layer in LORSA_LAYERS:
            cfg = peer_config(layer=layer, n_qk=LORSA_QK, expansion=LORSA_HEADS / 32)
            write_peer_lorsa(folder / "lorsa" / f"L{layer}", cfg, peer_tensors(cfg, seed=layer),
                             (2.5, 0.7))
    return folder


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _torchrun(world: int, cases: list[dict], tmp: Path) -> subprocess.Popen:
    """``torchrun --standalone`` of ``world`` ranks over ``cases``, started (not waited for)."""
    cases_file = tmp / f"cases_w{world}.json"
    cases_file.write_text(json.dumps(cases))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={world}", str(WORKER), str(cases_file)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


CASES = [(arch, kind, split) for arch in ("llama", "gpt2") for kind in ("clt", "set")
         for split in ("features", "rows")]
#: Three ranks run every model and transcoder once, each split on two of them (two cores:
#: three ranks take most of the time), and the top-k kinds (per-layer and joint) sharded by
#: feature only (the rows split runs the whole transcoder, as the other kinds' cases show;
#: three ranks, not two: the file's time stays under a minute).
CASES_3 = [("llama", "clt", "features"), ("llama", "set", "rows"), ("gpt2", "clt", "rows"),
           ("gpt2", "set", "features"), ("llama", "topk", "features"),
           ("llama", "joint", "features")]
PAIRS = [(world, *case) for world, cases in ((2, CASES), (3, CASES_3)) for case in cases]
#: A prompts file's entries for attribute_many (three prompts over two ranks).
MANY = [{"prompt": PROMPT}, {"prompt": "Miles Davis plays the", "answer": " trumpet"},
        {"prompt": "Paris is the capital of", "target": "demeaned_vocab"}]
#: A budget below the active features: rows chosen by influence, re-ranked between batches.
BUDGET = {"budget": 12, "batch": 4}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tokenizer):
    """Every case's folder, after a ``torchrun`` launch of 2 ranks and 3 plain processes (the
    ``env://`` variables a user's own launcher sets), run at the same time (each rank spends
    most of its time importing; two cores), while this process builds the one-process
    graphs."""
    tmp = tmp_path_factory.mktemp("distributed")
    folders: dict = {(arch, kind): _case_dir(tmp, tokenizer, arch, kind)
               for arch, kind in {(a, k) for a, k, _ in CASES + CASES_3}}
    launches = []
    for world, chosen in ((2, CASES), (3, CASES_3)):
        cases = [{"dir": str(folders[arch, kind]), "split": split, "prompt": PROMPT,
                  **(BUDGET if (arch, kind) == ("llama", "clt") else {})}
                 for arch, kind, split in chosen]
        if world == 2:
            cases.append({"dir": str(folders["llama", "set"]), "many": MANY,
                          "out": str(tmp / "many")})
            folders["llama", "lorsa"] = _case_dir(tmp, tokenizer, "llama", "lorsa")
            cases += [{"dir": str(folders["llama", "lorsa"]), "split": "features",
                       "prompt": PROMPT, "lorsa": True},
                      {"dir": str(folders["llama", "lorsa"]), "lorsa_encode": True}]
            launches.append(_torchrun(world, cases, tmp))
        else:  # plain processes with the env:// variables: a user's own launcher
            launches += _spawn(world, cases, tmp, f"cases_w{world}")
    for (arch, kind), folder in folders.items():
        _single(folder, folder / "model", _budget(arch, kind))
    for process in launches:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-4000:]
    folders["many"] = tmp / "many"
    return folders


def _budget(arch: str, kind: str) -> tuple:
    return tuple(BUDGET.items()) if (arch, kind) == ("llama", "clt") else ()


@functools.cache
def _single(folder: Path, tokenizer_dir: Path, budget: tuple = ()) -> AttributionGraph:
    """One process's graph of a case (built once per case; through ``folder/lorsa`` where
    there is one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds: only when used

    budget = dict(budget)

    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    transcoder = load_transcoder(str(folder / "transcoder"))
    lorsa = load_lorsa(folder / "lorsa") if (folder / "lorsa").is_dir() else None
    return attribute(model, tokenizer, transcoder, PROMPT,
                     max_feature_nodes=budget.get("budget"), batch_size=budget.get("batch"),
                     attention=lorsa)


def _plain(value: object) -> object:
    """The logit nodes, comparable: every non-float leaf as ``path=value`` (mapping keys as
    strings, JSON's), and the floats (the probabilities of another process's forward: rounding)
    in a list for approx."""
    flat: list = []
    numbers: list = []

    def walk(item, path):
        if isinstance(item, dict):
            for key in sorted(item, key=str):
                walk(item[key], f"{path}.{key}")
        elif isinstance(item, list | tuple):
            for i, x in enumerate(item):
                walk(x, f"{path}[{i}]")
        elif isinstance(item, float):
            numbers.append(item)
        else:
            flat.append(f"{path}={item}")
    walk(value, "")
    return flat, numbers


def assert_same_graph(one: AttributionGraph, many: AttributionGraph,
                      tolerance: float = 1e-6) -> None:
    """The distributed graph is the one process's (module docstring): edges within
    ``tolerance`` of their row's largest."""
    for name in ("feature_layer", "feature_position", "feature_id"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name
    moved = float(((one.activation - many.activation).abs()
                   / one.activation.abs().max()).max())
    assert moved <= tolerance, f"activations moved by {moved:.2e} of the largest"
    assert one.input_ids == many.input_ids
    (words_one, numbers_one), (words_many, numbers_many) = _plain(one.targets), \
        _plain(many.targets)
    assert words_one == words_many
    assert numbers_one == pytest.approx(numbers_many, rel=1e-5)
    nodes = one.rows.nodes.sort().values
    assert torch.equal(nodes, many.rows.nodes.sort().values), "other rows were computed"
    order_one = one.rows.row_of_node(one.layout.n_nodes)[nodes]
    order_many = many.rows.row_of_node(many.layout.n_nodes)[nodes]
    a, b = one.rows.dense(order_one), many.rows.dense(order_many)
    scale = a.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert float(((a - b).abs() / scale).max()) <= tolerance
    assert one.closure.target == pytest.approx(many.closure.target, rel=1e-6, abs=1e-7)
    assert abs(one.closure.relative - many.closure.relative) <= tolerance
    assert torch.equal(one.prune().node_mask, many.prune().node_mask)


@pytest.mark.core
@pytest.mark.parametrize(("world", "arch", "kind", "split"), PAIRS)
def test_ranks_build_the_one_process_graph(launched, arch, kind, split, world):
    folder = launched[arch, kind]
    budget = dict(_budget(arch, kind))
    one = _single(folder, folder / "model", _budget(arch, kind))
    many = AttributionGraph.load(folder / f"graph_{split}_w{world}.safetensors")
    assert_same_graph(one, many)
    if budget:  # the control: the budget bound, so the ranking chose the rows
        assert one.n_explored == budget["budget"] < one.n_features
    held = json.loads((folder / f"graph_{split}_w{world}.json").read_text())
    assert held["world"] == world and held["mode"] == split
    whole = load_transcoder(str(folder / "transcoder")).resident_bytes()
    if split == "features":  # each rank holds its slice of the feature tensors, not the whole
        assert max(held["transcoder_bytes_per_rank"]) < whole
    else:
        assert held["transcoder_bytes_per_rank"] == [whole] * world


@pytest.mark.core
def test_ranks_build_the_one_process_graph_through_a_sharded_lorsa(launched):
    """A CLT sharded by feature and a Lorsa sharded by OV head (issue 56 item 1): the graph
    of one process with the whole of both, Lorsa heads and errors included; each rank held
    its slice of the Lorsa's OV-head tensors."""
    folder = launched["llama", "lorsa"]
    one = _single(folder, folder / "model")
    many = AttributionGraph.load(folder / "graph_features_w2.safetensors")
    assert one.lorsa_layers == list(LORSA_LAYERS) == many.lorsa_layers
    assert one.n_features - one.first_lorsa_node > 10, "too few Lorsa nodes to compare"
    assert one.first_lorsa_node == many.first_lorsa_node
    assert_same_graph(one, many)
    held = json.loads((folder / "graph_features_w2.json").read_text())
    lorsa = load_lorsa(folder / "lorsa")
    whole = sum(lorsa[layer].resident_bytes() for layer in lorsa.layers)
    assert held["mode"] == "features" and len(held["lorsa_bytes_per_rank"]) == 2
    assert max(held["lorsa_bytes_per_rank"]) < whole


@pytest.mark.core
def test_a_sharded_lorsa_encodes_and_decodes_as_the_whole_over_two_ranks(launched):
    """Each rank's shard (rank 0's cuts a QK group) encodes its OV heads with the TopK a
    collective, and the partial decodes summed are the whole's output. The control: each
    shard's own top-k alone would keep more heads than the whole's TopK."""
    folder = launched["llama", "lorsa"]
    got = load_file(str(folder / "lorsa_encode_w2.safetensors"))
    whole = load_lorsa(folder / "lorsa")
    for layer in LORSA_LAYERS:
        one = whole[layer]
        assert one.cfg.n_ov_heads == LORSA_HEADS
        assert head_range(LORSA_HEADS, 0, 2)[1] % one.cfg.group != 0
        x = lorsa_inputs(one.cfg.d_model)
        acts = one.encode(x)
        assert torch.equal(got[f"acts.{layer}"] != 0, acts != 0)
        torch.testing.assert_close(got[f"acts.{layer}"], acts, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[f"out.{layer}"], one.decode(acts), rtol=1e-5, atol=1e-6)
        scored = torch.relu(one.hidden_pre(x) * one.W_O.norm(dim=1))
        alone = sum(scored[..., slice(*head_range(LORSA_HEADS, rank, 2))].ne(0).sum(-1)
                    .clamp(max=one.cfg.top_k) for rank in range(2))
        assert bool((alone > acts.ne(0).sum(-1)).any())


@pytest.mark.core
def test_a_graph_with_one_rank_missing_differs(launched):
    """The control for the equality: a graph built from one rank's shard alone is refused,
    and the check above tells two different graphs apart."""
    folder = launched["llama", "set"]
    one = _single(folder, folder / "model")
    shard = load_transcoder(str(folder / "transcoder"), shard=(0, 2))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    with pytest.raises(InputError, match="one rank's shard"):
        attribute(model, tokenizer, shard, PROMPT)
    other = AttributionGraph.load(launched["gpt2", "set"] / "graph_rows_w2.safetensors")
    with pytest.raises(AssertionError):
        assert_same_graph(one, other)


@pytest.mark.core
def test_prompts_spread_over_ranks_are_the_serial_graphs_and_resume(launched):
    """attribute_many under two ranks: one directory per prompt (rank 0 took prompts 0 and 2,
    rank 1 prompt 1), each the graph a serial attribute() builds, and an index; a rerun in one
    process builds only what is missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds: only when used

    out, folder = launched["many"], launched["llama", "set"]
    index = json.loads((out / INDEX).read_text())
    assert index["world"] == 2
    assert [entry["prompt"] for entry in index["prompts"]] == [p["prompt"] for p in MANY]
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    transcoder = load_transcoder(str(folder / "transcoder"))
    for i, entry in enumerate(MANY):
        serial = attribute(model, tokenizer, transcoder, entry["prompt"], entry.get("answer"),
                           target=entry.get("target", "demeaned"))
        # each rank built its graph alone, as a serial run does, in another process (whose
        # thread count may differ from this one's: rounding up to ~1e-6 of a row's largest)
        assert_same_graph(serial, AttributionGraph.load(out / f"{i:05d}" / "graph.safetensors"),
                          tolerance=1e-5)
        assert not (out / f"{i:05d}" / "rows.partial").exists()
    kept = (out / "00000" / "graph.safetensors").stat().st_mtime_ns
    (out / "00001" / "graph.safetensors").unlink()
    again = attribute_many(model, tokenizer, transcoder, MANY, out)
    assert [e["answer"] for e in again] == [e["answer"] for e in index["prompts"]]
    assert (out / "00000" / "graph.safetensors").stat().st_mtime_ns == kept
    assert (out / "00001" / "graph.safetensors").exists()
    with pytest.raises(InputError, match="needs the whole transcoder"):
        attribute_many(model, tokenizer, load_transcoder(str(folder / "transcoder"),
                                                         shard=(0, 2)), MANY, out)


@pytest.mark.core
def test_a_prompts_file_is_checked_line_by_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "colour": 1}\n')
    with pytest.raises(InputError, match=r"prompts.jsonl:3: unknown field\(s\) colour"):
        read_prompts(path)
    path.write_text('{"prompt": "a", "target": "sideways"}\n')
    with pytest.raises(InputError, match=r"prompts.jsonl:1: 'target' must be one of"):
        read_prompts(path)
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "answer": " c"}\n')
    assert read_prompts(path)[1] == {"prompt": "b", "answer": " c", "target": None}


# ----------------------------------------------------------------------------------- faults
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, cases: list[dict], tmp: Path, name: str) -> list[subprocess.Popen]:
    """The ranks as plain processes (no torchrun agent that would stop the others when one
    dies: what the survivors do on their own is what is tested)."""
    cases_file = tmp / f"{name}.json"
    cases_file.write_text(json.dumps(cases))
    port = _free_port()
    return [subprocess.Popen(
        [sys.executable, str(WORKER), str(cases_file)],
        env={**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for rank in range(world)]


@pytest.mark.slow
def test_a_killed_rank_fails_the_other_and_a_rerun_resumes_the_graph(tmp_path, tokenizer):
    """kill -9 of rank 1 mid-rows: rank 0 exits non-zero with one error line within 60 s and
    writes no graph; the rerun resumes from rank 0's checkpoint and gives the uninterrupted
    graph."""
    folder = _case_dir(tmp_path, tokenizer, "llama", "clt")
    checkpoint = tmp_path / "rows.partial"
    case = {"dir": str(folder), "split": "features", "prompt": PROMPT, "batch": 4,
            "checkpoint": str(checkpoint)}
    ranks = _spawn(2, [{**case, "slow_rows": 0.5}], tmp_path, "slow")
    manifest = checkpoint / "manifest.json"
    deadline = time.monotonic() + 90
    while not manifest.exists():  # rows are being computed and saved
        assert time.monotonic() < deadline and ranks[0].poll() is None, ranks[0].stderr.read()
        time.sleep(0.2)
    time.sleep(1.0)
    ranks[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    _, err = ranks[0].communicate(timeout=60)
    assert time.monotonic() - killed < 60
    assert ranks[0].returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "DistributedError" in lines[0], err[-2000:]
    assert "rank 0 of 2" in lines[0]
    assert not (folder / "graph_features_w2.safetensors").exists()
    saved = json.loads(manifest.read_text())
    resumed_ranks = _spawn(2, [case], tmp_path, "resume")
    for process in resumed_ranks:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
    many = AttributionGraph.load(folder / "graph_features_w2.safetensors")
    assert many.metadata["rows_resumed"] > 0, saved
    assert many.metadata["rows_computed"] < many.n_explored + 1
    assert_same_graph(_single(folder, folder / "model", (("batch", 4),)), many)


@pytest.mark.slow
def test_ranks_with_other_transcoders_are_refused(tmp_path, tokenizer):
    """Fingerprints compared at start: rank 1 holding another transcoder of the same shape
    stops both ranks with one error naming the disagreement, before any row."""
    folder = _case_dir(tmp_path, tokenizer, "gpt2", "set")
    other = write_circuit_tracer(tmp_path / "other",
                                 random_set(3, 32, FEATURES, skip=True, seed=1)).parent
    for split in ("features", "rows"):
        case = {"dir": str(folder), "split": split, "prompt": PROMPT,
                "transcoder_by_rank": {"1": str(other)}}
        for process in _spawn(2, [case], tmp_path, f"other-{split}"):
            _, err = process.communicate(timeout=120)
            assert process.returncode == 1
            assert "the ranks disagree on the transcoder" in err, err[-2000:]


@pytest.mark.slow
def test_the_command_line_under_torchrun(tmp_path, tokenizer):
    """The interface scripts rely on: ``torchrun ... -m pyvene_causaltrace.cli attribute``
    shards the transcoder, rank 0 writes the outputs and summary.json's ``distributed``; with
    ``--prompts`` one graph directory per prompt and the index."""
    folder = _case_dir(tmp_path, tokenizer, "llama", "clt")
    out = tmp_path / "out"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node=2", "-m", "pyvene_causaltrace.cli", "attribute",
              "--model", str(folder / "model"), "--clt", str(folder / "transcoder")]
    command = [*launch, "--prompt", MANY[1]["prompt"], "--answer", MANY[1]["answer"]]
    done = subprocess.run([*command, "--out", str(out)], env=_env(), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["distributed"]["world"] == 2 and summary["distributed"]["mode"] == "features"
    whole = load_transcoder(str(folder / "transcoder")).resident_bytes()
    assert len(summary["distributed"]["transcoder_bytes_per_rank"]) == 2
    assert sum(summary["distributed"]["transcoder_bytes_per_rank"]) < 1.5 * whole
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds: only when used

    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    one = attribute(model, AutoTokenizer.from_pretrained(folder / "model"),
                    load_transcoder(str(folder / "transcoder")), MANY[1]["prompt"],
                    MANY[1]["answer"])
    assert_same_graph(one, AttributionGraph.load(out / "graph.safetensors"))
    assert not (out / "rows.partial").exists()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in MANY))
    # --prompt and --answer are refused beside --prompts (each line gives its own)
    done = subprocess.run([*launch, "--prompts", str(prompts), "--out", str(tmp_path / "many")],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    index = json.loads((tmp_path / "many" / INDEX).read_text())
    assert [e["dir"] for e in index["prompts"]] == ["00000", "00001", "00002"]


@pytest.mark.slow
def test_a_hung_rank_fails_the_other_after_the_collective_timeout(tmp_path, tokenizer):
    """Rank 1 hangs before its first collective: rank 0 exits with one error line once the
    group's timeout (30 s in the worker) passes, not never."""
    folder = _case_dir(tmp_path, tokenizer, "gpt2", "clt")
    case = {"dir": str(folder), "split": "features", "prompt": PROMPT, "hang_rank": 1}
    ranks = _spawn(2, [case], tmp_path, "hang")
    start = time.monotonic()
    try:
        _, err = ranks[0].communicate(timeout=120)
    finally:
        ranks[1].kill()
        ranks[1].communicate()
    assert ranks[0].returncode == 1
    assert 25 < time.monotonic() - start < 110
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "DistributedError" in lines[0] and "rank 0 of 2" in lines[0]
