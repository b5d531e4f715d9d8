"""Issue 54 item 2: circuit-tracer 0.5.0 beside ours on the same GPU, the same weights and the
same transcoder files, for prompts of 64, 512 and 2,048 tokens.

The world (``--work``, built once by ``--build`` in a process of its own): a random-init model
of Llama-3.2-1B's shape (``synthetic_clt.SHAPES``, float32, saved with ``save_pretrained``
beside the peer suite's BPE tokenizer, whose BOS id is not 0: what circuit-tracer's nnsight
backend loads by path), a synthetic CLT (mntss layout, ``--clt-features`` per layer) and a
per-layer JumpReLU transcoder set (circuit-tracer's ``transcoder_set`` layout,
``--plt-features`` per layer), both read from hook_resid_mid and written with the test suite's
own writers (``tests/clt_fixtures.py``, ``tests/transcoder_fixtures.py``), which our
``load_transcoder`` and circuit-tracer's loaders both read. Thresholds are set per layer so that
about ``--per-position`` features (summed over layers) fire per position of the longest prompt;
the shorter prompts are its prefixes (the same activations, so ~64/2,048 as many features).
Each prompt is one-token words of the tokenizer: exactly its length with BOS.

Then one process per (length, library) under ``--limit`` seconds (an OOM or a timeout loses
that cell only; each process appends its results as it goes): the model loaded, and per
transcoder: loaded, a graph with the library's defaults (ours: its memory-derived batch;
circuit-tracer: ``batch_size=512``), then one per ``--batches`` entry; seconds of the
``attribute`` call (synchronised), load seconds, and peak GPU memory (peak statistics reset
before each graph). Both build the same graph: circuit-tracer's salient logits (10 up to
p = 0.95), every active feature explored (``max_feature_nodes=None``, its default), ours with its
conventions (``target="demeaned_vocab"``, ``bos_errors="drop"``, as tests_peer). The first
graph each side builds (the defaults', unless they failed) is saved and compared as tests_peer
does: the same input ids, active features (layer, position, id) in order, activations, logit
tokens and probabilities, and every edge of every feature and logit row within
``EDGE_TOLERANCE`` of the row's largest ``|edge|``.

circuit-tracer runs on its nnsight backend (its wheels and their needs: gpu_prepare.sh; the
TransformerLens backend needs datasets, multiprocess, dill and more on the machine, not carried).

    python benchmarks/gpu_peer.py --device cuda --json out.json        # the GPU run
    SMOKE=1 /work/ciclone/.venv-peer/bin/python benchmarks/gpu_peer.py --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks", ROOT / "tests_peer", ROOT / "tests"):
    sys.path.insert(0, str(_p))  # this checkout, synthetic_clt, the peer's helpers, fixtures
SMOKE = os.environ.get("SMOKE") == "1"
LIBRARIES = ("ours", "circuit-tracer")
TRANSCODERS = ("clt", "plt")
#: An edge may differ by this much of its row's largest |edge| (float32 on both sides, as
#: tests_peer; different kernels and reduction orders, not a different graph).
EDGE_TOLERANCE = 1e-4
LOGITS = {"max_n_logits": 10, "desired_logit_prob": 0.95}
PEER_DEFAULT_BATCH = 512  # circuit-tracer's attribute(batch_size=512)
MB = 2**20


# ------------------------------------------------------------------------------ the world


def build(work: Path, shape: str, lengths: list[int], per_position: float, clt_features: int,
          plt_features: int, device: str) -> None:
    """The model, tokenizer, prompts and both transcoders in ``work`` (module docstring)."""
    import peer  # tests_peer: the tokenizer circuit-tracer reads (BOS not id 0)
    import transformers as tf  # seconds to import: only here
    from clt_fixtures import write_clt  # the test suite's writers (tests/)
    from synthetic_clt import SHAPES
    from transcoder_fixtures import write_circuit_tracer

    from pyvene_causaltrace.transcoders.checks import hook_states

    start = time.perf_counter()
    model_dir = work / "hf-model"  # no "llama" in the path (TransformerLens reads it)
    tokenizer = peer.make_tokenizer(peer.suite.CORPUS, model_dir)
    config, _ = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):  # a 1B model initialises in seconds on the GPU
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            **config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)).eval()
    model.save_pretrained(model_dir)
    prompts = {n: one_token_words(tokenizer, n, max(lengths)) for n in lengths}
    (work / "prompts.json").write_text(json.dumps(prompts))
    longest = prompts[max(lengths)]
    ids = tokenizer(longest, return_tensors="pt")["input_ids"].to(device)
    assert ids.shape[1] == max(lengths), (ids.shape, max(lengths))
    with torch.no_grad():
        mid = hook_states(model, ids, {"mid": "hook_resid_mid"})["mid"].float()  # [L, P, D]
    del model
    n_layers, d_model = mid.shape[0], mid.shape[2]
    count = max(1, round(per_position / n_layers * (mid.shape[1] - 1)))
    g = torch.Generator(device=device).manual_seed(1)

    def encoder(n_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_enc [L, F, D]`` and thresholds ``[L, F]``: per layer, in the widest gap between
        the ``count``-th and ``1.25 count``-th largest pre-activations (a feature at the
        threshold would fire or not on rounding alone); and in the last layer, feature ``i``
        aligned with the residual at the last position of the ``i``-th prompt (less the mean
        over positions), firing there (and wherever it exceeds its value there):
        circuit-tracer 0.5's CLT reconstruction takes its positions from the last active one,
        and a prompt whose last position has no active feature fails there."""
        w = torch.randn(n_layers, n_features, d_model, generator=g, device=device) / d_model**.5
        centred = mid[-1] - mid[-1, 1:].mean(0)
        for i, n in enumerate(lengths):
            w[-1, i] = centred[n - 1] / centred[n - 1].norm()
        z = torch.einsum("lpd,lfd->lpf", mid[:, 1:], w)  # [L, P - 1, F]
        top = z.flatten(1).topk(count + count // 4 + 2, dim=1).values  # [L, k], descending
        gaps = top[:, count - 1:-1] - top[:, count:]
        at = gaps.argmax(1, keepdim=True) + count - 1
        threshold = ((top.gather(1, at) + top.gather(1, at + 1)) / 2).expand(-1, n_features)
        threshold = threshold.contiguous()
        for i, n in enumerate(lengths):
            values = z[-1, :, i].sort(descending=True).values
            rank = int((values >= z[-1, n - 2, i]).sum())  # it fires at this many positions
            threshold[-1, i] = (values[rank - 1] + values[rank]) / 2
            print(f"the {n}-token prompt's last-position feature fires at {rank} positions")
        return w.cpu(), threshold.cpu()

    W_enc, threshold = encoder(clt_features)
    write_clt(work / "clt", {
        "W_enc": W_enc, "b_enc": torch.zeros(n_layers, clt_features), "threshold": threshold,
        "b_dec": torch.zeros(n_layers, d_model),
        "W_dec": [(torch.randn(clt_features, n_layers - layer, d_model, generator=g,
                               device=device) * 0.02).cpu() for layer in range(n_layers)]},
        model_name="random-init")
    W_enc, threshold = encoder(plt_features)
    layers = [{"W_enc": W_enc[layer], "b_enc": torch.zeros(plt_features),
               "threshold": threshold[layer], "b_dec": torch.zeros(d_model),
               "W_dec": (torch.randn(plt_features, d_model, generator=g, device=device)
                         * 0.05).cpu()} for layer in range(n_layers)]
    files = [str(work / "plt" / f"layer_{layer}.safetensors") for layer in range(n_layers)]
    write_circuit_tracer(work / "plt", {"layers": layers, "activation": "jumprelu", "k": None},
                         files=files, model_name="random-init")
    size = sum(f.stat().st_size for f in work.rglob("*") if f.is_file())
    print(f"built {shape} + CLT {n_layers} x {clt_features} + PLT {n_layers} x {plt_features} "
          f"({size / MB:,.0f} MB) in {time.perf_counter() - start:.1f} s; "
          f"~{count} features per layer fire over the {max(lengths)}-token prompt", flush=True)


def one_token_words(tokenizer, n_tokens: int, longest: int) -> str:
    """A text of ``n_tokens`` tokens with BOS, a prefix of the ``longest``'s: seeded random
    words that are one token each (the byte-level pre-tokenizer splits at spaces, so their
    concatenation is too)."""
    vocab = tokenizer.get_vocab()
    words = sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha()
                   and len(tokenizer(" " + w[1:], add_special_tokens=False)["input_ids"]) == 1)
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(len(words), (longest - 1,), generator=g).tolist()[:n_tokens - 1]
    text = "".join(" " + words[i] for i in picks)
    assert len(tokenizer(text)["input_ids"]) == n_tokens
    return text


