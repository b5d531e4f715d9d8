"""The argument parser: every command and flag. Imports nothing heavy, so ``--help`` is fast."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..arguments import (
    Fraction,
    MemoryMB,
    NonNegativeInt,
    Port,
    PositiveFloat,
    PositiveInt,
    Probability,
    Seed,
    Text,
    flag,
)
from ..defaults import (
    BOS,
    CROSS_CHECK_FEATURES,
    CROSS_CHECK_MODES,
    CROSS_CHECK_WINDOW,
    DATASET_KINDS,
    DATASET_SEEDS,
    DEVICE,
    EDGE_THRESHOLD,
    FAITH_ABLATION,
    FAITH_BATCH,
    FAITH_BUDGETS,
    FAITH_DRAWS,
    FAITH_ERRORS,
    FAITH_LEVEL,
    FAITH_METRIC,
    FAITH_RANK_BY,
    FAITH_SEED,
    FAITH_SIZES,
    GRAPH_BOS_ERRORS,
    GRAPH_DESIRED_LOGIT_PROB,
    GRAPH_K,
    GRAPH_MAX_N_LOGITS,
    GRAPH_MEMORY_MB,
    GRAPH_TARGET,
    KNOWN,
    MAX_LINKS,
    N_BOOT,
    NODE_THRESHOLD,
    NOISE_SCALE,
    SIGMA,
    STEER_MAX_NEW_TOKENS,
    STEER_TOP_K,
    TRACE_FAITH,
    TRACE_MEMORY_MB,
    TRACE_SEEDS,
    WINDOW,
)
from .common import DEVICE_CHOICES, EIFFEL, Device, trace_faithfulness_flags
from .lorsa_parser import add_fit_lorsa, lorsa_attribute_flags

# Every typed flag reads through the package's argument rules (arguments.flag): argparse then
# names the flag in its one error: line, and a flag cannot take a value the API refuses.
POSITIVE_INT, NON_NEGATIVE_INT, SEED = flag(PositiveInt), flag(NonNegativeInt), flag(Seed)
PORT = flag(Port)
POSITIVE_FLOAT, FRACTION, MEMORY_MB = flag(PositiveFloat), flag(Fraction), flag(MemoryMB)
PROBABILITY = flag(Probability)
TEXT = flag(Text)

_TRANSCODER_HELP = ("transcoder: an mntss CLT directory, a circuit-tracer config.yaml, a "
                    "GemmaScope / sae-lens / sparsify directory, or a hub id")
_BOS_HELP = ("how position 0 is treated: auto - as BOS (not spliced, no features, not "
             "scored) only when the tokenizer prepends one (SmolLM2's adds none); always - as "
             "BOS whatever the tokenizer does (circuit-tracer's convention); never - like any "
             f"token (default {BOS})")
_FORMAT_HELP = ("the transcoder's layout: mntss, circuit_tracer, gemmascope, gemmascope2, "
                "bytedance, sae_lens, sparsify or llamascopium (default: detected)")
_BOS_MODES = ("auto", "always", "never")  # prompts.BOS_MODES, which imports torch
# the help of a flag several commands share, written once
_MODEL_HELP = "default: smollm2-135m (bundled)"
_PROGRESS_HELP = "no progress bar (tqdm, on stderr)"
_SIGMA_HELP = f"rome | embedding_matrix | a number (default {SIGMA})"
_BUDGET_HELP = f"memory budget for one batch of rows (default {TRACE_MEMORY_MB:g})"
_BOOT_HELP = f"bootstrap resamples (default {N_BOOT})"
_DEVICE_HELP = (f"where the model and the transcoder load and run: {DEVICE_CHOICES} (auto: "
                f"CUDA when available, else the CPU); a device this machine lacks is refused "
                f"before anything loads (default {DEVICE})")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals read as the package's: one line ``error: attribute:
    argument --flag: ...`` naming the flag, and exit 2 (``--help`` shows the usage)."""

    def error(self, message: str):
        command = self.prog.removeprefix("pyvene-causaltrace").strip()
        self.exit(2, f"error: {command + ': ' if command else ''}{message} (see --help)\n")


