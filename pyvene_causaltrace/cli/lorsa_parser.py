"""The Lorsa flags of ``attribute`` and the ``fit-lorsa`` command (attention features:
docs/attribution.md, "Attention features beside head loadings"). Imports nothing heavy, as
:mod:`.parser`, which adds them."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..arguments import PositiveInt, Probability, Seed, flag

POSITIVE_INT, SEED, PROBABILITY = flag(PositiveInt), flag(Seed), flag(Probability)

_LORSA_HELP = (
    "a Lorsa set replacing attention at its layers: llamascopium's layout (a directory with "
    "config.json and sae_weights.safetensors, or a directory of them, one per layer; "
    "`fit-lorsa` writes one). Its OV heads are feature nodes beside the transcoder's "
    "('lorsa' in graph.json), what it misses an error node per layer and position ('lorsa "
    "error'); a Lorsa of another model (lm_config.json's model_name unless fit-lorsa's "
    "fit.json fingerprinted the model's own weights; d_model, QK head width) or of a layer "
    "the model lacks is refused before the graph")
_QK_HELP = ("with --lorsa: QK tracing of the Lorsa nodes the pruning keeps: why each head "
            "attends where it does, its QK score split over the graph's nodes on the query and "
            "the key side (graph.json's qk_tracing_results and qk_only_nodes, summary.json's "
            "qk_tracing)")


def lorsa_attribute_flags(graph: argparse.ArgumentParser) -> None:
    """``attribute --lorsa DIR [--qk-tracing]``."""
    graph.add_argument("--lorsa", type=Path, default=None, metavar="DIR", help=_LORSA_HELP)
    graph.add_argument("--qk-tracing", action="store_true", help=_QK_HELP)


def add_fit_lorsa(commands, model_help: str) -> argparse.ArgumentParser:
    """``fit-lorsa``: :func:`~..lorsa_fitting.fit_lorsa_set` from flags (its ``--device`` is
    added by :mod:`.parser`, as every command's)."""
    fit = commands.add_parser(
        "fit-lorsa",
        help="fit Lorsas (attention features) for some of a model's attention layers, each "
             "started from the layer's own heads, and save the set `attribute --lorsa` reads "
             "(default under ~/.cache/pyvene_causaltrace/lorsas/<model>-lorsa-k<top-k>); the "
             "whole fit runs on --device")
    fit.add_argument("--model", default=None, help=model_help)
    fit.add_argument("--layers", required=True, metavar="L[,L...]",
                     help="the attention layers to fit, comma-separated (e.g. 2,5,8)")
    fit.add_argument("--top-k", type=POSITIVE_INT, default=None,
                     help="OV heads kept per position (default 32)")
    fit.add_argument("--per-qk-head", type=POSITIVE_INT, default=None,
                     help="OV heads per QK head (default 2 x the head width: the start is then "
                          "the attention layer exactly, before TopK)")
    fit.add_argument("--steps", type=POSITIVE_INT, default=None,
                     help="Adam steps per layer on the OV side (default 200)")
    fit.add_argument("--lr", type=PROBABILITY, default=None,
                     help="learning rate, above 0 and at most 1 (default 1e-3)")
    fit.add_argument("--batch", type=POSITIVE_INT, default=None,
                     help="texts per step (default 8)")
    fit.add_argument("--length", type=POSITIVE_INT, default=None,
                     help="tokens per text; shorter texts are skipped (default 64)")
    fit.add_argument("--texts", type=POSITIVE_INT, default=None,
                     help="training texts; a tenth as many more (4 to 32) are held out for "
                          "the FVU (default 256)")
    fit.add_argument("--data", default=None,
                     help="self (text the model generates: offline, default), known_1000, or a "
                          "file: one text per line, or facts as JSON/JSONL")
    fit.add_argument("--seed", type=SEED, default=None, help="0 to 2**63-1 (default 0)")
    fit.add_argument("--out", type=Path, default=None,
                     help="where to save: a new directory, or one fit-lorsa wrote (holding "
                          "fit.json); another folder is refused")
    fit.add_argument("--refit", action="store_true",
                     help="replace a set fitted there with other settings, swapped in whole "
                          "(without it, one with the same settings is reused and another "
                          "refused)")
    return fit