# ------------------------------------------------------------------------ one library's cell


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_mb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / MB if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_cell(work: Path, library: str, length: int, batches: list[int], device: str,
             report: Path) -> None:
    """Every graph of one (library, length): lines appended to ``report`` as they finish."""
    prompt = json.loads((work / "prompts.json").read_text())[str(length)]

    def note(line: dict) -> None:
        line = {"library": library, "length": length, **line}
        print(json.dumps(line), flush=True)
        with open(report, "a") as out:
            out.write(json.dumps(line) + "\n")

    if library == "ours":  # imports outside the timings
        import pyvene_causaltrace.attribution  # noqa: F401
        import pyvene_causaltrace.transcoders  # noqa: F401
    else:
        import circuit_tracer.attribution.attribute  # noqa: F401
        import circuit_tracer.replacement_model.replacement_model_nnsight  # noqa: F401
    start = time.perf_counter()
    loaded = _load_ours(work, device) if library == "ours" else None
    model_s = time.perf_counter() - start
    transcoder = None
    for kind in TRANSCODERS:
        reset_peak(device)
        start = time.perf_counter()
        try:
            if library == "ours":
                from pyvene_causaltrace.transcoders import load_transcoder  # imported above

                transcoder = load_transcoder(_transcoder_path(work, kind), device=device)
                runner = _ours_runner(*loaded, transcoder, prompt)
            else:
                runner = _peer_runner(work, kind, device, prompt)
        except Exception as error:  # noqa: BLE001 (recorded: an OOM here is a result)
            note({"transcoder": kind, "error": _short(error)})
            continue
        load_s = time.perf_counter() - start
        default = None if library == "ours" else PEER_DEFAULT_BATCH
        for batch in [None, *(b for b in batches if b != default)]:
            reset_peak(device)
            line = {"transcoder": kind, "batch": "default" if batch is None else batch,
                    "model_load_s": round(model_s, 2), "setup_s": round(load_s, 2)}
            try:
                synchronize(device)
                start = time.perf_counter()
                graph, used = runner(batch)
                synchronize(device)
                line.update(seconds=round(time.perf_counter() - start, 3), batch_used=used,
                            peak_mb=peak_mb(device), **_sizes(graph, library))
                saved = work / f"{library}-{length}-{kind}.pt"
                if not saved.exists():  # the first graph built (any batch: the same graph)
                    torch.save(_dense(graph, library), saved)
            except Exception as error:  # noqa: BLE001 (circuit-tracer OOM at 2,048: a result)
                line.update(error=_short(error), peak_mb=peak_mb(device))
            graph = None
            note(line)
        runner = transcoder = None  # freed before the next transcoder loads


