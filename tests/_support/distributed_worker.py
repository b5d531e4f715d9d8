"""One rank of a distributed attribution test, started by ``torchrun`` (tests/test_distributed.py).

    torchrun --standalone --nproc_per_node N tests/_support/distributed_worker.py CASES.json

``CASES.json``: a list of cases, each ``{"dir": ..., "split": "features" | "rows", "prompt",
"budget", "batch", "checkpoint", "transcoder_by_rank", "slow_rows", "hang_rank"}``, or
``{"dir", "many": [prompts], "out"}`` for ``attribute_many``; ``dir`` holds ``model/`` (a
saved tiny model and tokenizer) and ``transcoder/`` (a transcoder in its on-disk layout).
Rank 0 saves each case's graph as ``dir/graph_<split>_w<world>.safetensors`` and the run's
metadata beside it; an error of the package is one line on stderr and exit status 1. With
``slow_rows`` each batch of rows sleeps that long (a window for the fault tests to kill a rank
mid-rows); with ``checkpoint`` the rows are checkpointed there after every batch; with
``hang_rank`` that rank sleeps before its first collective. With ``"lorsa": true`` the graph
goes through ``dir/lorsa`` (``attention=``; sharded by OV head with ``split="features"``);
``{"dir", "lorsa_encode": true}`` encodes and decodes :func:`lorsa_inputs` with each rank's
shard of ``dir/lorsa`` and rank 0 saves every layer's gathered activations and summed output
as ``dir/lorsa_encode_w<world>.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pyvene_causaltrace import distributed
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.attribution.many import attribute_many
from pyvene_causaltrace.errors import CausalTraceError
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.transcoders.lorsa import load_lorsa


def lorsa_inputs(d_model: int) -> torch.Tensor:
    """The inputs the ``lorsa_encode`` case encodes (the test builds the same)."""
    return torch.randn(2, 9, d_model, generator=torch.Generator().manual_seed(5))


def _lorsa_encode(ranks, folder: Path) -> None:
    from safetensors.torch import save_file

    lorsa = load_lorsa(folder / "lorsa", shard=(ranks.rank, ranks.world))
    out = {}
    for layer in lorsa.layers:
        part = lorsa[layer]
        acts = part.encode(lorsa_inputs(part.cfg.d_model))
        gathered = ranks.all_gather(acts.movedim(-1, 0).contiguous(), "gathering the heads")
        out[f"acts.{layer}"] = torch.cat(gathered).movedim(0, -1).contiguous()
        out[f"out.{layer}"] = ranks.all_reduce(part.decode(acts, partial=True)) + part.b_D
    if ranks.first:
        save_file(out, str(folder / f"lorsa_encode_w{ranks.world}.safetensors"))


def _slow(seconds: float) -> None:
    """Each batch of rows takes ``seconds`` longer, and the checkpoint is saved after each."""
    module = sys.modules["pyvene_causaltrace.attribution.attribute"]
    module.SAVE_EVERY_S = 0.0
    plain = module.feature_rows

    def feature_rows(run, chunk):
        time.sleep(seconds)
        return plain(run, chunk)

    module.feature_rows = feature_rows


def main(cases_file: str) -> int:
    torch.set_num_threads(1)
    ranks = distributed.init(timeout_s=30)
    assert ranks is not None, "run me under torchrun with more than one rank"
    try:
        run_cases(ranks, json.loads(Path(cases_file).read_text()))
    except CausalTraceError as error:  # one line, as the CLI prints it
        print(f"error: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr,
              flush=True)
        return 1
    distributed.finish()
    return 0


def run_cases(ranks, cases: list[dict]) -> None:
    for case in cases:
        folder = Path(case["dir"])
        if case.get("many"):  # prompts spread over the ranks, each graph on one rank
            model = AutoModelForCausalLM.from_pretrained(folder / "model",
                                                         dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(folder / "model")
            attribute_many(model, tokenizer, load_transcoder(str(folder / "transcoder")),
                           case["many"], case["out"])
            continue
        if case.get("lorsa_encode"):
            _lorsa_encode(ranks, folder)
            continue
        if case.get("slow_rows"):
            _slow(case["slow_rows"])
        model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder / "model")
        shard = {"shard": (ranks.rank, ranks.world)} if case["split"] == "features" else {}
        source = case.get("transcoder_by_rank", {}).get(str(ranks.rank),
                                                        str(folder / "transcoder"))
        transcoder = load_transcoder(source, **shard)
        lorsa = load_lorsa(folder / "lorsa", **shard) if case.get("lorsa") else None
        print(f"rank {ranks.rank}: pid {os.getpid()}", flush=True)
        if case.get("hang_rank") == ranks.rank:  # a rank that hangs: the others time out
            time.sleep(3600)
        graph = attribute(model, tokenizer, transcoder, case["prompt"],
                          max_feature_nodes=case.get("budget"), batch_size=case.get("batch"),
                          checkpoint=case.get("checkpoint"), attention=lorsa)
        if ranks.first:
            name = f"graph_{case['split']}_w{ranks.world}"
            graph.save(folder / f"{name}.safetensors")
            (folder / f"{name}.json").write_text(json.dumps(graph.metadata["distributed"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
