"""A first attribution graph on this machine (``make attribute``): fit the first transcoder for
SmolLM2 unless the same one is saved (``pyvene-causaltrace fit``: a per-layer set with skip, 256
TopK features, on text the model writes itself; saved as
``~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16``, where the README's
blocks load it), then build the graph of " Paris" after "The Eiffel Tower is in the city of",
write it out and say how to view it.

    make attribute                          # = python examples/first_graph.py --out out/graph
    python examples/first_graph.py --features 256 --steps 600       # another (named) transcoder
    python examples/first_graph.py --record examples/results/first_graph.json   # the timings

Every phase shows progress on stderr; ``--no-progress`` silences the bars.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import pandas as pd

from pyvene_causaltrace import load_model
from pyvene_causaltrace.atomic import write_text
from pyvene_causaltrace.cli import main as cli
from pyvene_causaltrace.fitting import QUALITIES, FitSettings, fit_transcoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/graph"))
    parser.add_argument("--quality", default="quick", choices=tuple(QUALITIES),
                        help="quick: the default settings (about 4 minutes on 2 CPU cores); "
                             "long: more text, features and steps (make attribute QUALITY=long)")
    parser.add_argument("--kind", choices=("skip_plt", "plt", "clt"))
    parser.add_argument("--features", type=int)
    parser.add_argument("--activation", choices=("relu_topk", "relu", "jumprelu"))
    parser.add_argument("--k", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--texts", type=int)
    parser.add_argument("--data")
    parser.add_argument("--refit", action="store_true",
                        help="replace a saved transcoder of the same name and other settings")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--record", type=Path, default=None,
                        help="write the phases' seconds, the pairing and the graph's error share "
                             "here (examples/results/first_graph.json)")
    args = parser.parse_args()
    start = time.perf_counter()
    progress = not args.no_progress
    model, tokenizer = load_model("smollm2-135m")
    loaded = time.perf_counter() - start
    given = {name: getattr(args, name) for name in ("kind", "features", "activation", "k",
                                                    "steps", "texts", "data")
             if getattr(args, name) is not None}
    settings = FitSettings(**{**QUALITIES[args.quality], **given})
    try:
        report = fit_transcoder(settings, refit=args.refit, progress=progress, model=model,
                                tokenizer=tokenizer)
    except ValueError as error:  # the package's InputError: other settings saved there
        raise SystemExit(f"error: {error}") from None
    print(report.summary(), flush=True)
    fitted = time.perf_counter()
    code = cli(["attribute", "--clt", str(report.path), "--out", str(args.out)])
    attributed = time.perf_counter()
    if code == 0:
        print(f"\nexplore it: pyvene-causaltrace serve {args.out}   (or open "
              f"{args.out / 'graph.png'}); load the transcoder in Python with "
              f"load_transcoder({str(report.path)!r})")
    if code == 0 and args.record is not None:
        record_run(args, report,
                   {"load model": round(loaded, 1), "fit (all phases)": round(fitted - start
                                                                            - loaded, 1),
                    "attribute (the CLI, writing every file)": round(attributed - fitted, 1),
                    "total": round(attributed - start, 1)})
    raise SystemExit(code)


def record_run(args, report, seconds: dict) -> None:
    """The run's numbers for examples/results/: phases, the held-out pairing, the graph's error
    share and its most influential nodes (from the files the CLI wrote)."""
    summary = json.loads((args.out / "summary.json").read_text())
    nodes = pd.read_csv(args.out / "nodes.csv")
    inputs = nodes[nodes["kind"] != "logit"]
    top = inputs.nlargest(10, "influence")
    error_influence = float(inputs.loc[inputs["kind"] == "error", "influence"].sum()
                            / inputs["influence"].sum())
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    record = {"command": f"make attribute QUALITY={args.quality}  (= python "
                         f"examples/first_graph.py --quality {args.quality} --out out/graph)",
              "machine": f"{os.cpu_count()} CPU cores, shared; uptime after the run: {load}",
              "transcoder": str(report.path), "reused": report.reused, "fit": report.record,
              "seconds": seconds,
              "graph": {"decomposition": summary["decomposition"], "scores": summary["scores"],
                        "error_share_direct": summary["decomposition"]["error_share"],
                        "error_share_of_influence": error_influence,
                        "closure": summary["closure"], "metadata": summary["metadata"],
                        "top_nodes_by_influence": json.loads(top.to_json(orient="records"))}}
    write_text(json.dumps(record, indent=2, default=str), args.record)
    print(f"wrote {args.record}")


if __name__ == "__main__":
    main()
