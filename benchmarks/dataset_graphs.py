"""Dataset throughput with and without attribution graphs: facts per minute of
``trace_dataset`` on the same known facts, traces alone and traces + one graph per fact
(``dataset --graphs --clt DIR``), in one process, the two settings interleaved (A B, then B A,
...) so that drift of the machine's speed falls on both.

    python benchmarks/dataset_graphs.py --facts 50               # SmolLM2, CPU
    python benchmarks/dataset_graphs.py --facts 2 --repeats 1 --kinds residual --seeds 1  # smoke

Each run screens and traces into a fresh directory (screen, sigma, traces, graphs and the
aggregate all count), so the two settings differ only by the graphs. Also printed: the mean
seconds of one graph (from its row) and the mean active and explored features.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pyvene_causaltrace.dataset import GraphSettings, read_records, trace_dataset
from pyvene_causaltrace.dataset.store import GRAPHS, read_jsonl
from pyvene_causaltrace.defaults import DATASET_SEEDS
from pyvene_causaltrace.models import load_model
from pyvene_causaltrace.transcoders import load_transcoder

ROOT = Path(__file__).resolve().parents[1]
KNOWN = ROOT.parent / "shared" / "data" / "known_1000.json"
CLT = Path("~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16").expanduser()


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=KNOWN,
                        help="known_1000.json-style facts (default: ../shared/data/"
                             "known_1000.json beside the repository)")
    parser.add_argument("--clt", type=Path, default=CLT, help="transcoder directory")
    parser.add_argument("--format", default=None, help="the transcoder's layout (detected)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--facts", type=int, default=20, help="kept facts per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting")
    parser.add_argument("--kinds", default="residual,mlp,attn")
    parser.add_argument("--seeds", type=int, default=DATASET_SEEDS)
    parser.add_argument("--known", default="argmax", choices=("argmax", "none"))
    parser.add_argument("--max-feature-nodes", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    model, tokenizer = load_model(args.model)
    transcoder = load_transcoder(args.clt, format=args.format)
    records, _ = read_records(args.data)
    settings = GraphSettings(max_feature_nodes=args.max_feature_nodes)
    options = dict(limit=args.facts, kinds=args.kinds.split(","), seeds=args.seeds,
                   known=args.known, progress=False, n_boot=200)
    seconds: dict[str, list[float]] = {"traces": [], "traces + graphs": []}
    graphs: list[dict] = []
    for repeat in range(args.repeats):
        order = ["traces", "traces + graphs"]
        for setting in order if repeat % 2 == 0 else order[::-1]:
            with tempfile.TemporaryDirectory() as out:
                extra = ({"transcoder": transcoder, "graph_options": settings}
                         if setting == "traces + graphs" else {})
                start = time.perf_counter()
                result = trace_dataset(model, tokenizer, records, out=out, **options, **extra)
                seconds[setting].append(time.perf_counter() - start)
                if extra:
                    graphs += list(read_jsonl(Path(out) / GRAPHS))
            n = result.effects[options["kinds"][0]]["n_facts"]
            print(f"run {repeat + 1}, {setting}: {n} facts in {seconds[setting][-1]:.1f} s")
    print(f"\n{'setting':<16} {'runs':>4} {'median s':>9} {'facts/min':>9}")
    report = {"model": args.model, "clt": str(args.clt), "facts": n, "kinds": options["kinds"],
              "seeds": args.seeds, "known": args.known,
              "max_feature_nodes": args.max_feature_nodes, "settings": {}}
    for setting, times in seconds.items():
        median = statistics.median(times)
        report["settings"][setting] = {"seconds": times, "facts_per_minute": 60 * n / median}
        print(f"{setting:<16} {len(times):>4} {median:>9.1f} {60 * n / median:>9.2f}")
    per_graph = statistics.mean(row["seconds"] for row in graphs)
    features = statistics.mean(row["n_features"] for row in graphs)
    explored = statistics.mean(row["n_explored"] for row in graphs)
    report["graph"] = {"seconds": per_graph, "n_features": features, "n_explored": explored}
    print(f"one graph: {per_graph:.2f} s on average, {features:.0f} active features, "
          f"{explored:.0f} explored")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
