"""Average indirect effects over known facts on the bundled SmolLM2-135M, set beside ROME's
GPT-2 XL and the seed's Qwen3-8B-Base numbers in relative depth.

    python examples/smollm2_dataset.py                  # 200 facts, 3 kinds, 3 seeds, resumable
    # or the same run on two processes, then the report from the merged directory:
    torchrun --standalone --nproc_per_node 2 -m pyvene_causaltrace.cli dataset \\
        --data ../shared/data/known_1000.json --limit 200 --kinds residual,mlp,attn --seeds 3 \\
        --out runs/smollm2_known
    python examples/smollm2_dataset.py --aggregate-only

Rows stream to ``--out`` (default ``runs/smollm2_known``); the aggregate, tables, figures and
``summary.md`` go to ``examples/results/dataset/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pyvene_causaltrace.dataset import read_records, trace_dataset
from pyvene_causaltrace.dataset.run import load_dataset_result

HERE = Path(__file__).parent
KNOWN = HERE.parent.parent / "shared" / "data" / "known_1000.json"

#: (model, layers, kind, role, peak layer, peak AIE) from ../shared/seeds/rome-replication.txt
REFERENCE = [
    ("GPT-2 XL (seed's replication)", 48, "residual", "Last subject token", 13, 0.069),
    ("GPT-2 XL (ROME paper)", 48, "residual", "Last subject token", 15, 0.087),
    ("GPT-2 XL (seed's replication)", 48, "mlp", "Last subject token", 4, 0.034),
    ("GPT-2 XL (seed's replication)", 48, "attn", "Last token", 31, None),
    ("GPT-2 XL (ROME paper)", 48, "attn", "Last token", 32, None),
    ("Qwen3-8B-Base (seed)", 36, "residual", "Last subject token", 8, 0.231),
    ("Qwen3-8B-Base (seed)", 36, "mlp", "Last subject token", 5, 0.233),
    ("Qwen3-8B-Base (seed)", 36, "attn", "Last token", 26, 0.220),
]


def comparison(result) -> str:
    peaks = result.peaks().set_index(["kind", "role"])
    lines = ["| site | model | peak layer / layers | relative depth | peak AIE |",
             "|---|---|---|---|---|"]
    for kind, role in (("residual", "Last subject token"), ("mlp", "Last subject token"),
                       ("attn", "Last token")):
        ours = peaks.loc[(kind, role)]
        lines.append(f"| {kind}, {role} | **SmolLM2-135M (this run)** | {int(ours.peak_layer)}"
                     f" / {result.n_layers} | **{ours.depth:.2f}** | **{ours.peak_aie:.3f}** "
                     f"[{ours.ci_low:.3f}, {ours.ci_high:.3f}] |")
        for model, layers, k, r, layer, aie in REFERENCE:
            if (k, r) == (kind, role):
                value = "—" if aie is None else f"{aie:.3f}"
                lines.append(f"| | {model} | {layer} / {layers} | {layer / (layers - 1):.2f} | "
                             f"{value} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=KNOWN)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2_known"))
    parser.add_argument("--aggregate-only", action="store_true",
                        help="only aggregate --out (a finished or merged run)")
    parser.add_argument("--report", type=Path, default=HERE / "results" / "dataset")
    args = parser.parse_args()

    if args.aggregate_only:
        result = load_dataset_result(args.out)
    else:
        from pyvene_causaltrace.models import load_model

        model, tokenizer = load_model()
        records, errors = read_records(args.data)
        result = trace_dataset(model, tokenizer, records, out=args.out, limit=args.limit,
                               kinds=("residual", "mlp", "attn"), seeds=args.seeds,
                               scale=args.scale, errors=errors)
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / "aggregate.json").write_text(result.to_json())
    result.to_dataframe().to_csv(args.report / "aie.csv", index=False)
    result.peaks().to_csv(args.report / "peaks.csv", index=False)
    result.plot(args.report / "figure1.png")
    result.plot_curves(args.report / "curves.png")
    text = ["# SmolLM2-135M: average indirect effects over known facts", "",
            "```", result.summary(), "```", "", comparison(result), ""]
    (args.report / "summary.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
