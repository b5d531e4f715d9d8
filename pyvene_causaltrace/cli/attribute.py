"""``attribute`` and ``clt-check``: attribution graphs and the transcoder checks before them."""

from __future__ import annotations

import json
from pathlib import Path

from ..attribution import attribute
from ..attribution.export import read_labels
from ..attribution.validate import ablation_test
from ..errors import InputError
from ..models import OFFLINE_DEFAULT, load_model
from ..specs import load_spec
from ..transcoders import load_transcoder
from ..transcoders.checks import check_pairing, replacement_anchor
from .common import EIFFEL, out_dir


def attribution_settings(args) -> dict:
    """The attribution settings: the spec's (if any), then the command line's."""
    settings = {"model": None, "prompt": args.prompt, "answer": args.answer,
                "target": args.target, "other": args.other, "k": args.k, "memory_mb": 4096.0,
                "max_feature_nodes": None,
                "node_threshold": args.node_threshold, "edge_threshold": args.edge_threshold,
                "validate": {"sizes": [5, 10, 20], "draws": 10} if args.validate else None,
                "clt": None, "format": None, "labels": None}
    if args.spec is not None:

        spec = load_spec(args.spec)
        if spec.attribution is None:
            raise InputError(f"{args.spec} has no 'attribution' block")
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
        raise InputError("attribute needs a CLT: --clt DIR or a spec with attribution.clt")
    settings["clt"] = str(Path(settings["clt"]).expanduser())
    if settings["labels"] is not None:
        settings["labels"] = str(Path(settings["labels"]).expanduser())
    return settings


def attribute_command(args) -> int:
    out_dir(args.out)
    s = attribution_settings(args)
    for key in ("node_threshold", "edge_threshold"):
        if not 0 <= s[key] <= 1:  # also refuses NaN
            raise InputError(f"--{key.replace('_', '-')} must be in [0, 1], got {s[key]}")
    if s["max_feature_nodes"] is not None and s["max_feature_nodes"] < 0:
        raise InputError(f"max_feature_nodes must be >= 0, got {s['max_feature_nodes']}")
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


def read_texts(path: Path, limit: int) -> list[str]:
    if limit <= 0:
        raise InputError(f"--limit must be positive, got {limit}")
    if path.suffix == ".json":
        records = json.loads(path.read_text())
        texts = [f"{r['prompt']} {r['attribute']}" for r in records]
    else:
        texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise InputError(f"{path} holds no text")
    return texts[:limit]


def clt_check_command(args) -> int:
    out_dir(args.out)
    texts = read_texts(args.data, args.limit)
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
