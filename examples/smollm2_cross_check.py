"""Tracing meets attribution on SmolLM2-135M: the four facts' graphs against their traces, with
the fitted CLT and the fitted per-layer set with skip.

    python examples/fit_smollm2_clt.py --features 256 --steps 400                          # once
    python examples/fit_smollm2_clt.py --kind per_layer --skip --features 256 --steps 400  # once
    python examples/smollm2_cross_check.py

For each fact and transcoder: a tracer (10 seeds, noise 3 x ROME's sigma), the complete graph
(every active feature explored, so total effects miss no path), and ``cross_check`` with the
residual and single-MLP traces and the top 20 features, measured in the spliced model and in the
local replacement model. Writes ``examples/results/cross_check/<transcoder>/<fact>/``
(``cross_check.json``, ``cross_check.png``) and ``examples/results/cross_check/summary.md``.
"""

from __future__ import annotations

import time
from pathlib import Path

from smollm2_traces import FACTS

from pyvene_causaltrace import Tracer, load_model
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.crosscheck import cross_check
from pyvene_causaltrace.models import cache_dir
from pyvene_causaltrace.transcoders import load_transcoder

OUT = Path(__file__).parent / "results" / "cross_check"
TRANSCODERS = {"clt": "smollm2-135m-clt-256", "skip_plt": "smollm2-135m-skip-plt-256"}


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    rows = []
    for tag, name in TRANSCODERS.items():
        transcoder = load_transcoder(str(cache_dir() / "transcoders" / name))
        for fact, prompt, subject, answer in FACTS:
            start = time.perf_counter()
            tracer = Tracer(model, tokenizer, prompt, subject, answer=answer, seeds=10,
                            scale=3.0)
            graph = attribute(model, tokenizer, transcoder, prompt, answer)
            graph_s = time.perf_counter() - start
            check = cross_check(graph, tracer, transcoder, top_n=20,
                                modes=("spliced", "replacement"))
            folder = OUT / tag / fact
            folder.mkdir(parents=True, exist_ok=True)
            check.to_json(folder / "cross_check.json")
            check.plot(folder / "cross_check.png")
            print(f"== {tag} {fact}: graph {graph_s:.0f} s, check {check.seconds:.0f} s",
                  flush=True)
            print(check.summary(), flush=True)
            rows.append((tag, fact, graph, check, graph_s))
    write_summary(rows)


def _f(value) -> str:
    return "n/a" if value is None or value != value else f"{value:+.2f}"


def write_summary(rows) -> None:
    lines = ["# Cross-check on SmolLM2-135M: the four facts", "",
             "Made by `python examples/smollm2_cross_check.py`: 10 seeds, noise 3 x ROME's "
             "sigma, complete graphs (demeaned target), single-layer MLP restores, the top 20 "
             "features by influence.", "",
             "## Sites: graph influence share vs trace indirect effect (Spearman over the cells "
             "from the subject on; top-10 overlap)", "",
             "| transcoder | fact | cells | residual: all | residual: features | residual: "
             "errors | mlp: all | mlp: features | mlp: errors | top-10 overlap (residual, "
             "all) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tag, fact, _, check, _ in rows:
        s = check.sites
        lines.append(
            f"| {tag} | {fact} | {s['residual']['all']['n_cells']} | "
            + " | ".join(_f(s[k][p]["spearman"]) for k in ("residual", "mlp")
                         for p in ("all", "features", "errors"))
            + f" | {s['residual']['all']['top_k_overlap']:.1f} |")
    lines += ["", "## Features: activation change x total effect vs the patch (means over "
              "seeds)", "",
              "| transcoder | fact | features | explored | spliced: Pearson | spliced: sign "
              "flips | replacement: Pearson | replacement: sign flips | replacement: largest "
              "gap | sum predicted | sum measured (spliced) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for tag, fact, graph, check, _ in rows:
        sp, rp = check.feature_stats["spliced"], check.feature_stats["replacement"]
        lines.append(f"| {tag} | {fact} | {graph.n_features} | {graph.n_explored} | "
                     f"{_f(sp['pearson'])} | {sp['n_sign_disagree']} | {_f(rp['pearson'])} | "
                     f"{rp['n_sign_disagree']} | {rp['max_abs_gap']:.3f} | "
                     f"{sp['sum_predicted']:+.3f} | {sp['sum_measured']:+.3f} |")
    lines += ["", "## Seconds", "", "| transcoder | fact | tracer + graph | cross_check |",
              "|---|---|---|---|"]
    lines += [f"| {tag} | {fact} | {graph_s:.0f} | {check.seconds:.0f} |"
              for tag, fact, _, check, graph_s in rows]
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
