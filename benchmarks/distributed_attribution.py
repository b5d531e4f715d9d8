"""Attribution across ranks on this machine (issue 41): rows per second and memory per rank for
1, 2 and 3 ranks, the transcoder sharded by feature (``features``) or whole on every rank with
the rows split (``rows``).

SmolLM2-135M-Instruct (the bundled model) with a synthetic mntss JumpReLU CLT of about 1.2 GB
(float32, 30 layers x 1,120 features, d_model 576: 1,120 x 576 x (30 + 465) x 4 B), thresholds
calibrated so that about ``--per-position`` features fire per position and layer, written to
``--dir`` one layer at a time. Each configuration is a fresh launch (``torchrun --standalone``,
or one plain process for 1 rank) of this file's ``--worker`` mode, which builds the graph of
the Eiffel prompt with ``--rows`` feature rows (``max_feature_nodes``) and reports per rank:
rows per second of the rows phase (``metadata["seconds"]["rows"]``), the transcoder's
resident bytes (``Transcoder.resident_bytes()``: decoders resident with ``--resident``,
memory-mapped otherwise) and the peak resident set (``ru_maxrss``).

    python benchmarks/distributed_attribution.py --json benchmarks/results/distributed.json
    python benchmarks/distributed_attribution.py --resident --worlds 1 2 --modes features

Two cores here: expect no speedup from more ranks, only the memory split. ``--model random:<shape>``
(a random-init Llama of ``synthetic_clt.py``'s shape; GPU machines lack SmolLM2) and each rank
on ``cuda:LOCAL_RANK`` when there are GPUs: ``benchmarks/gpu_check.sh distributed``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package first
sys.path.insert(1, str(ROOT / "benchmarks"))  # synthetic_clt
N_FEATURES = 1120
PROMPT, ANSWER = "The Eiffel Tower is in the city of", " Paris"
MB = 2**20
#: Ranks against one process: activations and edges within this much of the largest (the
#: rows' reductions run in another order; tests/test_distributed.py holds 1e-6 on the CPU).
TOLERANCE = 1e-5


def load(name: str, device: str = "cpu"):
    """``(model, tokenizer)``: the bundled SmolLM2 (``smollm2-135m``) or ``random:<shape>``, a
    random-init Llama of ``benchmarks/synthetic_clt.py``'s shape (seed 0: the same weights on
    every rank) with a BPE tokenizer trained on known_1000 (the GPU machine has no SmolLM2)."""
    if not name.startswith("random:"):
        from pyvene_causaltrace.models import load_model

        model, tokenizer = load_model(name)
        return model.to(device), tokenizer
    import transformers as tf
    from synthetic_clt import SHAPES, known_facts_tokenizer

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1B model in seconds on a GPU
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPES[name.removeprefix("random:")][0]))
    return model.eval(), known_facts_tokenizer()


def write_clt(path: Path, per_position: float, name: str = "smollm2-135m",
              n_features: int = N_FEATURES) -> int:
    """The synthetic CLT for the model (module docstring); returns its bytes on disk."""
    import yaml  # only the writer needs it
    from safetensors.torch import save_file  # likewise

    from pyvene_causaltrace.transcoders.checks import hook_states

    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # the weights the ranks hold
    model, tokenizer = load(name, device)
    n_layers, d_model = model.config.num_hidden_layers, model.config.hidden_size
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        mid = hook_states(model, ids, {"mid": "hook_resid_mid"})["mid"].cpu()  # [L, P, D]
    del model
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    count = max(1, int(round(per_position * (mid.shape[1] - 1))))
    for layer in range(n_layers):
        W_enc = torch.randn(n_features, d_model, generator=g) / d_model**0.5
        z = (mid[layer, 1:].float() @ W_enc.T).flatten()
        threshold = z.topk(count + 1).values[-1].expand(n_features).clone()
        save_file({f"W_enc_{layer}": W_enc, f"b_enc_{layer}": torch.zeros(n_features),
                   f"b_dec_{layer}": torch.zeros(d_model), f"threshold_{layer}": threshold},
                  str(path / f"W_enc_{layer}.safetensors"))
        dec = torch.randn(n_features, n_layers - layer, d_model, generator=g) * 0.02
        save_file({f"W_dec_{layer}": dec}, str(path / f"W_dec_{layer}.safetensors"))
        del dec
    (path / "config.yaml").write_text(yaml.safe_dump({
        "model_name": name,
        "model_kind": "cross_layer_transcoder", "feature_input_hook": "hook_resid_mid",
        "feature_output_hook": "hook_mlp_out"}))
    return sum(file.stat().st_size for file in path.iterdir())


def worker(args) -> None:
    """One rank: build the graph, append this rank's line to ``args.report``."""
    from pyvene_causaltrace import distributed
    from pyvene_causaltrace.attribution import attribute
    from pyvene_causaltrace.transcoders import load_transcoder

    torch.set_num_threads(1)
    gpus = torch.cuda.device_count()
    # NCCL: one rank per GPU; more ranks than GPUs share them over gloo (CUDA tensors staged
    # through the CPU by the collectives, distributed._wire)
    backend = args.backend or ("nccl" if gpus and int(os.environ.get("WORLD_SIZE", "1")) <= gpus
                               else "gloo")
    ranks = distributed.init(backend=backend)
    rank, world = (0, 1) if ranks is None else (ranks.rank, ranks.world)
    shard = {"shard": (rank, world)} if ranks is not None and args.mode == "features" else {}
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % gpus}" if gpus else "cpu"
    model, tokenizer = load(args.model, device)
    start = time.perf_counter()
    clt = load_transcoder(args.dir, lazy_decoder=not args.resident, device=device, **shard)
    load_s = time.perf_counter() - start
    answer = {"answer": ANSWER} if args.model == "smollm2-135m" else {"max_n_logits": 1}
    graph = attribute(model, tokenizer, clt, PROMPT, max_feature_nodes=args.rows, **answer)
    seconds = graph.metadata["seconds"]
    rows = graph.metadata["rows_computed"] - graph.n_logits
    line = {"world": world, "mode": args.mode if ranks is not None else "one process",
            "rank": rank, "rows": rows, "active": graph.n_features,
            "rows_s": seconds["rows"], "rows_per_s": rows / seconds["rows"],
            "forward_s": seconds["forward"], "total_s": seconds["total"], "load_s": load_s,
            "transcoder_mb": clt.resident_bytes() / MB,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "batch": graph.metadata["batch_size"], "device": device,
            "backend": backend if ranks is not None else None}
    with open(args.report, "a") as out:
        out.write(json.dumps(line) + "\n")
    if rank == 0:  # the graph, for the equality with one process (compare())
        nodes = graph.rows.nodes.sort().values
        torch.save({"features": torch.stack([graph.feature_layer, graph.feature_position,
                                             graph.feature_id], 1).cpu(),
                    "activation": graph.activation.cpu(), "nodes": nodes.cpu(),
                    "rows": graph.rows.dense(graph.rows.row_of_node(graph.layout.n_nodes)[nodes])
                    .cpu()}, Path(args.report).parent / f"graph-{world}-{line['mode']}.pt")
    if ranks is not None:
        distributed.finish()


