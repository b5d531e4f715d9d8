"""Reading a graph at the scale of published transcoders: load, influence, prune and export a
synthetic graph of up to 60,000 feature nodes (16 layers x 64 positions, ~59 features per layer
and position) with 7,500 computed rows, from the sparse row store — beside the dense
``N x N`` reference (tests/dense_reading.py) where that fits.

    python benchmarks/graph_scale.py --out benchmarks/results/graph_scale_cpu.json

Structure as in a real graph: a row at layer ``l``, position ``p`` is nonzero exactly on its
causal cone (features and errors of earlier layers at positions <= p, tokens at positions <= p);
rows are chosen with a bias towards late positions, as influence ranking chooses them; values
are heavy-tailed (log-normal magnitudes, random signs) and fall off with the distance between
positions, like attention. Each measurement runs in a fresh process that loads the graph file
(peak RSS is that process's high-water mark, model-free).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
N_LAYERS, N_POS = 16, 64


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(n_features: int, n_rows: int, seed: int = 0):
    """A synthetic :class:`AttributionGraph` (module docstring)."""
    from pyvene_causaltrace.attribution.edges import Closure
    from pyvene_causaltrace.attribution.graph import AttributionGraph
    from pyvene_causaltrace.attribution.store import RowBlock, RowStore

    g = torch.Generator().manual_seed(seed)
    cells = N_LAYERS * (N_POS - 1)
    per_cell = torch.full((N_LAYERS, N_POS - 1), n_features // cells, dtype=torch.long)
    per_cell.view(-1)[:n_features % cells] += 1
    layer = torch.arange(N_LAYERS).repeat_interleave(per_cell.sum(1))
    position = torch.cat([torch.arange(1, N_POS).repeat_interleave(per_cell[layer_])
                          for layer_ in range(N_LAYERS)])
    feature_id = torch.randint(0, 32768, (n_features,), generator=g)
    start = torch.zeros(N_LAYERS, N_POS + 1, dtype=torch.long)  # first node of (layer, pos)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), per_cell.reshape(-1).cumsum(0)])
    start[:, 1:N_POS] = offsets[:-1].reshape(N_LAYERS, N_POS - 1)
    start[:, N_POS] = offsets[1:].reshape(N_LAYERS, N_POS - 1)[:, -1]
    start[:, 0] = start[:, 1]
    n_errors = N_LAYERS * N_POS
    n_columns = n_features + n_errors + N_POS

    def cone(at_layer: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns of a row at (at_layer, p) and each column's position."""
        cols, pos = [], []
        for source in range(at_layer):
            lo, hi = int(start[source, 1]), int(start[source, p + 1]) if p + 1 <= N_POS - 1 \
                else int(start[source, N_POS])
            cols.append(torch.arange(lo, hi))
            pos.append(position[lo:hi])
            cols.append(n_features + source * N_POS + torch.arange(p + 1))
            pos.append(torch.arange(p + 1))
        cols.append(n_features + n_errors + torch.arange(p + 1))
        pos.append(torch.arange(p + 1))
        return torch.cat(cols), torch.cat(pos)

    weight = torch.exp((position.float() - N_POS + 1) / 8) + 0.05
    rows = torch.multinomial(weight, min(n_rows, n_features), replacement=False,
                             generator=g).sort().values
    store = RowStore(n_columns)
    keys = torch.stack([layer[rows], position[rows]], 1)
    groups = [(N_LAYERS, N_POS - 1, torch.tensor([n_features + n_errors + N_POS]))]
    for key in keys.unique(dim=0).tolist():
        members = rows[(keys == torch.tensor(key)).all(1)]
        groups.append((key[0], key[1], members))
    for at_layer, p, members in groups:
        cols, pos = cone(at_layer, p)
        k = len(members)
        magnitude = torch.exp(torch.randn(k, len(cols), generator=g) * 1.5 - 3)
        sign = torch.randint(0, 2, (k, len(cols)), generator=g) * 2 - 1
        decay = 1.0 / (1.0 + (p - pos).float()) ** 1.5
        values = (magnitude * sign * decay).float()
        sums = values.double().sum(1)
        store.blocks.append(RowBlock(
            nodes=members, counts=torch.full((k,), len(cols), dtype=torch.long),
            columns=cols.int().repeat(k), values=values.reshape(-1),
            constants=torch.zeros(k, dtype=torch.float64), targets=sums))
    target = float(store.blocks[0].targets[0])
    return AttributionGraph(
        prompt="synthetic", tokens=[f"t{i}" for i in range(N_POS)],
        input_ids=list(range(N_POS)), target={"name": "synthetic", "token": 7,
                                              "coefficients": {7: 1.0}},
        answer="t7", answer_prob=0.5, n_layers=N_LAYERS, feature_layer=layer,
        feature_position=position, feature_id=feature_id,
        activation=torch.rand(n_features, generator=g) * 5, rows=store,
        closure=Closure(target, target, 0.0), metadata={"model": "synthetic"})


