"""The one short table at the end of ``gpu_check.sh``: reads the JSON each step wrote into a
folder (missing steps show as ``-``) and prints issue 27 item 4's numbers beside its targets;
``--combine FILE`` also writes every step's JSON into one file.

    python benchmarks/gpu_summary.py FOLDER [--combine results.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(folder: Path, name: str):
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--combine", type=Path, default=None)
    args = parser.parse_args()
    folder = args.folder
    if args.combine:
        args.combine.write_text(json.dumps(
            {p.stem: read(folder, p.name) for p in sorted(folder.glob("*.json"))}, indent=1))
    shapes = ("llama1b", "qwen3_8b")
    traces = {s: read(folder, f"trace_{s}.json") for s in shapes}
    attribution = {s: (read(folder, f"attribution_{s}.json") or [])
                   + (read(folder, f"attribution_{s}_replicated.json") or []) for s in shapes}
    rows = []

    def trace_row(label, fn, target=""):
        rows.append((label, *[fn(traces[s]) if traces[s] else "-" for s in shapes], target))

    trace_row("trace rows (layers x tokens x seeds)",
              lambda t: f"{t['layers']}x{t['tokens']}x{t['seeds']}={t['rows']}")
    trace_row("trace() end to end, s", lambda t: f"{t['seconds']['public']:.3f}",
              "Qwen3-8B <= 1.0 s")
    trace_row("plain batched floor, s", lambda t: f"{t['seconds']['plain']:.3f}")
    trace_row("trace() / floor", lambda t: f"{t['public_vs_plain']:.3f}", "<= 1.0")
    trace_row("engine alone, s", lambda t: f"{t['seconds']['engine']:.3f}")
    trace_row("peak GPU memory of trace(), GiB",
              lambda t: "-" if t["peak_gib"] is None else f"{t['peak_gib']:.2f}")
    for method, label in (("batched", "ours"), ("replicated", "circuit-tracer's replicated")):
        def pick(results, method=method):
            return next((r for r in results or [] if r["method"] == method), None)

        for field, unit in (("ms_per_row", "ms/row"), ("peak_extra_mb", "peak MB")):
            cells = []
            for s in shapes:
                r = pick(attribution[s])
                cells.append("-" if r is None else
                             f"{r[field]:.2f}" + (f" (B={r['batch']})" if field == "ms_per_row"
                                                  else ""))
            rows.append((f"attribution {label}, {unit}", *cells, ""))
    rows.append(("attribution rows / active features / tokens",
                 *[" ; ".join(f"{r['rows']} / {r['features']} / {r['tokens']}"
                              for r in attribution[s]) or "-" for s in shapes], "7,500 rows"))
    widths = [max(len(str(r[i])) for r in rows + [("measure", *shapes, "target")])
              for i in range(4)]
    for r in [("measure", *shapes, "target"), tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    fit = read(folder, "fit_costs.json")
    if fit:
        c = fit["constants"]
        kind = "cuda" if fit["device"].startswith("cuda") else "cpu"
        print(f'fitted "{kind}": DeviceSpeed(layer_overhead={c["layer_overhead"]:.3g}, '
              f'forward_overhead={c["forward_overhead"]:.3g}, bandwidth={c["bandwidth"]:.3g}, '
              f'flops={c["flops"]:.3g})  (median relative error '
              f'{fit["median_relative_error"]:.1%})')
    else:
        print("fitted constants: - (the fit did not finish)")


if __name__ == "__main__":
    main()