def compare(one: dict, many: dict) -> dict:
    """A graph of several ranks against one process's: the same active features and computed
    rows, activations and every edge within ``TOLERANCE`` of the largest (its row's)."""
    same = torch.equal(one["features"], many["features"]) and torch.equal(one["nodes"],
                                                                            many["nodes"])
    if not same:
        return {"same_nodes": False, "equal": False}
    moved = float((one["activation"] - many["activation"]).abs().max()
                  / one["activation"].abs().max().clamp(min=1e-30))
    scale = one["rows"].abs().amax(1, keepdim=True).clamp(min=1e-30)
    edges = float(((one["rows"] - many["rows"]).abs() / scale).max())
    return {"same_nodes": True, "activation_diff": moved, "edge_diff": edges,
            "equal": moved <= TOLERANCE and edges <= TOLERANCE}


def launch(args, world: int, mode: str, report: Path) -> float:
    """One configuration in fresh processes; returns its wall seconds."""
    own = [str(Path(__file__).resolve()), "--worker", "--dir", str(args.dir), "--mode", mode,
           "--rows", str(args.rows), "--report", str(report), "--model", args.model] \
        + (["--resident"] if args.resident else []) \
        + (["--backend", args.backend] if args.backend else [])
    command = [sys.executable, *own] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={world}", *own]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT),
                                                       str(ROOT / "benchmarks")]))}
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="features", help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help="where the CLT is (written if "
                                                               "absent; default: a temp dir)")
    parser.add_argument("--rows", type=int, default=300, help="feature rows per graph")
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m (bundled) or random:<shape> (synthetic_clt.py: "
                             "llama1b, tiny)")
    parser.add_argument("--features", type=int, default=N_FEATURES,
                        help=f"features per layer of the synthetic CLT (default {N_FEATURES})")
    parser.add_argument("--per-position", type=float, default=8.0)
    parser.add_argument("--resident", action="store_true",
                        help="decoders resident (default: memory-mapped, as loaded by default)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", default=["features", "rows"])
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: NCCL with a "
                        "GPU per rank, else gloo, CUDA tensors too)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    temporary = None
    if args.dir is None:
        temporary = tempfile.TemporaryDirectory()
        args.dir = Path(temporary.name) / "clt"
    if not (args.dir / "config.yaml").exists():
        size = write_clt(args.dir, args.per_position, args.model, args.features)
        print(f"wrote {size / MB:,.0f} MB to {args.dir}")
    report = Path(tempfile.mkdtemp()) / "report.jsonl"
    walls = []
    for world in args.worlds:
        for mode in (["one process"] if world == 1 else args.modes):
            wall = launch(args, world, "features" if world == 1 else mode, report)
            walls.append({"world": world, "mode": mode, "wall_s": wall})
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    print(f"{'world':>5} {'mode':>11} {'rank':>4} {'rows':>5} {'rows/s':>7} {'forward s':>9} "
          f"{'transcoder MB':>13} {'peak RSS MB':>11}")
    for line in sorted(lines, key=lambda x: (x["world"], x["mode"], x["rank"])):
        print(f"{line['world']:>5} {line['mode']:>11} {line['rank']:>4} {line['rows']:>5} "
              f"{line['rows_per_s']:>7.1f} {line['forward_s']:>9.1f} "
              f"{line['transcoder_mb']:>13.1f} {line['peak_rss_mb']:>11.0f}")
    checks = []
    if (report.parent / "graph-1-one process.pt").exists():
        one = torch.load(report.parent / "graph-1-one process.pt")
        for wall in walls:
            if wall["world"] > 1:
                many = torch.load(report.parent / f"graph-{wall['world']}-{wall['mode']}.pt")
                checks.append({"world": wall["world"], "mode": wall["mode"],
                               **compare(one, many)})
                print(f"{wall['world']} ranks, {wall['mode']}: equal to one process "
                      f"{checks[-1]['equal']} ({checks[-1]})")
    if args.json:
        args.json.write_text(json.dumps({"resident": args.resident, "rows": args.rows,
                                         "ranks": lines, "launches": walls,
                                         "equal_to_one_process": checks}, indent=1))
    if not all(c["equal"] for c in checks):
        sys.exit("a graph of several ranks differs from one process's")


if __name__ == "__main__":
    main()