def read(path: str, dense: bool) -> dict:
    """Load a graph file, then influence, pruning and export; times and peak RSS."""
    from pyvene_causaltrace.attribution.graph import AttributionGraph

    base = rss_mb()
    times = {}
    start = time.perf_counter()
    graph = AttributionGraph.load(path)
    times["load"] = time.perf_counter() - start
    if dense:
        sys.path.insert(0, str(ROOT / "tests"))
        from dense_reading import node_influence, prune, square

        start = time.perf_counter()
        matrix = square(graph)
        influence = node_influence(matrix, graph.layout)
        times["influence"] = time.perf_counter() - start
        start = time.perf_counter()
        pruned = prune(matrix, graph.layout)
        times["prune"] = time.perf_counter() - start
        kept = (int(pruned.node_mask.sum()), int(pruned.edge_mask.sum()))
        json_mb = None
    else:
        start = time.perf_counter()
        influence = graph.influence()
        times["influence"] = time.perf_counter() - start
        start = time.perf_counter()
        pruned = graph.prune()
        times["prune"] = time.perf_counter() - start
        kept = (pruned.n_nodes, pruned.n_edges)
        out = Path(path).with_suffix(".json")
        start = time.perf_counter()
        graph.to_json(out)
        times["export"] = time.perf_counter() - start
        json_mb = out.stat().st_size / 2**20
        # every explored feature kept by the node threshold: the largest pruned graph
        start = time.perf_counter()
        payload = graph.to_json(out, node_threshold=1.0)
        times["export_all_nodes"] = time.perf_counter() - start
        everything = {"feature_nodes": sum(n["feature_type"] == "cross layer transcoder"
                                           for n in payload["nodes"]),
                      "links": len(payload["links"]), "json_mb": out.stat().st_size / 2**20}
        out.unlink()
    return {"features": graph.n_features, "rows": graph.rows.n_rows, "entries": graph.rows.nnz,
            "dense_matrix_mb": graph.layout.n_nodes**2 * 4 / 2**20,
            "seconds": times, "peak_rss_mb": rss_mb(), "start_rss_mb": base,
            "pruned_nodes": kept[0], "pruned_edges": kept[1], "json_mb": json_mb,
            "influence_sum": float(influence.sum()),
            "all_nodes_export": None if dense else everything}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", default="10000,20000,60000")
    parser.add_argument("--rows", type=int, default=7500)
    parser.add_argument("--dense-up-to", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--read", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        build(args.n, args.rows).save(args.build)
        return
    if args.read:
        print(json.dumps(read(args.read, args.dense)))
        return
    results, tmp = [], Path(tempfile.mkdtemp())
    for n in (int(x) for x in args.features.split(",")):
        path = tmp / f"graph-{n}.safetensors"
        subprocess.run([sys.executable, __file__, "--build", str(path), "--n", str(n),
                        "--rows", str(args.rows)], check=True)
        methods = [("sparse", [])] + ([("dense", ["--dense"])] if n <= args.dense_up_to else [])
        for name, extra in methods:
            done = subprocess.run([sys.executable, __file__, "--read", str(path), *extra],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{name} {n}: exit {done.returncode}")
            r = {"method": name, **json.loads(done.stdout.strip().splitlines()[-1])}
            results.append(r)
            s = r["seconds"]
            print(f"{n:>6} features {r['rows']:>5} rows {r['entries'] / 1e6:7.1f} M entries "
                  f"{name:<6}: load {s['load']:.1f} s, influence {s['influence']:.1f} s, "
                  f"prune {s['prune']:.1f} s" + (f", export {s['export']:.1f} s" if
                                                  "export" in s else "")
                  + (f"; node threshold 1.0: {r['all_nodes_export']['feature_nodes']} feature "
                     f"nodes, {r['all_nodes_export']['links']} links, JSON "
                     f"{r['all_nodes_export']['json_mb']:.1f} MB" if r["all_nodes_export"] else "")
                  + f"; peak RSS {r['peak_rss_mb']:,.0f} MB (from {r['start_rss_mb']:,.0f}; "
                  f"dense matrix alone "
                  f"{r['dense_matrix_mb']:,.0f} MB); pruned {r['pruned_nodes']} nodes "
                  f"{r['pruned_edges']} edges" + (f", JSON {r['json_mb']:.1f} MB"
                                                   if r["json_mb"] else ""), flush=True)
        path.unlink()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
