"""Average indirect effects over known facts on the bundled SmolLM2-135M (issue: dataset AIE).

    python examples/smollm2_dataset.py --limit 200 --seeds 3            # ~1 h on 2 CPU cores

Rows stream to ``--out`` (default ``runs/smollm2_known``; rerun the same command to resume);
the aggregate, tables and figures go to ``examples/results/dataset/``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pyvene_causaltrace.dataset import read_records, trace_dataset
from pyvene_causaltrace.models import load_model

HERE = Path(__file__).parent
KNOWN = HERE.parent.parent / "shared" / "data" / "known_1000.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=KNOWN)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2_known"))
    parser.add_argument("--report", type=Path, default=HERE / "results" / "dataset")
    args = parser.parse_args()

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
    print(result.summary())
    print(json.dumps(result.effects, indent=2))


if __name__ == "__main__":
    main()