def _short(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _transcoder_path(work: Path, kind: str) -> Path:
    return work / "clt" if kind == "clt" else work / "plt" / "config.yaml"


def _load_ours(work: Path, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds: only here

    model = AutoModelForCausalLM.from_pretrained(work / "hf-model", dtype=torch.float32)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(work / "hf-model")


def _ours_runner(model, tokenizer, transcoder, prompt):
    from pyvene_causaltrace.attribution import attribute  # after the model

    def run(batch):
        graph = attribute(model, tokenizer, transcoder, prompt, target="demeaned_vocab",
                          bos_errors="drop", batch_size=batch, **LOGITS)
        return graph, graph.metadata.get("batch_size")
    return run


def _peer_runner(work: Path, kind: str, device: str, prompt: str):
    """circuit-tracer's nnsight replacement model (its setup: the transcoder and the model)
    everything loaded on ``device``; returns ``run(batch)``."""
    import circuit_tracer
    import yaml  # the peer's loaders below: its venv only
    from circuit_tracer import ReplacementModel
    from peer import SCAN

    dev = torch.device(device)
    path = _transcoder_path(work, kind)
    if kind == "clt":
        from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

        meta = yaml.safe_load((path / "config.yaml").read_text())
        transcoders = load_clt(str(path), feature_input_hook=meta["feature_input_hook"],
                               feature_output_hook=meta["feature_output_hook"], scan=SCAN,
                               device=dev, dtype=torch.float32, lazy_decoder=False)
    else:
        from circuit_tracer.utils.hf_utils import load_transcoders

        config = {**yaml.safe_load(path.read_text()), "scan": SCAN}
        transcoders = load_transcoders(config, device=dev, dtype=torch.float32,
                                       lazy_encoder=False, lazy_decoder=False)
    model = ReplacementModel.from_pretrained_and_transcoders(
        str(work / "hf-model"), transcoders, backend="nnsight", device=dev, dtype=torch.float32)

    def run(batch):
        size = PEER_DEFAULT_BATCH if batch is None else batch
        return circuit_tracer.attribute(prompt, model, batch_size=size, **LOGITS), size
    return run


def _sizes(graph, library: str) -> dict:
    if library == "ours":
        return {"features": graph.n_features, "logits": graph.n_logits}
    return {"features": len(graph.selected_features), "logits": len(graph.logit_targets)}


def _dense(graph, library: str) -> dict:
    """What the comparison reads: ids, features, activations, logits, and the feature and logit
    rows ``[F + K, n_nodes - K]`` in node order (features, errors, tokens; logits last)."""
    if library != "ours":
        features = graph.active_features[graph.selected_features].long().cpu()
        k = len(graph.logit_targets)
        adjacency = graph.adjacency_matrix
        n = adjacency.shape[0]
        rows = torch.cat([adjacency[:len(features), :n - k], adjacency[n - k:, :n - k]]).cpu()
        return {"input_ids": [int(i) for i in graph.input_tokens], "features": features,
                "activations": graph.activation_values[graph.selected_features].float().cpu(),
                "logit_tokens": [int(t.vocab_idx) for t in graph.logit_targets],
                "logit_probs": graph.logit_probabilities.float().cpu(), "rows": rows.float()}
    n, k, f = graph.layout.n_nodes, graph.n_logits, graph.n_features
    store = graph.rows
    assert store.n_columns == n - k, (store.n_columns, n, k)
    rows = torch.zeros(f + k, n - k)
    nodes = store.nodes.long()
    where = torch.where(nodes < f, nodes, nodes - (n - k) + f)
    rows[where] = store.dense(torch.arange(store.n_rows)).float().cpu()
    return {"input_ids": list(graph.input_ids),
            "features": torch.stack([graph.feature_layer, graph.feature_position,
                                     graph.feature_id], 1).long().cpu(),
            "activations": graph.activation.float().cpu(),
            "logit_tokens": [int(t["token"]) for t in graph.targets],
            "logit_probs": torch.tensor([float(t["prob"]) for t in graph.targets]),
            "rows": rows}


def compare(a: dict, b: dict) -> dict:
    """tests_peer's checks, as numbers: ``equal`` when all hold."""
    out = {"same_ids": a["input_ids"] == b["input_ids"],
           "same_features": torch.equal(a["features"], b["features"]),
           "same_logits": a["logit_tokens"] == b["logit_tokens"]}
    if out["same_features"]:
        scale = b["activations"].abs().max().clamp(min=1e-30)
        out["activation_diff"] = float((a["activations"] - b["activations"]).abs().max() / scale)
    if out["same_logits"]:
        out["prob_diff"] = float((a["logit_probs"] - b["logit_probs"]).abs().max())
    if out["same_features"] and out["same_logits"] and a["rows"].shape == b["rows"].shape:
        x, y = a["rows"].double(), b["rows"].double()
        scale = torch.maximum(x.abs().amax(1), y.abs().amax(1))
        has = scale > 0
        diff = torch.zeros(len(x), dtype=torch.float64)
        diff[has] = (x - y).abs().amax(1)[has] / scale[has]
        out["edge_diff"] = float(diff.max())
    out["equal"] = bool(out["same_ids"] and out.get("edge_diff", 1.0) <= EDGE_TOLERANCE
                        and out.get("activation_diff", 1.0) <= 1e-4
                        and out.get("prob_diff", 1.0) <= 1e-5)
    return out


# ----------------------------------------------------------------------------- the driver


def _child(args, *extra: str, limit: float) -> tuple[int, float]:
    """This file in a fresh process under ``limit`` seconds: (exit code, seconds)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--work", str(args.work),
               "--device", args.device, *extra]
    start = time.perf_counter()
    try:
        code = subprocess.run(command, cwd=ROOT, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        code = 124
    return code, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="tiny" if SMOKE else "llama1b",
                        help="synthetic_clt.SHAPES: llama1b (Llama-3.2-1B) or tiny")
    parser.add_argument("--lengths", default="16,32" if SMOKE else "64,512,2048")
    parser.add_argument("--batches", default="32" if SMOKE else "64,128",
                        help="batch sizes tried beside each library's default")
    parser.add_argument("--per-position", type=float, default=2.0 if SMOKE else 0.25,
                        help="features firing per position, summed over layers")
    parser.add_argument("--clt-features", type=int, default=256 if SMOKE else 2048)
    parser.add_argument("--plt-features", type=int, default=512 if SMOKE else 8192)
    parser.add_argument("--limits", default="150,150" if SMOKE else "25,30,45",
                        help="seconds per (length, library) process, one per length")
    parser.add_argument("--build-limit", type=float, default=120 if SMOKE else 45)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cell", nargs=2, metavar=("LIBRARY", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("PVCT_TORCH_THREADS", "1")))
    if args.build:
        build(args.work, args.shape, lengths, args.per_position, args.clt_features,
              args.plt_features, args.device)
        return
    if args.cell:
        run_cell(args.work, args.cell[0], int(args.cell[1]), batches, args.device,
                 args.work / "report.jsonl")
        return
    temporary = None
    if args.work is None:
        temporary = tempfile.TemporaryDirectory()
        args.work = Path(temporary.name)
    common = ["--lengths", args.lengths, "--batches", args.batches]
    code, seconds = _child(args, "--build", "--shape", args.shape, "--per-position",
                           str(args.per_position), "--clt-features", str(args.clt_features),
                           "--plt-features", str(args.plt_features), *common,
                           limit=args.build_limit)
    cells = [{"step": "build", "exit": code, "wall_s": round(seconds, 1)}]
    if code == 0:
        limits = [float(x) for x in args.limits.split(",")]
        for length, limit in zip(lengths, limits, strict=True):
            for library in LIBRARIES:
                code, seconds = _child(args, "--cell", library, str(length), *common,
                                       limit=limit)
                cells.append({"step": f"{library} {length}", "exit": code,
                              "wall_s": round(seconds, 1)})
    report = args.work / "report.jsonl"
    runs = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    comparisons = []
    for length in lengths:
        for kind in TRANSCODERS:
            files = [args.work / f"{lib}-{length}-{kind}.pt" for lib in LIBRARIES]
            if all(f.exists() for f in files):
                ours, theirs = (torch.load(f) for f in files)
                comparisons.append({"length": length, "transcoder": kind,
                                    **compare(ours, theirs)})
    table(runs, comparisons)
    result = {"device": args.device, "gpu": torch.cuda.get_device_name() if
              args.device.startswith("cuda") else None, "shape": args.shape,
              "per_position": args.per_position, "clt_features": args.clt_features,
              "plt_features": args.plt_features, "edge_tolerance": EDGE_TOLERANCE,
              "processes": cells, "runs": runs, "comparisons": comparisons}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def table(runs: list[dict], comparisons: list[dict]) -> None:
    print(f"{'len':>5} {'tc':>4} {'library':>14} {'batch':>8} {'feat':>6} {'s/graph':>8} "
          f"{'peak MB':>8} {'setup s':>7}")
    for r in runs:
        peak = "-" if r.get("peak_mb") is None else f"{r['peak_mb']:,.0f}"
        seconds = r.get("error", "")[:40] if "error" in r else f"{r['seconds']:.2f}"
        batch = f"{r['batch']}" if r["batch"] != "default" else \
            f"def {r['batch_used']}" if "batch_used" in r else "default"
        print(f"{r['length']:>5} {r['transcoder']:>4} {r['library']:>14} "
              f"{batch:>8} {r.get('features', '-'):>6} "
              f"{seconds:>8} {peak:>8} {r.get('setup_s', '-'):>7}")
    for c in comparisons:
        print(f"compare {c['length']:>5} {c['transcoder']}: equal={c['equal']} "
              f"features={c['same_features']} logits={c['same_logits']} "
              f"edge_diff={c.get('edge_diff', float('nan')):.2e} "
              f"activation_diff={c.get('activation_diff', float('nan')):.2e}")


if __name__ == "__main__":
    main()
