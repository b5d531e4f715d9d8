"""Attribution across ranks (torch.distributed, gloo on CPU) builds the one process's graph.

Two ``torchrun`` launches (2 and 3 ranks) run every case of a tiny Llama and GPT-2 with a CLT
and a per-layer set with skip, the transcoder sharded by feature (uneven: 47 features) or whole
with the rows split; the graphs are compared here with one process's: the same active features
in the same order, the same logit nodes and rows computed, every edge within 1e-6 of its row's
largest, the same closure and the same nodes kept by pruning. Then the faults: a rank killed
mid-rows makes the other exit with one error line, no graph written, and a rerun resumes from
the checkpoint to the uninterrupted graph; ranks holding other transcoders are refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyvene_causaltrace.attribution import AttributionGraph, attribute
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.transcoders import load_transcoder

from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt
from transcoder_fixtures import random_set, write_circuit_tracer

WORKER = Path(__file__).parent / "_support" / "distributed_worker.py"
ROOT = Path(__file__).parent.parent
#: Features per layer: 47 splits unevenly over 2 and 3 ranks.
FEATURES = 47


def _case_dir(root: Path, tokenizer, arch: str, kind: str) -> Path:
    folder = root / f"{arch}-{kind}"
    model = make_tiny_model(arch, init=0.2, n_layers=3)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    if kind == "clt":
        write_clt(folder / "transcoder", random_clt_tensors(3, 32, FEATURES, threshold=0.1))
    else:
        write_circuit_tracer(folder / "transcoder",
                             random_set(3, 32, FEATURES, skip=True, threshold=0.05))
    return folder


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _torchrun(world: int, cases: list[dict], tmp: Path, timeout: float = 120):
    cases_file = tmp / f"cases_w{world}.json"
    cases_file.write_text(json.dumps(cases))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={world}", str(WORKER), str(cases_file)],
        env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


CASES = [(arch, kind, split) for arch in ("llama", "gpt2") for kind in ("clt", "set")
         for split in ("features", "rows")]
#: A budget below the active features: rows chosen by influence, re-ranked between batches.
BUDGET = {"budget": 12, "batch": 4}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tokenizer):
    """Every case's folder, after one torchrun launch of 2 ranks and one of 3."""
    tmp = tmp_path_factory.mktemp("distributed")
    folders = {(arch, kind): _case_dir(tmp, tokenizer, arch, kind)
               for arch, kind in {(a, k) for a, k, _ in CASES}}
    cases = [{"dir": str(folders[arch, kind]), "split": split, "prompt": PROMPT,
              **(BUDGET if (arch, kind) == ("llama", "clt") else {})}
             for arch, kind, split in CASES]
    for world in (2, 3):
        done = _torchrun(world, cases, tmp)
        assert done.returncode == 0, done.stderr[-4000:]
    return folders


def _single(folder: Path, tokenizer_dir: Path, budget: dict) -> AttributionGraph:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    transcoder = load_transcoder(str(folder / "transcoder"))
    return attribute(model, tokenizer, transcoder, PROMPT,
                     max_feature_nodes=budget.get("budget"), batch_size=budget.get("batch"))


def assert_same_graph(one: AttributionGraph, many: AttributionGraph) -> None:
    """The distributed graph is the one process's (module docstring)."""
    for name in ("feature_layer", "feature_position", "feature_id"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name
    moved = float(((one.activation - many.activation).abs()
                   / one.activation.abs().max()).max())
    assert moved <= 1e-6, f"activations moved by {moved:.2e} of the largest"
    assert one.targets == many.targets and one.input_ids == many.input_ids
    nodes = one.rows.nodes.sort().values
    assert torch.equal(nodes, many.rows.nodes.sort().values), "other rows were computed"
    order_one = one.rows.row_of_node(one.layout.n_nodes)[nodes]
    order_many = many.rows.row_of_node(many.layout.n_nodes)[nodes]
    a, b = one.rows.dense(order_one), many.rows.dense(order_many)
    scale = a.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert float(((a - b).abs() / scale).max()) <= 1e-6
    assert one.closure.target == pytest.approx(many.closure.target, rel=1e-6, abs=1e-7)
    assert abs(one.closure.relative - many.closure.relative) <= 1e-6
    assert torch.equal(one.prune().node_mask, many.prune().node_mask)


@pytest.mark.parametrize(("arch", "kind", "split"), CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_build_the_one_process_graph(launched, arch, kind, split, world):
    folder = launched[arch, kind]
    budget = BUDGET if (arch, kind) == ("llama", "clt") else {}
    one = _single(folder, folder / "model", budget)
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


def test_a_graph_with_one_rank_missing_differs(launched):
    """The control for the equality: a graph built from one rank's shard alone is refused,
    and the check above tells two different graphs apart."""
    folder = launched["llama", "set"]
    one = _single(folder, folder / "model", {})
    shard = load_transcoder(str(folder / "transcoder"), shard=(0, 2))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    with pytest.raises(InputError, match="one rank's shard"):
        attribute(model, tokenizer, shard, PROMPT)
    other = AttributionGraph.load(launched["gpt2", "set"] / "graph_rows_w2.safetensors")
    with pytest.raises(AssertionError):
        assert_same_graph(one, other)
