"""``pyvene-causaltrace``: the command line. Parses arguments, calls the library, writes files.

    pyvene-causaltrace trace                     # Eiffel Tower prompt on the bundled SmolLM2
    pyvene-causaltrace trace --kind residual,mlp,attn --seeds 10 --out out/
    pyvene-causaltrace run intervention_specs/residual_trace.json --out out/
    pyvene-causaltrace validate intervention_specs/*.json
    pyvene-causaltrace clt-check --clt DIR --data held_out.txt
    pyvene-causaltrace dataset --data known_1000.json --limit 200 --kinds residual,mlp,attn \
        --seeds 3 --out runs/known                   # resumable; under torchrun it shards
    pyvene-causaltrace dataset --task agreement --out runs/agreement
    pyvene-causaltrace aggregate runs/known          # re-aggregate (merges shards if needed)
    pyvene-causaltrace interventions
    pyvene-causaltrace run my_spec.json --plugins my_pkg.steer   # types registered by a module
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .defaults import DATASET_SEEDS, NOISE_SCALE, TRACE_SEEDS, WINDOW

EIFFEL = {
    "prompt": "The Eiffel Tower is in the city of",
    "subject": "The Eiffel Tower",
    "answer": " Paris",
}


_TRANSCODER_HELP = ("transcoder: an mntss CLT directory, a circuit-tracer config.yaml, a "
                    "GemmaScope / sae-lens / sparsify directory, or a hub id")
_FORMAT_HELP = ("the transcoder's layout: mntss, circuit_tracer, gemmascope, sae_lens or "
                "sparsify (default: detected)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyvene-causaltrace", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    # every command that reads specs or lists the types: import the user's plugin modules first
    plugins = argparse.ArgumentParser(add_help=False)
    plugins.add_argument("--plugins", default=None, metavar="MODULE[,MODULE]",
                         help="import these modules first: they register their intervention "
                              "types (also $PVCT_PLUGINS, same format; entry points in the "
                              "group 'pyvene_causaltrace.interventions' load by themselves)")

    trace = commands.add_parser(
        "trace", parents=[plugins],
        help="causal trace: noise the subject, restore every (layer, position) cell")
    trace.add_argument("--spec", type=Path, default=None,
                       help="a trace spec (intervention_specs/trace_*.json); other options "
                            "override nothing but --model/--out/--budget-mb/--controls")
    trace.add_argument("--model", default=None, help="default: smollm2-135m (bundled)")
    trace.add_argument("--prompt", default=EIFFEL["prompt"])
    trace.add_argument("--subject", default=EIFFEL["subject"])
    trace.add_argument("--answer", default=None,
                       help="target string (its first token); default ' Paris' for the default "
                            "prompt, else the clean argmax")
    trace.add_argument("--kind", default="residual",
                       help="residual|mlp|attn|severed-mlp|severed-attn, or several, "
                            "comma-separated (they share the clean and corrupted runs)")
    trace.add_argument("--seeds", type=int, default=TRACE_SEEDS)
    trace.add_argument("--scale", default="auto",
                       help="noise in units of sigma, or 'auto' (smallest scale whose worst "
                            "seed leaves P(answer) below 5%% of clean)")
    trace.add_argument("--sigma", default="rome", help="rome | embedding_matrix | a number")
    trace.add_argument("--window", type=int, default=WINDOW)
    trace.add_argument("--budget-mb", type=float, default=2048.0,
                       help="memory budget for one batch of rows")
    trace.add_argument("--controls", action="store_true",
                       help="also run the controls (corrupted-donor, window vs single layer)")
    trace.add_argument("--out", type=Path, default=None,
                       help="write trace_<kind>.json and trace_<kind>.png here")

    run = commands.add_parser("run", parents=[plugins],
                              help="run a JSON spec and print its probabilities")
    run.add_argument("spec", type=Path)
    run.add_argument("--model", default=None, help="overrides the spec's model")
    run.add_argument("--out", type=Path, default=None, help="write result.json here")

    validate = commands.add_parser(
        "validate", parents=[plugins],
        help="check JSON specs against the schema (and, with --model, against a model: layers, "
             "positions, modules, transcoder)")
    validate.add_argument("specs", type=Path, nargs="+")
    validate.add_argument("--model", default=None,
                          help="also resolve each spec on this model, without running it")

    check = commands.add_parser(
        "clt-check", help="pairing check and replacement-model anchor of a CLT on a model")
    check.add_argument("--model", default="smollm2-135m")
    check.add_argument("--clt", required=True, help=_TRANSCODER_HELP)
    check.add_argument("--format", default=None, help=_FORMAT_HELP)
    check.add_argument("--data", type=Path, required=True,
                       help="held-out text: a .txt file (one text per line) or known_1000-style "
                            "JSON (prompt + attribute)")
    check.add_argument("--limit", type=int, default=100, help="texts to use")
    check.add_argument("--prompt", default=EIFFEL["prompt"])
    check.add_argument("--answer", default=None)
    check.add_argument("--out", type=Path, default=None, help="write clt_check.json here")

    data = commands.add_parser(
        "dataset", help="average indirect effects over a fact dataset or a task (resumable)")
    source = data.add_mutually_exclusive_group(required=True)
    source.add_argument("--data",
                        help="known_1000 (ROME's facts, fetched once into the cache), or a "
                             "known_1000.json-style JSON / JSONL file of {prompt, subject, "
                             "attribute}")
    source.add_argument("--task", help="a built-in task: agreement | retrieval | arithmetic")
    data.add_argument("--model", default=None, help="default: smollm2-135m (bundled)")
    data.add_argument("--limit", type=int, default=None, help="facts to trace (after the screen)")
    data.add_argument("--kinds", default="residual,mlp,attn")
    data.add_argument("--seeds", type=int, default=DATASET_SEEDS)
    data.add_argument("--scale", type=float, default=NOISE_SCALE,
                      help="noise in units of sigma")
    data.add_argument("--sigma", default="rome", help="rome | embedding_matrix | a number")
    data.add_argument("--window", type=int, default=WINDOW)
    data.add_argument("--known", default=None, choices=("argmax", "none"),
                      help="argmax: trace only facts whose clean prediction is the target "
                           "(default; a built-in task may default to none)")
    data.add_argument("--budget-mb", type=float, default=2048.0)
    data.add_argument("--boot", type=int, default=1000, help="bootstrap resamples")
    data.add_argument("--out", type=Path, required=True,
                      help="run directory: rows stream here; rerun to resume")

    agg = commands.add_parser("aggregate", help="aggregate a dataset run directory")
    agg.add_argument("out", type=Path)
    agg.add_argument("--boot", type=int, default=1000)

    graph = commands.add_parser(
        "attribute", parents=[plugins],
        help="CLT attribution graph of the answer: edges, pruning, export, ablation")
    graph.add_argument("--spec", type=Path, default=None,
                       help="an attribution spec (intervention_specs/attribution_graph.json); "
                            "--model/--clt/--out/--memory-mb override it")
    graph.add_argument("--model", default=None, help="default: smollm2-135m (bundled)")
    graph.add_argument("--clt", default=None, help=_TRANSCODER_HELP)
    graph.add_argument("--format", default=None, help=_FORMAT_HELP)
    graph.add_argument("--labels", type=Path, default=None,
                       help="feature labels for graph.json's clerp: CSV/TSV/JSON with columns "
                            "layer, feature, label")
    graph.add_argument("--prompt", default=EIFFEL["prompt"])
    graph.add_argument("--answer", default=None,
                       help="a single-token answer; default ' Paris' for the default prompt, "
                            "else the clean argmax")
    graph.add_argument("--target", default="demeaned",
                       choices=("demeaned", "demeaned_vocab", "difference"))
    graph.add_argument("--other", default=None, help="the subtracted token of --target difference")
    graph.add_argument("--k", type=int, default=10, help="top-k logits the target is demeaned by")
    graph.add_argument("--memory-mb", type=float, default=None,
                       help="cap on the forward graph, batched gradient rows and stored rows "
                            "(default 4096)")
    graph.add_argument("--max-feature-nodes", type=int, default=None,
                       help="compute rows for at most this many features, the most "
                            "influential (default: every feature whose row fits --memory-mb)")
    graph.add_argument("--node-threshold", type=float, default=0.8)
    graph.add_argument("--edge-threshold", type=float, default=0.98)
    graph.add_argument("--max-links", type=int, default=400_000,
                       help="graph.json holds at most this many links, those of largest edge "
                            "score (default 400000, ~25 MB)")
    graph.add_argument("--validate", action="store_true",
                       help="ablate the top 5/10/20 features vs 10 random draws of as many")
    graph.add_argument("--out", type=Path, required=True,
                       help="writes graph.json (viewer format), graph.safetensors, "
                            "nodes.csv, edges.csv, graph.png, summary.json; rows computed so "
                            "far are kept in rows.partial/, so an interrupted run resumes")

    commands.add_parser("interventions", parents=[plugins],
                        help="list the registered intervention types")

    view = commands.add_parser(
        "serve", help="an interactive viewer of the attribution graphs under DIR, on localhost")
    view.add_argument("dir", type=Path, help="a directory holding graph.json files (any depth)")
    view.add_argument("--port", type=int, default=8765)
    view.add_argument("--no-open", action="store_true", help="do not open a browser")
    return parser


def _number_or_name(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _trace(args) -> int:
    from .models import OFFLINE_DEFAULT, load_model
    from .tracing.trace import Tracer

    _out_dir(args.out)
    if args.spec is not None:
        return _trace_spec(args.spec, args.model, args.out, args.budget_mb, args.controls)
    model, tokenizer = load_model(args.model or OFFLINE_DEFAULT)
    answer = args.answer
    if answer is None and args.prompt == EIFFEL["prompt"]:
        answer = EIFFEL["answer"]
    kinds = [k.strip() for k in args.kind.split(",")]
    from .tracing.engine import get_kind

    for kind in kinds:
        get_kind(kind)
    if args.window <= 0:
        raise ValueError(f"window must be positive, got {args.window}")
    tracer = Tracer(model, tokenizer, args.prompt, args.subject, answer=answer,
                    seeds=args.seeds, scale=_number_or_name(args.scale),
                    sigma=_number_or_name(args.sigma), memory_budget_mb=args.budget_mb)
    return _report_traces(tracer, kinds, args.window, args.out, args.controls)


def _trace_spec(path: Path, model_name: str | None, out: Path | None, budget_mb: float,
                controls: bool) -> int:
    from .models import OFFLINE_DEFAULT, load_model
    from .specs import load_spec
    from .tracing.trace import tracer_from_spec

    spec = load_spec(path)
    model, tokenizer = load_model(model_name or spec.model or OFFLINE_DEFAULT)
    tracer = tracer_from_spec(spec, model, tokenizer, memory_budget_mb=budget_mb)
    return _report_traces(tracer, [spec.trace["kind"]], spec.trace.get("window", WINDOW), out,
                          controls)


def _report_traces(tracer, kinds: list[str], window: int, out: Path | None,
                   controls: bool) -> int:
    """Run ``kinds`` on ``tracer``: progress bar, terminal table, JSON and PNG under ``out``."""
    from tqdm import tqdm

    if tracer.sweep is not None:
        print(tracer.sweep.summary() + "\n")
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        rows = len(tracer.seeds) * len(tracer.cells())
        with tqdm(total=rows, desc=f"{kind} trace", unit="row") as bar:
            result = tracer.trace(kind, window=window, progress=bar.update)
        print(result.summary())
        print(result.table(every=max(1, result.n_layers // 12)))
        print()
        if out:
            (out / f"trace_{kind}.json").write_text(result.to_json())
            result.plot(str(out / f"trace_{kind}.png"))
            print(f"wrote {out / f'trace_{kind}.json'} and .png\n")
    if controls:
        report = tracer.controls(window=window)
        print(report.summary())
        if not report.passed:
            return 1
    return 0


def _run(args) -> int:
    from .execute import run_spec
    from .models import OFFLINE_DEFAULT, load_model
    from .specs import load_spec

    _out_dir(args.out)
    spec = load_spec(args.spec)
    if spec.trace is not None:
        return _trace_spec(args.spec, args.model, args.out, budget_mb=2048.0, controls=False)
    if spec.attribution is not None:
        raise ValueError(f"{args.spec} is an attribution spec: run "
                         f"pyvene-causaltrace attribute --spec {args.spec} --out DIR")
    model, tokenizer = load_model(args.model or spec.model or OFFLINE_DEFAULT)
    result = run_spec(spec, model, tokenizer)
    print(result.summary())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(result.to_json())
        print(f"wrote {args.out / 'result.json'}")
    return 0


def _texts(path: Path, limit: int) -> list[str]:
    if limit <= 0:
        raise ValueError(f"--limit must be positive, got {limit}")
    if path.suffix == ".json":
        records = json.loads(path.read_text())
        texts = [f"{r['prompt']} {r['attribute']}" for r in records]
    else:
        texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{path} holds no text")
    return texts[:limit]


def _clt_check(args) -> int:
    from .models import load_model
    from .transcoders import load_transcoder
    from .transcoders.checks import check_pairing, replacement_anchor

    _out_dir(args.out)
    texts = _texts(args.data, args.limit)
    model, tokenizer = load_model(args.model)
    clt = load_transcoder(args.clt, format=args.format)
    pairing = check_pairing(clt, model, tokenizer, texts)
    print(pairing.verdict())
    print("FVU per layer: " + " ".join(f"{v:.3f}" for v in pairing.fvu_per_layer))
    answer = args.answer
    if answer is None and args.prompt == EIFFEL["prompt"]:
        answer = EIFFEL["answer"]
    anchor = replacement_anchor(clt, model, tokenizer, texts, prompt=args.prompt, answer=answer)
    print(anchor.summary())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "clt_check.json").write_text(json.dumps(
            {"pairing": pairing.to_dict(), "anchor": anchor.to_dict()}, indent=2))
        print(f"wrote {args.out / 'clt_check.json'}")
    return 0 if pairing.paired else 1


def _dataset(args) -> int:
    from .dataset import get_task, read_records
    from .dataset.run import trace_dataset_distributed
    from .models import OFFLINE_DEFAULT, load_model

    _out_dir(args.out)
    if args.task:
        task = get_task(args.task)
        records, errors, default_known = list(task.records), [], task.known
    else:
        (records, errors), default_known = read_records(args.data), "argmax"
        if not records:
            raise ValueError(f"no record could be read from {args.data}"
                             + (f": {errors[0]}" if errors else ""))
    known = args.known or default_known
    for error in errors[:10]:
        print(f"skipping malformed record {error}", file=sys.stderr)
    if len(errors) > 10:
        print(f"... and {len(errors) - 10} more malformed records", file=sys.stderr)
    model, tokenizer = load_model(args.model or OFFLINE_DEFAULT)
    result = trace_dataset_distributed(
        model, tokenizer, records, out=args.out, kinds=args.kinds.split(","), seeds=args.seeds,
        scale=args.scale, sigma=_number_or_name(args.sigma), window=args.window,
        known=known, limit=args.limit, memory_budget_mb=args.budget_mb, errors=errors,
        n_boot=args.boot)
    if result is not None:  # rank 0, or a single process
        _write_dataset_report(result, args.out)
    return 0


def _write_dataset_report(result, out: Path) -> None:
    (out / "aggregate.json").write_text(result.to_json())
    result.to_dataframe().to_csv(out / "aie.csv", index=False)
    result.peaks().to_csv(out / "peaks.csv", index=False)
    result.plot(out / "figure1.png")
    result.plot_curves(out / "curves.png")
    print(result.summary())
    print(f"wrote aggregate.json, aie.csv, peaks.csv, figure1.png, curves.png to {out}")


def _aggregate(args) -> int:
    from .dataset.run import load_dataset_result, merge_shards

    shards = sorted(args.out.glob("shard-*-of-*"))
    if shards and not (args.out / "results.jsonl").exists():
        result = merge_shards(args.out, int(shards[0].name.rsplit("-", 1)[1]), n_boot=args.boot)
    else:
        result = load_dataset_result(args.out, n_boot=args.boot)
    _write_dataset_report(result, args.out)
    return 0


def _validate(args) -> int:
    from .specs import SpecError, load_spec

    loaded = None
    if args.model is not None:
        from .execute import check_on_model
        from .models import load_model

        loaded = load_model(args.model)
    failed = 0
    for path in args.specs:
        try:
            spec = load_spec(path)
            if loaded is not None:
                check_on_model(spec, *loaded)
            print(f"ok      {path}" + (f" (on {args.model})" if loaded else ""))
        except (SpecError, OSError, ValueError) as error:
            failed += 1
            print(f"invalid {path}: {error}")
    return 1 if failed else 0


def _serve(args) -> int:
    from .viewer import make_server, serve

    server = make_server(args.dir, port=args.port)
    print(f"serving the graphs under {args.dir} at "
          f"http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    serve(args.dir, open_browser=not args.no_open, server=server)
    return 0


def _interventions(args) -> int:
    from .interventions import RESERVED, get_intervention, list_interventions

    for name in list_interventions():
        cls = get_intervention(name)
        print(f"{name:<18} {cls.__module__}.{cls.__qualname__}")
    for name, why in RESERVED.items():
        print(f"{name:<18} (reserved: {why})")
    return 0


def _attribution_settings(args) -> dict:
    """The attribution settings: the spec's (if any), then the command line's."""
    settings = {"model": None, "prompt": args.prompt, "answer": args.answer,
                "target": args.target, "other": args.other, "k": args.k, "memory_mb": 4096.0,
                "max_feature_nodes": None,
                "node_threshold": args.node_threshold, "edge_threshold": args.edge_threshold,
                "validate": {"sizes": [5, 10, 20], "draws": 10} if args.validate else None,
                "clt": None, "format": None, "labels": None}
    if args.spec is not None:
        from .specs import load_spec

        spec = load_spec(args.spec)
        if spec.attribution is None:
            raise ValueError(f"{args.spec} has no 'attribution' block")
        settings.update({"model": spec.model, "prompt": spec.prompt, "answer": spec.answer},
                        **spec.attribution)
    elif settings["answer"] is None and settings["prompt"] == EIFFEL["prompt"]:
        settings["answer"] = EIFFEL["answer"]
    for key in ("model", "clt", "format", "labels"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    for key in ("memory_mb", "max_feature_nodes"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["clt"] is None:
        raise ValueError("attribute needs a CLT: --clt DIR or a spec with attribution.clt")
    settings["clt"] = str(Path(settings["clt"]).expanduser())
    if settings["labels"] is not None:
        settings["labels"] = str(Path(settings["labels"]).expanduser())
    return settings


def _attribute(args) -> int:
    from .attribution import attribute
    from .attribution.export import read_labels
    from .attribution.validate import ablation_test
    from .models import OFFLINE_DEFAULT, load_model
    from .transcoders import load_transcoder

    _out_dir(args.out)
    s = _attribution_settings(args)
    for key in ("node_threshold", "edge_threshold"):
        if not 0 <= s[key] <= 1:  # also refuses NaN
            raise ValueError(f"--{key.replace('_', '-')} must be in [0, 1], got {s[key]}")
    if s["max_feature_nodes"] is not None and s["max_feature_nodes"] < 0:
        raise ValueError(f"max_feature_nodes must be >= 0, got {s['max_feature_nodes']}")
    model, tokenizer = load_model(s["model"] or OFFLINE_DEFAULT)
    clt = load_transcoder(s["clt"], format=s["format"])
    labels = read_labels(s["labels"]) if s["labels"] is not None else None
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    graph = attribute(model, tokenizer, clt, s["prompt"], s["answer"], target=s["target"],
                      other=s["other"], k=s["k"], memory_mb=s["memory_mb"],
                      max_feature_nodes=s["max_feature_nodes"], progress=True,
                      checkpoint=out / "rows.partial")  # an interrupted run resumes
    c = graph.closure
    print(f"{graph.prompt!r} -> {graph.answer!r} (p={graph.answer_prob:.4f}); "
          f"{graph.n_features} active features, {graph.n_explored} with rows, "
          f"{graph.metadata['batch_size']} rows/backward")
    print(f"closure: target {c.target:.6f}, edges + constants {c.edges + c.constant:.6f}, "
          f"residual {c.residual:+.2e} ({c.relative:.1e} relative); feature rows "
          f"{graph.feature_closure():.1e}")
    parts, scores = graph.decomposition(), graph.scores()
    print("decomposition: " + ", ".join(f"{k} {v:+.4f}" for k, v in parts.items()))
    print(f"replacement score {scores['replacement']:.3f}, completeness "
          f"{scores['completeness']:.3f}")
    print(graph.direct_attributions(10).to_string(index=False))
    pruned = graph.prune(s["node_threshold"], s["edge_threshold"])
    print(f"pruned: {pruned.n_nodes} nodes, {pruned.n_edges} edges")
    graph.to_json(out / "graph.json", slug=out.name, node_threshold=s["node_threshold"],
                  edge_threshold=s["edge_threshold"], max_links=args.max_links, labels=labels)
    graph.save(out / "graph.safetensors")
    graph.nodes().to_csv(out / "nodes.csv", index=False)
    graph.to_dataframe(pruned=True).to_csv(out / "edges.csv", index=False)
    graph.plot(out / "graph.png", node_threshold=s["node_threshold"],
               edge_threshold=s["edge_threshold"])
    summary = {"settings": s, "closure": c.to_dict(), "feature_closure": graph.feature_closure(),
               "decomposition": parts, "scores": scores, "metadata": graph.metadata,
               "pruned": {"nodes": pruned.n_nodes, "edges": pruned.n_edges}}
    if s["validate"]:
        result = ablation_test(model, clt, graph, sizes=tuple(s["validate"].get("sizes", (5,))),
                               draws=s["validate"].get("draws", 10),
                               rank_by=s["validate"].get("rank_by", "influence"))
        print(result.to_dataframe().to_string(index=False))
        summary["ablation"] = result.to_dict()
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"wrote {out}/graph.json, graph.safetensors, nodes.csv, edges.csv, graph.png, "
          "summary.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"trace": _trace, "run": _run, "validate": _validate, "clt-check": _clt_check,
               "dataset": _dataset, "aggregate": _aggregate, "attribute": _attribute,
               "interventions": _interventions, "serve": _serve}[args.command]
    try:
        if hasattr(args, "plugins"):  # the commands that read specs or list the types
            from .interventions.registry import load_plugins

            load_plugins(args.plugins)
        return handler(args)
    except _user_errors() as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        print(f"error: {message}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user's mistake raises (bad values, files, paths, a busy directory); anything
    else is a bug and keeps its traceback."""
    from .interventions.registry import PluginError, UnknownInterventionError
    from .runlock import OutputLockedError

    return (ValueError, OSError, NotImplementedError, MemoryError, OutputLockedError,
            UnknownInterventionError, PluginError)


def _out_dir(path: Path | None) -> Path | None:
    """``--out``, refused early when it names a file."""
    if path is not None and path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file; give a directory")
    return path


if __name__ == "__main__":
    sys.exit(main())
