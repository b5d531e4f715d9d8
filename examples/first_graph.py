"""A first attribution graph on this machine: fit a small CLT to SmolLM2 if none is cached, then
build the graph of " Paris" after "The Eiffel Tower is in the city of" and write it out.

    make attribute                      # = python examples/first_graph.py --out out/graph

The CLT: the one ``examples/fit_smollm2_clt.py`` fits (256 features per layer, ~16 min) when
it is in the cache; otherwise a quick one (128 features, fewer steps, a few minutes) fitted on
ROME's known_1000 facts — fetched by name — or, offline, on the text of this repository's docs.
It is saved under ``~/.cache/pyvene_causaltrace/clts/`` so the next run skips the fit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pyvene_causaltrace import load_model
from pyvene_causaltrace.cli import main as cli
from pyvene_causaltrace.models import cache_dir
from pyvene_causaltrace.transcoders.fit import fit_clt

ROOT = Path(__file__).resolve().parents[1]
FULL = cache_dir() / "clts" / "smollm2-135m-fitted-256"
QUICK = cache_dir() / "clts" / "smollm2-135m-quick-128"


def training_texts(limit: int) -> tuple[list[str], str]:
    """known_1000's facts as text if they can be had, else the docs' prose lines."""
    from pyvene_causaltrace.dataset import read_records
    from pyvene_causaltrace.dataset.sources import DatasetUnavailableError

    try:
        records, _ = read_records("known_1000")
        return [f"{r.prompt}{r.target}" for r in records][:limit], "ROME's known_1000 facts"
    except DatasetUnavailableError as error:
        print(f"known_1000 unavailable ({error}); fitting on the repository's docs instead")
    lines = [line.strip() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for line in page.read_text().splitlines()]
    prose = [line for line in lines if len(line.split()) >= 8 and not line.startswith(("|", "`"))]
    return prose[:limit], "the docs' prose"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/graph"))
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--texts", type=int, default=400)
    args = parser.parse_args()
    clt = FULL if (FULL / "config.yaml").exists() else QUICK
    if not (clt / "config.yaml").exists():
        model, tokenizer = load_model("smollm2-135m")
        texts, what = training_texts(args.texts)
        print(f"no CLT cached: fitting {args.features} features per layer on {len(texts)} texts "
              f"of {what} ({args.steps} steps; a few minutes)")
        start = time.perf_counter()
        fitted, stats = fit_clt(model, tokenizer, texts, d_transcoder=args.features,
                                steps=args.steps, model_name="smollm2-135m", progress=True)
        fitted.save_model(str(clt))
        print(f"fitted in {time.perf_counter() - start:.0f} s (FVU {stats.train_fvu:.3f}); "
              f"saved to {clt}")
    code = cli(["attribute", "--clt", str(clt), "--out", str(args.out)])
    if code == 0:
        print(f"\nexplore it: pyvene-causaltrace serve {args.out}   (or open "
              f"{args.out / 'graph.png'})")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