def _device(parser: argparse.ArgumentParser, help: str = _DEVICE_HELP) -> None:
    """``--device``, for every command that loads a model or a transcoder."""
    parser.add_argument("--device", type=flag(Device), default=DEVICE, help=help)


def _faithfulness_flags(parser: argparse.ArgumentParser, prompts: bool = True) -> None:
    """The flags of a faithfulness curve (``evaluate``, ``attribute --faithfulness``; without
    the prompts', ``dataset --faithfulness``, which takes them from the facts)."""
    if prompts:
        parser.add_argument("--counterfactual", type=TEXT, default=None,
                            help="a prompt of the graph's prompt's length in tokens: the "
                                 "features outside the circuit take their values on it (MIB's "
                                 "patching)")
        parser.add_argument("--reference", type=Path, default=None,
                            help="with --ablation mean: a text file, one prompt per line")
        parser.add_argument("--foil", type=TEXT, default=None,
                            help="the logit difference's other token (default: the model's "
                                 "top token on --counterfactual)")
    parser.add_argument("--sizes", default=",".join(f"{s:g}" for s in FAITH_SIZES),
                        help="circuit sizes, percent of the ranked nodes or edges, each in "
                             "(0, 100] (default MIB's: %(default)s)")
    parser.add_argument("--level", default=FAITH_LEVEL, choices=("nodes", "edges"),
                        help=f"rank feature nodes or edges (default {FAITH_LEVEL})")
    parser.add_argument("--rank-by", default=FAITH_RANK_BY, choices=("influence", "direct"),
                        help=f"the graph's ranking (default {FAITH_RANK_BY})")
    parser.add_argument("--ablation", default=FAITH_ABLATION,
                        choices=("counterfactual", "mean", "zero"),
                        help=f"what features outside the circuit are set to (default "
                             f"{FAITH_ABLATION})")
    parser.add_argument("--errors", default=FAITH_ERRORS, choices=("held", "ablated"),
                        help=f"error nodes: the clean run's, or ablated like the features "
                             f"(default {FAITH_ERRORS})")
    parser.add_argument("--metric", default=FAITH_METRIC, choices=("logit_diff", "prob", "kl"),
                        help=f"default {FAITH_METRIC}")
    parser.add_argument("--draws", type=POSITIVE_INT, default=FAITH_DRAWS,
                        help=f"random rankings, the floor (default {FAITH_DRAWS})")
    parser.add_argument("--seed", type=SEED, default=FAITH_SEED,
                        help=f"the random rankings' seed (default {FAITH_SEED})")
    parser.add_argument("--circuits-per-forward", type=POSITIVE_INT, default=FAITH_BATCH,
                        help=f"circuits run in one batched forward (default {FAITH_BATCH})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pyvene-causaltrace",
        description="Causal tracing and CLT attribution graphs, as pyvene interventions.")
    commands = parser.add_subparsers(dest="command", required=True)
    # every command that reads specs or lists the types: import the user's plugin modules first
    plugins = argparse.ArgumentParser(add_help=False)
    plugins.add_argument("--plugins", default=None, metavar="MODULE[,MODULE]",
                         help="import these modules first: they register their intervention "
                              "types (also $PVCT_PLUGINS, same format; entry points in the "
                              "group 'pyvene_causaltrace.interventions' load by themselves)")

    trace = commands.add_parser(
        "trace", parents=[plugins],
        help="causal trace: noise the subject, restore every (layer, position) cell")
    trace.add_argument("--spec", type=Path, default=None,
                       help="a trace spec (intervention_specs/trace_*.json); with it only "
                            "--model/--device/--out/--budget-mb/--controls/--no-progress apply "
                            "(the others are refused)")
    trace.add_argument("--model", default=None, help=_MODEL_HELP)
    _device(trace)
    trace.add_argument("--prompt", type=TEXT, default=EIFFEL["prompt"])
    trace.add_argument("--subject", type=TEXT, default=EIFFEL["subject"])
    trace.add_argument("--answer", type=TEXT, default=None,
                       help="target string (its first token); default ' Paris' for the default "
                            "prompt, else the clean argmax")
    trace.add_argument("--kind", default="residual",
                       help="residual|mlp|attn|severed-mlp|severed-attn, or several, "
                            "comma-separated (they share the clean and corrupted runs)")
    trace.add_argument("--seeds", type=POSITIVE_INT, default=TRACE_SEEDS,
                       help=f"noise seeds 0..N-1 (default {TRACE_SEEDS})")
    trace.add_argument("--scale", default=str(NOISE_SCALE),
                       help=f"noise in units of sigma (default {NOISE_SCALE:g}, ROME's), or "
                            "'auto' (sweep 1-10 sigma, take the smallest whose worst seed "
                            "leaves P(answer) below 5%% of clean)")
    trace.add_argument("--sigma", default=SIGMA, help=_SIGMA_HELP)
    trace.add_argument("--window", type=POSITIVE_INT, default=WINDOW,
                       help=f"layers per window of mlp and attn (default {WINDOW}, ROME's)")
    trace.add_argument("--budget-mb", type=MEMORY_MB, default=TRACE_MEMORY_MB, help=_BUDGET_HELP)
    trace.add_argument("--controls", action="store_true",
                       help="also run the controls (corrupted-donor, window vs single layer)")
    trace.add_argument("--no-progress", action="store_true", help=_PROGRESS_HELP)
    trace.add_argument("--out", type=Path, default=None,
                       help="write trace_<kind>.json and trace_<kind>.png here")
    trace_faithfulness_flags(trace, TRACE_FAITH)

    run = commands.add_parser("run", parents=[plugins],
                              help="run a JSON spec and print its probabilities")
    run.add_argument("spec", type=Path)
    run.add_argument("--model", default=None, help="overrides the spec's model")
    _device(run)
    run.add_argument("--out", type=Path, default=None, help="write result.json here")

    validate = commands.add_parser(
        "validate", parents=[plugins],
        help="check JSON specs against the schema (and, with --model, against a model: layers, "
             "positions, modules, transcoder)")
    validate.add_argument("specs", type=Path, nargs="+")
    validate.add_argument("--model", default=None,
                          help="also resolve each spec on this model, without running it")
    _device(validate, "with --model: " + _DEVICE_HELP)

    check = commands.add_parser(
        "clt-check", help="pairing check and replacement-model anchor of a CLT on a model")
    check.add_argument("--model", default="smollm2-135m", help=_MODEL_HELP)
    _device(check)
    check.add_argument("--clt", required=True, help=_TRANSCODER_HELP)
    check.add_argument("--format", default=None, help=_FORMAT_HELP)
    check.add_argument("--data", type=Path, required=True,
                       help="held-out text: a .txt file (one text per line) or known_1000-style "
                            "JSON (prompt + attribute)")
    check.add_argument("--limit", type=POSITIVE_INT, default=100, help="texts to use")
    check.add_argument("--prompt", type=TEXT, default=EIFFEL["prompt"])
    check.add_argument("--answer", type=TEXT, default=None)
    check.add_argument("--out", type=Path, default=None, help="write clt_check.json here")
    check.add_argument("--bos", default=BOS, choices=_BOS_MODES, help=_BOS_HELP)

    data = commands.add_parser(
        "dataset", help="average indirect effects over a fact dataset or a task (resumable)")
    source = data.add_mutually_exclusive_group(required=True)
    source.add_argument("--data",
                        help="known_1000 (ROME's facts, fetched once into the cache), or a "
                             "known_1000.json-style JSON / JSONL file of {prompt, subject, "
                             "attribute}")
    source.add_argument("--task", help="a built-in task: agreement | retrieval | arithmetic")
    data.add_argument("--model", default=None, help=_MODEL_HELP)
    _device(data)
    data.add_argument("--limit", type=POSITIVE_INT, default=None,
                      help="facts to trace (after the screen)")
    data.add_argument("--kinds", default=",".join(DATASET_KINDS),
                      help=f"trace kinds, comma-separated (default {','.join(DATASET_KINDS)})")
    data.add_argument("--seeds", type=POSITIVE_INT, default=DATASET_SEEDS,
                      help=f"noise seeds 0..N-1 per fact (default {DATASET_SEEDS})")
    data.add_argument("--scale", type=POSITIVE_FLOAT, default=NOISE_SCALE,
                      help=f"noise in units of sigma (default {NOISE_SCALE:g})")
    data.add_argument("--sigma", default=SIGMA, help=_SIGMA_HELP)
    data.add_argument("--window", type=POSITIVE_INT, default=WINDOW,
                      help=f"layers per window of mlp and attn (default {WINDOW})")
    data.add_argument("--known", default=None, choices=("argmax", "none"),
                      help="argmax: trace only facts whose clean prediction is the target; "
                           f"none: every well-formed one (default {KNOWN}; a built-in task may "
                           "default to none)")
    data.add_argument("--budget-mb", type=MEMORY_MB, default=TRACE_MEMORY_MB, help=_BUDGET_HELP)
    data.add_argument("--boot", type=POSITIVE_INT, default=N_BOOT, help=_BOOT_HELP)
    data.add_argument("--no-progress", action="store_true", help=_PROGRESS_HELP)
    trace_faithfulness_flags(data, TRACE_FAITH, dataset=True)
    data.add_argument("--graphs", action="store_true",
                      help="also build each kept fact's attribution graph through the --clt "
                           "transcoder: graphs.jsonl, graphs.csv and a graph panel beside the "
                           "AIE in the figures")
    data.add_argument("--clt", default=None, help=_TRANSCODER_HELP + " (with --graphs)")
    data.add_argument("--format", default=None, help=_FORMAT_HELP)
    data.add_argument("--max-feature-nodes", type=POSITIVE_INT, default=None,
                      help="with --graphs: feature rows per graph, the most influential "
                           "(default: every feature whose row fits --graph-memory-mb)")
    data.add_argument("--graph-memory-mb", type=MEMORY_MB, default=None,
                      help=f"with --graphs: memory cap of one graph (default "
                           f"{GRAPH_MEMORY_MB:g})")
    data.add_argument("--bos", default=None, choices=_BOS_MODES, help="with --graphs: " + _BOS_HELP)
    data.add_argument("--save-graphs", action="store_true",
                      help="with --graphs: keep each graph as graphs/<index>.safetensors")
    _faithfulness_flags(data.add_argument_group(
        "graph faithfulness", "with --faithfulness --graphs: the graphs' curves' settings (as "
        "`evaluate`'s)"), prompts=False)
    data.add_argument("--out", type=Path, required=True,
                      help="run directory: rows stream here; rerun to resume")

    agg = commands.add_parser("aggregate", help="aggregate a dataset run directory")
    agg.add_argument("out", type=Path)
    agg.add_argument("--boot", type=POSITIVE_INT, default=N_BOOT, help=_BOOT_HELP)

    graph = commands.add_parser(
        "attribute", parents=[plugins],
        help="CLT attribution graph of the answer: edges, pruning, export, ablation")
    graph.add_argument("--spec", type=Path, default=None,
                       help="an attribution spec (intervention_specs/attribution_graph.json); "
                            "the flags given override it, but --prompt and --answer (and a "
                            "setting it holds, e.g. --node-threshold) are refused")
    graph.add_argument("--model", default=None, help=_MODEL_HELP)
    _device(graph)
    graph.add_argument("--clt", default=None, help=_TRANSCODER_HELP)
    graph.add_argument("--format", default=None, help=_FORMAT_HELP)
    graph.add_argument("--labels", type=Path, default=None,
                       help="feature labels for graph.json's clerp: CSV/TSV/JSON with columns "
                            "layer, feature, label")
    graph.add_argument("--prompt", type=TEXT, default=EIFFEL["prompt"])
    graph.add_argument("--answer", type=TEXT, default=None,
                       help="a single-token answer; default ' Paris' for the default prompt, "
                            "else the clean argmax")
    graph.add_argument("--target", default=GRAPH_TARGET,
                       choices=("demeaned", "demeaned_vocab", "difference"))
    graph.add_argument("--other", type=TEXT, default=None,
                       help="the subtracted token of --target difference")
    graph.add_argument("--k", type=POSITIVE_INT, default=GRAPH_K,
                       help=f"top-k logits the target is demeaned by (default {GRAPH_K})")
    graph.add_argument("--max-n-logits", type=POSITIVE_INT, default=None,
                       help="without --answer: a logit node for each of the most probable "
                            f"tokens, at most this many (default {GRAPH_MAX_N_LOGITS})")
    graph.add_argument("--desired-logit-prob", type=PROBABILITY, default=None,
                       help="without --answer: stop adding logit nodes once their "
                            f"probabilities reach this (default {GRAPH_DESIRED_LOGIT_PROB:g})")
    graph.add_argument("--direction", type=Path, default=None,
                       help="explain a direction instead of logits: a JSON list of d_model "
                            "numbers or a safetensors file of one 1-D tensor, projected on the "
                            "final norm's output at the last position")
    graph.add_argument("--bos-errors", default=None, choices=("keep", "drop"),
                       help="keep: the position-0 errors are nodes (rows close on nodes); "
                            "drop: constants, as circuit-tracer's graphs (only where position 0 "
                            "is BOS: with --bos always on a tokenizer that adds none) (default "
                            f"{GRAPH_BOS_ERRORS})")
    graph.add_argument("--bos", default=None, choices=_BOS_MODES, help=_BOS_HELP)
    graph.add_argument("--memory-mb", type=MEMORY_MB, default=None,
                       help="cap on the forward graph, batched gradient rows and stored rows "
                            f"(default {GRAPH_MEMORY_MB:g})")
    graph.add_argument("--max-feature-nodes", type=POSITIVE_INT, default=None,
                       help="compute rows for at most this many features, the most "
                            "influential (default: every feature whose row fits --memory-mb)")
    graph.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                       help="the replacement forward's and backward's dtype: bfloat16 on a "
                            "float32 model runs under autocast, its closures held to a bfloat16 "
                            "tolerance (docs/attribution.md, 'Precision and determinism') "
                            "(default: the model's dtype)")
    graph.add_argument("--deterministic", action="store_true",
                       help="two runs bit-identical: torch's deterministic algorithms on (on "
                            "CUDA slower; docs/attribution.md)")
    graph.add_argument("--node-threshold", type=FRACTION, default=NODE_THRESHOLD,
                       help="pruning: keep the nodes carrying this share of the cumulative "
                            f"influence (default {NODE_THRESHOLD:g})")
    graph.add_argument("--edge-threshold", type=FRACTION, default=EDGE_THRESHOLD,
                       help="pruning: then the edges carrying this share of the cumulative "
                            f"edge score (default {EDGE_THRESHOLD:g})")
    graph.add_argument("--max-links", type=POSITIVE_INT, default=MAX_LINKS,
                       help="graph.json holds at most this many links, those of largest edge "
                            f"score (default {MAX_LINKS}, ~25 MB)")
    graph.add_argument("--validate", action="store_true",
                       help="ablate the top 5/10/20 features vs 10 random draws of as many")
    graph.add_argument("--faithfulness", action="store_true",
                       help="MIB's faithfulness curve of the graph (as `evaluate`, with its "
                            "flags): faithfulness.json/.csv/.png, CPR and CMD in summary.json "
                            "and graph.json's metadata.info")
    graph.add_argument("--heads", action="store_true",
                       help="split the kept edges that cross positions by attention head and "
                            "decompose their leading heads' scores into QK terms (graph.json "
                            "links' 'heads' and 'attention'; docs/attribution.md, 'Attention "
                            "inside the graph')")
    graph.add_argument("--prompts", type=Path, default=None,
                       help="a JSONL file of prompts (one object per line: prompt, optional "
                            "answer and target): one graph directory per prompt under --out "
                            "and index.json; under torchrun the prompts are spread over the "
                            "ranks; a rerun resumes")
    graph.add_argument("--split", default="features", choices=("features", "rows"),
                       help="under torchrun with more than one rank: features shards the "
                            "transcoder by feature (each rank loads a slice of every layer's "
                            "features); rows keeps it whole on every rank and splits each batch "
                            "of rows (default features; docs/attribution.md, 'Beyond one "
                            "device')")
    lorsa_attribute_flags(graph)
    check = graph.add_argument_group(
        "cross-check", "trace the same prompt and compare (cross_check.json, cross_check.png)")
    check.add_argument("--cross-check", action="store_true",
                       help="per (layer, position): graph influence vs the trace's indirect "
                            "effect; top features: linear prediction vs a patch to their "
                            "noised values")
    check.add_argument("--subject", type=TEXT, default=None,
                       help="the noised subject (default: 'The Eiffel Tower' for the default "
                            "prompt)")
    check.add_argument("--seeds", type=POSITIVE_INT, default=TRACE_SEEDS,
                       help=f"noise seeds 0..N-1 of the trace (default {TRACE_SEEDS})")
    check.add_argument("--scale", default=str(NOISE_SCALE),
                       help=f"noise in units of sigma, or 'auto' (default {NOISE_SCALE:g})")
    check.add_argument("--check-features", type=POSITIVE_INT, default=CROSS_CHECK_FEATURES,
                       help="top features (by influence) patched to their noised values "
                            f"(default {CROSS_CHECK_FEATURES})")
    check.add_argument("--check-window", type=POSITIVE_INT, default=CROSS_CHECK_WINDOW,
                       help=f"layers one MLP restore spans (default {CROSS_CHECK_WINDOW}, one "
                            "MLP sublayer, as a graph cell)")
    check.add_argument("--check-modes", default=",".join(CROSS_CHECK_MODES),
                       help="where the patches are measured: spliced (attention and norms "
                            "live), replacement (held: the local replacement model) (default "
                            f"{','.join(CROSS_CHECK_MODES)})")
    _faithfulness_flags(graph.add_argument_group(
        "faithfulness", "with --faithfulness: the curve's settings (as `evaluate`'s)"))
    graph.add_argument("--out", type=Path, required=True,
                       help="writes graph.json (viewer format), graph.safetensors, "
                            "nodes.csv, edges.csv, graph.png, summary.json; rows computed so "
                            "far are kept in rows.partial/, so an interrupted run resumes")

    fit = commands.add_parser(
        "fit", help="fit a first transcoder for a model (default: a per-layer set with skip, "
                    "256 TopK features per layer, 16 a token, for the bundled SmolLM2) and "
                    "save it under ~/.cache/pyvene_causaltrace/transcoders/"
                    "<model>-<kind>-<features>[-top<k>]")
    fit.add_argument("--model", default=None,
                     help="a local model directory or a hub id (default: smollm2-135m, bundled)")
    _device(fit)
    fit.add_argument("--kind", default=None, choices=("skip_plt", "plt", "clt"),
                     help="skip_plt: per-layer with a skip path (default); plt: per-layer; "
                          "clt: cross-layer")
    fit.add_argument("--quality", default="quick", choices=("quick", "long"),
                     help="the preset the other flags change: quick (default; about 4 minutes "
                          "on 2 CPU cores for SmolLM2) or long (more text, features and steps; "
                          "docs/transcoders.md gives its time and figures)")
    fit.add_argument("--features", type=POSITIVE_INT, default=None,
                     help="features per layer (default 256)")
    fit.add_argument("--activation", default=None, choices=("relu_topk", "relu", "jumprelu"),
                     help="relu_topk: each layer's k largest features per token, no penalty "
                          "(default); relu: an L1 penalty; jumprelu: learned thresholds and an "
                          "L0 penalty")
    fit.add_argument("--k", type=POSITIVE_INT, default=None,
                     help="relu_topk's features kept per layer and token, at most --features "
                          "(default 16)")
    fit.add_argument("--steps", type=POSITIVE_INT, default=None,
                     help="optimiser steps (default 400)")
    fit.add_argument("--lr", type=PROBABILITY, default=None,
                     help="learning rate, above 0 and at most 1 (default 5e-3)")
    fit.add_argument("--data", default=None,
                     help="self (text the model generates: offline, default), known_1000, or a "
                          "file: one text per line, or facts as JSON/JSONL")
    fit.add_argument("--texts", type=POSITIVE_INT, default=None,
                     help="training texts (a tenth as many more, 4 to 32, are held out; "
                          "default 480); "
                          "the fit's memory is estimated and checked before it starts")
    fit.add_argument("--seed", type=SEED, default=None, help="0 to 2**63-1 (default 0)")
    fit.add_argument("--out", type=Path, default=None,
                     help="where to save: a new directory, or one fit wrote (holding fit.json); "
                          "another folder is refused (default: named by model, kind and "
                          "features under the cache directory, $PYVENE_CAUSALTRACE_CACHE)")
    fit.add_argument("--refit", action="store_true",
                     help="replace a transcoder fit saved there with other settings, swapped "
                          "in whole (without it, one with the same settings is reused and "
                          "another refused)")
    fit.add_argument("--no-progress", action="store_true", help="no progress bars")

    _device(add_fit_lorsa(commands, _MODEL_HELP))  # its --device: where the fit runs
    steer = commands.add_parser(
        "steer", parents=[plugins],
        help="set transcoder features to values: top tokens against the clean run, and a "
             "greedy continuation with the features held")
    steer.add_argument("--spec", type=Path, default=None,
                       help="a steering spec (intervention_specs/feature_steering.json: "
                            "clt_splice with error, feature_ablate with value); --model/--device/"
                            "--clt/--max-new-tokens/--out apply to it")
    steer.add_argument("--model", default=None, help=_MODEL_HELP)
    _device(steer)
    steer.add_argument("--clt", default=None, help=_TRANSCODER_HELP)
    steer.add_argument("--format", default=None, help=_FORMAT_HELP)
    steer.add_argument("--prompt", type=TEXT, default=None, help=f"default: {EIFFEL['prompt']!r}")
    steer.add_argument("--set", action="append", default=[], metavar="LAYER:POS:FEATURE=VALUE",
                       help="set a feature (repeatable); POS is a prompt position (negative "
                            "from the end) or 'all' (every prompt and generated position)")
    steer.add_argument("--max-new-tokens", type=NON_NEGATIVE_INT, default=STEER_MAX_NEW_TOKENS,
                       help="greedy tokens to generate, with the features held and without; "
                            "refused before any forward past the model's positions "
                            "(max_position_embeddings) or the memory budget (default "
                            f"{STEER_MAX_NEW_TOKENS})")
    steer.add_argument("--memory-mb", type=MEMORY_MB, default=None,
                       help="memory one generation step may hold (default: the device's); "
                            "each step reruns the whole sequence")
    steer.add_argument("--no-progress", action="store_true",
                       help="no progress bar (shown from 32 new tokens on)")
    steer.add_argument("--no-hold-errors", action="store_true",
                       help="keep the transcoder's error live (the model's own MLP output plus "
                            "what the set features change, as circuit-tracer does) instead of "
                            "holding it at the clean run's")
    steer.add_argument("--freeze-attention", action="store_true",
                       help="hold the prompt's attention patterns at the clean run's")
    steer.add_argument("--bos", default=None, choices=_BOS_MODES, help=_BOS_HELP)
    steer.add_argument("--top-k", type=POSITIVE_INT, default=STEER_TOP_K,
                       help=f"top tokens per run (default {STEER_TOP_K})")
    steer.add_argument("--out", type=Path, default=None,
                       help="write steering.json (the result) and spec.json (the spec that "
                            "reproduces it) here")

    evaluate = commands.add_parser(
        "evaluate", help="how far to trust a graph: MIB's faithfulness curve f(k), CPR and CMD "
                         "(docs/attribution.md, 'Faithfulness')")
    evaluate.add_argument("graph", type=Path, help="a graph.safetensors written by attribute")
    evaluate.add_argument("--model", default=None, help=_MODEL_HELP)
    _device(evaluate)
    evaluate.add_argument("--clt", required=True, help=_TRANSCODER_HELP)
    evaluate.add_argument("--format", default=None, help=_FORMAT_HELP)
    _faithfulness_flags(evaluate)
    evaluate.add_argument("--budget", action="store_true",
                          help="the feature-budget curve instead: KL and P(answer) with the top "
                               "K active features live, beside K random ones")
    evaluate.add_argument("--budgets", default=",".join(str(k) for k in FAITH_BUDGETS),
                          help="with --budget: the K, whole numbers > 0, increasing; all "
                               "active features added (default %(default)s)")
    evaluate.add_argument("--out", type=Path, default=None, help="write faithfulness.json, "
                          ".csv, .png (with --budget: budget_curve.json, .csv, .png)")

    commands.add_parser("interventions", parents=[plugins],
                        help="list the registered intervention types")

    view = commands.add_parser(
        "serve", help="an interactive viewer of the attribution graphs under DIR, on localhost")
    view.add_argument("dir", type=Path, help="a directory holding graph.json files (any depth)")
    view.add_argument("--port", type=PORT, default=8765)
    view.add_argument("--no-open", action="store_true", help="do not open a browser")
    return parser
