"""How the first transcoder's held-out FVU moves with the amount of text, the dictionary size and
``k`` (issue 52, item 2): is the quick or long recipe short of data or of capacity?

Generates ``max(--texts) + --held`` texts once, as ``make attribute`` does
(``fit_text.generate_ids``: SmolLM2-135M-Instruct's own text, sampled in batches), reading the
pairs of ``--layers`` only from the generation's forwards (per-layer transcoders are fitted
independently, so a few layers stand for all; memory is those layers' pairs), and
fits the default kind (``skip_plt``, the package's ``RECIPE``) on the first ``n`` texts for each
``n`` in ``--texts``. Each fit is scored on the same held-out texts two ways: per text, as the
pairing check (``transcoders/checks.py``: deviation from each text's own mean), and centred on
one mean over all held-out tokens (``all_tokens``, as the fit's ``train_fvu``). Also
the FVU of the skip path alone (features off), and the train FVU. One JSON line per fit.

    python benchmarks/fit_scaling.py --texts 320,640,1024 --features 1024 --k 32 --steps 2000 \\
        --out benchmarks/results/fvu52/fit_scaling.jsonl
    python benchmarks/fit_scaling.py --transcoder DIR --held 64 --seed 7  # score a fitted one
    SMOKE=1 python benchmarks/fit_scaling.py                       # a 1-minute check that it runs
    python benchmarks/fit_scaling.py --device cuda --texts 2048,4096,8192 --features 2048  # a GPU

``--transcoder DIR`` fits nothing: it scores a saved transcoder (every layer) on ``--held`` texts
generated with ``--seed`` (a seed other than its fit's: text it has not seen).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pyvene_causaltrace import load_model
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.defaults import BOS
from pyvene_causaltrace.fit_text import generate_ids
from pyvene_causaltrace.fitting import KINDS, RECIPE
from pyvene_causaltrace.prompts import first_position
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.transcoders.fit import fast_bf16, fit_pairs


def held_out_fvu(transcoder, texts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Per-layer FVU on ``texts`` (``(x, y)`` of one text each, ``[P, L, D]``): centred per text
    and on all tokens' mean, with the features and with the skip path alone."""
    n_layers, device = texts[0][0].shape[1], texts[0][0].device
    err, err_skip, dev_text = (torch.zeros(n_layers, dtype=torch.float64, device=device)
                               for _ in range(3))
    total = torch.zeros(n_layers, texts[0][1].shape[2], dtype=torch.float64, device=device)
    square = torch.zeros(n_layers, dtype=torch.float64, device=device)
    count = 0
    with torch.no_grad():
        for x, y in texts:
            x, y = x.float().transpose(0, 1), y.float().transpose(0, 1).double()  # [L, P, D]
            acts = transcoder.encode_all(x, zero_bos=False)
            err += (y - transcoder.reconstruct(acts, x).double()).pow(2).sum((1, 2))
            skip = transcoder.reconstruct(torch.zeros_like(acts), x).double()
            err_skip += (y - skip).pow(2).sum((1, 2))
            dev_text += (y - y.mean(1, keepdim=True)).pow(2).sum((1, 2))
            total += y.sum(1)
            square += y.pow(2).sum((1, 2))
            count += y.shape[1]
    dev_all = square - total.pow(2).sum(1) / count
    return {"per_text": (err / dev_text).tolist(), "all_tokens": (err / dev_all).tolist(),
            "skip_only_per_text": (err_skip / dev_text).tolist(), "tokens": count}


def main() -> None:
    smoke = os.environ.get("SMOKE") == "1"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", default="8,16" if smoke else "320,640,1024")
    parser.add_argument("--held", type=int, default=4 if smoke else 64)
    parser.add_argument("--layers", default="4,8,14,20,24")
    parser.add_argument("--features", type=int, default=64 if smoke else 1024)
    parser.add_argument("--k", type=int, default=8 if smoke else 32)
    parser.add_argument("--steps", type=int, default=5 if smoke else 2000)
    parser.add_argument("--new-tokens", type=int, default=8 if smoke else 48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append one JSON line per fit here")
    parser.add_argument("--transcoder", default=None, help="score this one instead of fitting")
    parser.add_argument("--device", default="cpu", help="where the model and the fits run")
    args = parser.parse_args()
    sizes = [0] if args.transcoder else sorted(int(n) for n in args.texts.split(","))
    layers = [int(layer) for layer in args.layers.split(",")]

    model, tokenizer = load_model("smollm2-135m", device=args.device)
    bound = bind(model)
    n_texts = sizes[-1] + args.held
    if args.transcoder:
        layers = list(range(bound.n_layers))
    first = first_position(tokenizer, BOS)
    start = time.perf_counter()
    ids, x, y = generate_ids(bound, tokenizer, n_texts, args.new_tokens, args.seed, first=first,
                             keep=layers, record=n_texts, progress=True)
    generate_s = time.perf_counter() - start
    lengths = [len(row) - 1 - first for row in ids]  # each text's kept positions
    ends = torch.tensor(lengths).cumsum(0).tolist()
    print(json.dumps({"generated_texts": n_texts, "tokens": ends[-1], "layers": layers,
                      "generate_s": round(generate_s, 1),
                      "tokens_per_s": round(ends[-1] / generate_s, 1)}), flush=True)
    held = [(x[b:e], y[b:e]) for b, e in zip([0, *ends][sizes[-1]:-1], ends[sizes[-1]:],
                                             strict=True)]
    if args.transcoder:
        scores = held_out_fvu(load_transcoder(args.transcoder, device=args.device), held)
        per_text, all_tokens = (torch.tensor(scores[key]) for key in ("per_text", "all_tokens"))
        row = {"transcoder": args.transcoder, "held_out_texts": args.held, "seed": args.seed,
               "median_per_text": float(per_text.quantile(0.5)),
               "median_all_tokens": float(all_tokens.quantile(0.5)),
               "mean_per_text": float(per_text.mean()),
               "mean_all_tokens": float(all_tokens.mean()), **scores}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as file:
                file.write(json.dumps(row) + "\n")
        return
    for n in sizes:
        tokens = ends[n - 1]
        start = time.perf_counter()
        transcoder, stats = fit_pairs(
            x[:tokens].clone(), y[:tokens].clone(), "smollm2-135m", d_transcoder=args.features,
            steps=args.steps, activation="relu_topk", k=args.k, seed=args.seed, consume=True,
            bf16=fast_bf16(bound.device), **KINDS["skip_plt"][0], **RECIPE)
        fit_s = time.perf_counter() - start
        scores = held_out_fvu(transcoder, held)
        row = {"texts": n, "train_tokens": tokens, "layers": layers, "features": args.features,
               "k": args.k, "steps": args.steps, "train_fvu": stats.train_fvu,
               "held_out_texts": args.held, "held_out_tokens": scores.pop("tokens"),
               "mean_per_text": sum(scores["per_text"]) / len(layers),
               "mean_all_tokens": sum(scores["all_tokens"]) / len(layers), **scores,
               "generate_s": round(generate_s, 1), "fit_s": round(fit_s, 1),
               "load": os.getloadavg()[0], "torch_threads": torch.get_num_threads()}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as file:
                file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
