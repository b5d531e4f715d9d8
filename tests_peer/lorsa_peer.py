"""The Lorsa peer's dump (``tests_peer/lorsa_peer_dump.py``, run in ``.venv-lorsa-peer``) read
on this side, and our graph of the same model, Lorsa and transcoders laid out in its node
space: every node named ``(key, *index)`` as llamascopium names it (``hook_embed``,
``blocks.<l>.hook_{attn,mlp}_out.error``, ``...sae.hook_feature_acts``, ``logits``), so that
the comparison maps nodes by name, never by position.

Only torch and safetensors are needed to read a dump; our graph needs our package (the tests
run in ``.venv-peer``, which has it, or in the main venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("PVCT_LORSA_PEER_VENV", ROOT / ".venv-lorsa-peer"))
PYTHON = VENV / "bin" / "python"
#: ``make test-peer`` sets it: there a missing venv fails the tests instead of skipping them
REQUIRED = bool(os.environ.get("PVCT_LORSA_PEER_REQUIRED"))
#: what the skip says when the peer's venv is missing
MISSING = f"the Lorsa peer's venv {VENV} is missing (make peer-lorsa-env, or make test-peer)"
SKIP = not PYTHON.exists() and not REQUIRED
#: What the comparison measured, for the session's summary (conftest).
RESULTS: dict[str, str] = {}


def run_dump(out: Path, *options: str) -> dict:
    """The dump script in the peer's venv, one thread; its ``graph.json`` and tensors."""
    assert PYTHON.exists(), MISSING  # required (make test-peer) but not built
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)  # the peer's venv imports nothing of ours
    done = subprocess.run([str(PYTHON), str(ROOT / "tests_peer" / "lorsa_peer_dump.py"), str(out),
                           *options], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    sys.stdout.write(done.stdout)
    return read_dump(out)


def read_dump(out: Path) -> dict:
    graph = json.loads((Path(out) / "graph.json").read_text())
    graph["tensors"] = load_file(str(Path(out) / "graph.safetensors"))
    graph["out"] = Path(out)
    return graph


def node(entry) -> tuple:
    """``[key, [index...]]`` as a hashable node."""
    return (entry[0], *entry[1])


# ------------------------------------------------------------------------------ our side


@dataclass
class Ours:
    """Our graph and what built it; ``names[i]``: node ``i``'s name in llamascopium's terms."""

    graph: object
    model: object
    transcoder: object
    lorsa: object
    names: list[tuple]

    @property
    def index(self) -> dict[tuple, int]:
        return {name: i for i, name in enumerate(self.names)}

    def dense(self) -> torch.Tensor:
        """``[n_nodes, n_nodes]`` float64: row ``i`` holds node ``i``'s incoming edges (zero
        for unexplored rows and the logits' columns)."""
        store = self.graph.rows
        n = self.graph.layout.n_nodes
        adjacency = torch.zeros(n, n, dtype=torch.float64)
        adjacency[store.nodes, :store.n_columns] = store.dense(torch.arange(store.n_rows)).double()
        return adjacency


def node_names(graph) -> list[tuple]:
    """Each of our graph's nodes as llamascopium names it (module docstring)."""
    nodes = graph.nodes()
    logits = iter(int(t["token"]) for t in graph.targets)
    hook = {"feature": "hook_mlp_out", "error": "hook_mlp_out", "lorsa": "hook_attn_out",
            "lorsa error": "hook_attn_out"}
    names = []
    for kind, layer, pos, feature in zip(nodes["kind"], nodes["layer"], nodes["position"],
                                         nodes["feature"], strict=True):
        if kind == "token":
            names.append(("hook_embed", int(pos)))
        elif kind == "logit":
            names.append(("logits", next(logits)))
        elif kind in ("error", "lorsa error"):
            names.append((f"blocks.{int(layer)}.{hook[kind]}.error", int(pos)))
        elif kind in ("feature", "lorsa"):
            names.append((f"blocks.{int(layer)}.{hook[kind]}.sae.hook_feature_acts", int(pos),
                          int(feature)))
        else:
            raise AssertionError(f"a {kind} node has no llamascopium twin")
    return names


def our_graph(dump: dict, *, bos: str = "never", lorsa_edit=None, **options) -> Ours:
    """Our graph of the dump's model, its transcoders and Lorsas read with our loaders, with
    llamascopium's conventions (test_lorsa_peer_equality's docstring): BOS spliced
    (``bos="never"``), the vocabulary-demeaned logits, their salient-logit settings.
    ``lorsa_edit(lorsa)`` changes the Lorsa set before attributing (the controls);
    ``options`` go to :func:`attribute` (``transcoder=`` replaces the transcoder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyvene_causaltrace.attribution import attribute
    from pyvene_causaltrace.transcoders import load_transcoder
    from pyvene_causaltrace.transcoders.lorsa import load_lorsa

    out = dump["out"]
    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    transcoder = options.pop("transcoder", None) or load_transcoder(out / "dictionaries")
    lorsa = load_lorsa(out / "dictionaries")
    if lorsa_edit is not None:
        lorsa_edit(lorsa)
    settings = dump["settings"]
    graph = attribute(model, tokenizer, transcoder, dump["prompt"], target="demeaned_vocab",
                      max_n_logits=settings["max_n_logits"],
                      desired_logit_prob=settings["desired_logit_prob"], bos=bos,
                      attention=lorsa, **options)
    return Ours(graph, model, transcoder, lorsa, node_names(graph))


# ---------------------------------------------------------------------------- comparing


def edge_differences(dump: dict, ours: Ours) -> torch.Tensor:
    """Per row of theirs, ``max |ours - theirs|`` over its columns relative to the row's
    largest ``|edge|`` (the larger of the two); our edges laid out in their rows and columns
    by name."""
    index = ours.index
    rows = [index[node(r)] for r in dump["rows"]]
    columns = [index[node(c)] for c in dump["columns"]]
    mine = ours.dense()[rows][:, columns]
    theirs = dump["tensors"]["attribution"].double()
    scale = torch.maximum(mine.abs().amax(1), theirs.abs().amax(1)).clamp_min(1e-30)
    return (mine - theirs).abs().amax(1) / scale
