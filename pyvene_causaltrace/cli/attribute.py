"""``attribute`` and ``clt-check``: attribution graphs and the transcoder checks before them."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import safetensors.torch
import torch

from .. import distributed
from ..atomic import replacing, write_text
from ..attribution import attribute
from ..attribution.attention import attention_annotations
from ..attribution.checkpoint import remove_checkpoint
from ..attribution.export import read_labels
from ..attribution.many import INDEX, attribute_many, read_prompts
from ..attribution.settings import AttributionSettings, ReadingSettings
from ..attribution.targets import direction_target
from ..attribution.validate import ablation_test
from ..crosscheck import CrossCheckSettings, cross_check
from ..errors import InputError
from ..models import OFFLINE_DEFAULT, load_model
from ..specs import load_spec
from ..strict_json import loads
from ..tracing.settings import TraceSettings
from ..tracing.tracer import Tracer
from ..transcoders import load_transcoder
from ..transcoders.checks import check_pairing, replacement_anchor
from .common import fact_default, number_or_name, out_dir, resolve_device, settings_of
from .evaluate import faithfulness_settings, run_faithfulness
from .lorsa import check_attention, load_attention, qk_tracing

#: The attribution settings a spec may hold that are also flags: given both ways, refused.
SPEC_KEYS = ("target", "other", "k", "node_threshold", "edge_threshold", "validate")
#: What --cross-check writes under ``--out``.
CROSS_CHECK_FILES = ("cross_check.json", "cross_check.png")
#: The checkpoint directory under ``--out``: rows computed so far, kept until every output is
#: written.
ROWS_PARTIAL = "rows.partial"

#: The ``attribute`` flags that are settings' fields, ``{argparse dest: field}``, one table per
#: settings class (attribution, reading, the cross-check and its tracer's);
#: tests/test_settings_once.py checks each against its field.
ATTRIBUTION_FLAGS = {name: name for name in (
    "target", "other", "k", "max_n_logits", "desired_logit_prob", "bos_errors", "bos",
    "memory_mb", "max_feature_nodes", "deterministic")} | {"dtype": "compute_dtype"}
READING_FLAGS = {"node_threshold": "node_threshold", "edge_threshold": "edge_threshold",
                 "max_links": "max_links"}
CROSS_CHECK_FLAGS = {"check_window": "window", "check_features": "top_n",
                     "check_modes": "modes"}
CROSS_CHECK_TRACE_FLAGS = {"seeds": "seeds", "scale": "scale"}
#: The flags whose ``None`` default leaves the setting to the spec, then to its field.
_UNSET_IS_DEFAULT = ("max_n_logits", "desired_logit_prob", "bos_errors", "bos", "memory_mb",
                     "max_feature_nodes", "dtype")
#: The ablation test ``--validate`` runs.
VALIDATE = {"sizes": [5, 10, 20], "draws": 10}


@dataclass(frozen=True)
class CrossCheckRequest:
    """``--cross-check``: the noised subject, the tracer's noise, the comparison's settings."""

    subject: str
    trace: TraceSettings
    settings: CrossCheckSettings


@dataclass(frozen=True)
class AttributeRequest:
    """What ``attribute`` runs, from the spec and the flags, checked before anything loads:
    the inputs and the settings objects."""

    model: str | None
    prompt: str | None
    answer: str | None
    transcoder: str
    format: str | None
    labels: str | None
    direction: dict | None
    validate: dict | None
    attribution: AttributionSettings
    reading: ReadingSettings
    cross_check: CrossCheckRequest | None = None

    def record(self) -> dict:
        """The request as ``summary.json``'s ``settings``: the inputs and every setting."""
        settings = {f.name: getattr(self.attribution, f.name) for f in fields(self.attribution)}
        if self.direction is not None:
            settings["target"] = "direction"
        return {"model": self.model, "prompt": self.prompt, "answer": self.answer,
                "transcoder": self.transcoder, "format": self.format, "labels": self.labels,
                "direction": self.direction, "validate": self.validate, **settings,
                **{f.name: getattr(self.reading, f.name) for f in fields(self.reading)}}


def attribute_request(args) -> AttributeRequest:
    """The request of ``attribute``'s flags and spec: the spec's settings, then the flags'
    (a setting both give is refused); every setting checked by its settings object, a refusal
    naming the flag; the direction read from its file."""
    given = getattr(args, "given", frozenset())
    block, model, prompt, answer = {}, None, args.prompt, args.answer
    if args.spec is not None:
        spec = load_spec(args.spec)
        if spec.attribution is None:
            raise InputError(f"{args.spec} has no 'attribution' block")
        for key in SPEC_KEYS:  # a flag the spec's setting would silently override
            if key in given and key in spec.attribution:
                raise InputError(f"--{key.replace('_', '-')} does not apply to `attribute "
                                 f"--spec {args.spec}`: the spec sets {key}; drop the flag or "
                                 "edit the spec")
        block, model, prompt, answer = dict(spec.attribution), spec.model, spec.prompt, \
            spec.answer
    elif args.prompts is not None:  # each line gives its prompt and answer
        prompt = answer = None
    elif args.direction is None and args.max_n_logits is None and args.desired_logit_prob is None:
        answer = fact_default("answer", prompt, answer)
    if prompt is not None and not prompt:
        raise InputError("the prompt is empty")
    direction = {"file": str(args.direction)} if args.direction is not None \
        else block.get("direction")
    values = {}
    for dest, name in {**ATTRIBUTION_FLAGS, **READING_FLAGS}.items():
        flag = getattr(args, dest)
        if dest in _UNSET_IS_DEFAULT:  # the flag wins over the spec when given
            value = flag if flag is not None else block.get(name)
        else:  # the spec's, where it has one (given both ways: refused above)
            value = block.get(name, flag)
        if value is not None:
            values[name] = value
    if "k" in given and direction is None and args.prompts is None \
            and values.get("target") != "demeaned":
        raise InputError(f"--k sets the top-k logits of --target demeaned; --target "
                         f"{values.get('target')} does not read it: drop it")
    if direction is not None:  # read now: a file that is not a direction is refused early
        if answer is not None:  # before the file: whatever it holds, the two exclude each other
            raise InputError("--direction explains a direction, --answer a logit: pass one of "
                             "them")
        values["target"] = read_direction(direction)
    attribution = settings_of(AttributionSettings, {
        k: v for k, v in values.items() if k not in READING_FLAGS}, ATTRIBUTION_FLAGS)
    if args.prompts is None:
        attribution.check_answer(answer)
    reading = settings_of(ReadingSettings, {k: v for k, v in values.items()
                                            if k in READING_FLAGS}, READING_FLAGS)
    transcoder = args.clt if args.clt is not None else block.get("clt")
    if transcoder is None:
        raise InputError("attribute needs a CLT: --clt DIR or a spec with attribution.clt")
    labels = args.labels if args.labels is not None else block.get("labels")
    validate = VALIDATE if args.validate else block.get("validate")
    request = AttributeRequest(
        model=args.model if args.model is not None else model, prompt=prompt, answer=answer,
        transcoder=str(Path(transcoder).expanduser()),
        format=args.format if args.format is not None else block.get("format"),
        labels=None if labels is None else str(Path(labels).expanduser()), direction=direction,
        validate=validate, attribution=attribution, reading=reading)
    return replace(request, cross_check=cross_check_request(args, request))


def cross_check_request(args, request: AttributeRequest) -> CrossCheckRequest | None:
    """The ``--cross-check`` settings, checked before anything loads (None without it)."""
    if not args.cross_check:
        return None
    subject = fact_default("subject", request.prompt, args.subject)
    if not subject:
        raise InputError("--cross-check needs --subject: the part of the prompt the trace "
                         "noises")
    if subject not in request.prompt:
        raise InputError(f"--subject {subject!r} is not in the prompt {request.prompt!r}")
    if request.direction is not None or request.answer is None:
        raise InputError("--cross-check compares one answer's graph with its trace: give "
                         "--answer (a single token), not --direction or several logits")
    trace = settings_of(TraceSettings, {"seeds": args.seeds, "scale": number_or_name(args.scale)},
                        CROSS_CHECK_TRACE_FLAGS)
    settings = settings_of(CrossCheckSettings, {
        "window": args.check_window, "top_n": args.check_features,
        "modes": [m for m in args.check_modes.split(",") if m]}, CROSS_CHECK_FLAGS)
    return CrossCheckRequest(subject, trace, settings)


def read_direction(entry: dict) -> object:
    """The direction target of an attribution setting ``{"file" | "vector", "output",
    "position", "name"}``: a JSON list of numbers or a safetensors file of one 1-D tensor."""
    if "vector" in entry:
        vector = torch.tensor([float(x) for x in entry["vector"]])
    else:
        path = Path(entry["file"]).expanduser()
        if path.suffix == ".safetensors":
            try:
                tensors = safetensors.torch.load_file(str(path))
            except (OSError, MemoryError):
                raise
            except Exception as error:  # safetensors raises its own SafetensorError
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise InputError(f"--direction {path} is not a readable safetensors file "
                                 f"({first})") from None
            if len(tensors) != 1:
                raise InputError(f"{path} holds {len(tensors)} tensors; a direction file holds "
                                 "one 1-D tensor")
            vector = next(iter(tensors.values()))
        else:
            try:
                values = loads(path.read_text(encoding="utf-8"))
            except ValueError as error:  # not UTF-8, not JSON, or a NaN/inf in it
                raise InputError(f"--direction {path} is not JSON of finite numbers: "
                                 f"{error}") from None
            if not isinstance(values, list) or not all(
                    isinstance(x, int | float) and not isinstance(x, bool) for x in values):
                raise InputError(f"{path}: a direction is a JSON list of numbers")
            vector = torch.tensor([float(x) for x in values])
    return direction_target(vector, output=entry.get("output", "unembed_input"),
                            position=entry.get("position", -1),
                            name=entry.get("name", "direction"))


def attribute_command(args) -> int:
    distributed.environment()  # first: a wrong WORLD_SIZE/RANK/... is named at once
    out_dir(args.out)
    device = resolve_device(args.device)
    request = attribute_request(args)
    if request.labels is not None:  # its form now, before anything loads
        read_labels(request.labels)
    ranks = distributed.init()  # under torchrun: join the group (a no-op otherwise)
    if ranks is None and "split" in getattr(args, "given", ()):
        raise InputError("--split spreads a graph over the ranks of a torchrun: one process "
                         "does not read it; drop it (or run under torchrun)")
    if args.prompts is not None:
        return _many_command(args, request, device)
    sharded = ranks is not None and args.split == "features"
    faith = faithfulness_settings(args) if args.faithfulness else None
    if sharded and (request.validate or request.cross_check is not None or args.heads
                    or faith is not None or getattr(args, "qk_tracing", False)):
        raise InputError("--validate, --cross-check, --heads, --faithfulness and --qk-tracing "
                         "run the whole transcoder and Lorsa: with more than one rank pass "
                         "--split rows (both whole on every rank)")
    transcoder = load_transcoder(request.transcoder, format=request.format, device=device,
                                 **({"shard": (ranks.rank, ranks.world)} if sharded else {}))
    labels = None if request.labels is None else read_labels(
        request.labels, n_layers=transcoder.n_layers, n_features=transcoder.cfg.d_transcoder)
    lorsa = load_attention(args, device, (ranks.rank, ranks.world) if sharded else None)
    model, tokenizer = load_model(request.model or OFFLINE_DEFAULT, device=device)
    check_attention(model, lorsa)  # another model's Lorsa: refused before the graph
    tracer = None
    checking = request.cross_check
    if checking is not None:  # before the graph: a subject the tokens split is refused now
        tracer = Tracer(model, tokenizer, request.prompt, checking.subject,
                        answer=request.answer, settings=checking.trace)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / ROWS_PARTIAL  # an interrupted run resumes; removed once all is written
    graph = attribute(model, tokenizer, transcoder, request.prompt, request.answer,
                      settings=request.attribution, progress=True, checkpoint=checkpoint,
                      attention=lorsa)
    if ranks is not None and not ranks.first:  # rank 0 writes every file
        distributed.finish()
        return 0
    with distributed.alone() if ranks is not None else contextlib.nullcontext():
        if faith is not None:  # before graph.json, whose metadata carries the scores
            curve = run_faithfulness(args, faith, model, tokenizer, transcoder, graph, out)
            graph.metadata["faithfulness"] = curve.summary()
        _write_outputs(args, request, graph, model, transcoder, tracer, labels, checkpoint,
                       lorsa)
    if ranks is not None:
        distributed.finish()
    return 0


def _many_command(args, request: AttributeRequest, device: str) -> int:
    """``attribute --prompts FILE``: one graph per prompt, spread over the ranks."""
    prompts = read_prompts(args.prompts)  # checked before anything loads (--cross-check,
    settings = request.attribution  # --validate and the like: refused by .flags)
    for i, prompt in enumerate(prompts, 1):
        try:
            chosen = settings if prompt["target"] is None else replace(settings,
                                                                       target=prompt["target"])
            chosen.check_answer(prompt["answer"])
        except InputError as error:
            raise InputError(f"{args.prompts}, prompt {i}: {error}") from None
    if "k" in getattr(args, "given", ()) and \
            all((p["target"] or settings.target) != "demeaned" for p in prompts):
        raise InputError("--k sets the top-k logits of a demeaned target; no prompt of "
                         f"{args.prompts} has one: drop it")
    transcoder = load_transcoder(request.transcoder, format=request.format, device=device)
    model, tokenizer = load_model(request.model or OFFLINE_DEFAULT, device=device)
    index = attribute_many(model, tokenizer, transcoder, prompts, args.out, settings=settings,
                           progress=True)
    if index is not None:
        print(f"wrote {len(index)} graphs and {args.out / INDEX}")
    distributed.finish()
    return 0


def _write_outputs(args, request: AttributeRequest, graph, model, transcoder, tracer, labels,
                   checkpoint: Path, lorsa=None) -> None:
    """Print the graph's reading and write every output file (rank 0 of a distributed run)."""
    out, reading = args.out, request.reading
    if graph.metadata["rows_resumed"]:
        print(f"resumed {graph.metadata['rows_resumed']} rows from {checkpoint}, computed "
              f"{graph.metadata['rows_computed']}")
    c = graph.closure
    print(f"{graph.prompt!r} -> {graph.answer!r} (p={graph.answer_prob:.4f}); "
          f"{graph.n_features} active features, {graph.n_explored} with rows, "
          f"{graph.metadata['batch_size']} rows/backward")
    print(graph.metadata["bos"]["rule"])
    print(f"closure: target {c.target:.6f}, edges + constants {c.edges + c.constant:.6f}, "
          f"residual {c.residual:+.2e} ({c.relative:.1e} relative); feature rows "
          f"{graph.feature_closure():.1e}")
    parts, scores = graph.decomposition(), graph.scores()
    print("decomposition: " + ", ".join(f"{k} {v:+.4f}" for k, v in parts.items()))
    print(f"replacement score {scores['replacement']:.3f}, completeness "
          f"{scores['completeness']:.3f}")
    print(graph.direct_attributions(10).to_string(index=False))
    pruned = graph.prune(settings=reading)
    print(f"pruned: {pruned.n_nodes} nodes, {pruned.n_edges} edges")
    attention = None
    if args.heads:
        attention = attention_annotations(model, transcoder, graph, settings=reading,
                                          memory_mb=request.attribution.memory_mb,
                                          progress=True)
        print(f"heads: {len(attention.links)} edges across positions split by head, "
              f"{len(attention.qk)} heads' QK terms")
    traced = qk_tracing(args, model, transcoder, lorsa, graph, pruned)  # into graph.metadata
    # each file is written whole or not at all (atomic.replacing); a cross-check of an earlier
    # run is removed, not left beside this graph
    if tracer is None:
        for name in CROSS_CHECK_FILES:
            (out / name).unlink(missing_ok=True)
    graph.to_json(out / "graph.json", slug=out.name, settings=reading, labels=labels,
                  attention=attention)
    graph.save(out / "graph.safetensors")
    with replacing(out / "nodes.csv") as tmp:
        graph.nodes().to_csv(tmp, index=False)
    with replacing(out / "edges.csv") as tmp:
        graph.to_dataframe(pruned=True).to_csv(tmp, index=False)
    with replacing(out / "graph.png") as tmp:
        graph.plot(tmp, settings=reading)
    summary = {"settings": request.record(), "closure": c.to_dict(),
               "feature_closure": graph.feature_closure(),
               "decomposition": parts, "scores": scores, "metadata": graph.metadata,
               "pruned": {"nodes": pruned.n_nodes, "edges": pruned.n_edges},
               "distributed": graph.metadata.get("distributed"),
               "heads": None if attention is None else {
                   "edges": len(attention.links), "qk": len(attention.qk)},
               "qk_tracing": len(traced) if args.qk_tracing else None}
    if request.validate:
        validate = request.validate
        result = ablation_test(model, transcoder, graph, sizes=tuple(validate.get("sizes", (5,))),
                               draws=validate.get("draws", 10),
                               rank_by=validate.get("rank_by", "influence"))
        print(result.to_dataframe().to_string(index=False))
        summary["ablation"] = result.to_dict()
    if tracer is not None:
        check = cross_check(graph, tracer, transcoder, settings=request.cross_check.settings)
        print(check.summary())
        check.to_json(out / "cross_check.json")
        with replacing(out / "cross_check.png") as tmp:
            check.plot(tmp)
        summary["cross_check"] = {"sites": {k: {p: {"spearman": v["spearman"],
                                                    "top_k_overlap": v["top_k_overlap"]}
                                                for p, v in parts.items()}
                                            for k, parts in check.sites.items()},
                                  "features": check.feature_stats}
    write_text(json.dumps(summary, indent=2, default=str), out / "summary.json")
    remove_checkpoint(checkpoint)
    print(f"wrote {out}/graph.json, graph.safetensors, nodes.csv, edges.csv, graph.png, "
          "summary.json" + (", cross_check.json, cross_check.png" if tracer else ""))


def read_texts(path: Path, limit: int) -> list[str]:
    """Held-out texts: one per line of a text file, or ``"prompt attribute"`` per record of a
    known_1000-style JSON list; a malformed file or record is refused naming it."""
    if limit <= 0:
        raise InputError(f"--limit must be positive, got {limit}")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text: {error}") from None
    if path.suffix == ".json":
        try:
            records = json.loads(content)
        except json.JSONDecodeError as error:
            raise InputError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(records, list):
            raise InputError(f"{path}: a JSON list of records with 'prompt' and 'attribute' "
                             f"is expected, found a {type(records).__name__}")
        texts = []
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise InputError(f"{path}: record {i} (counting from 0) is a "
                                 f"{type(record).__name__}, not an object with 'prompt' and "
                                 "'attribute'")
            for key in ("prompt", "attribute"):
                if not isinstance(record.get(key), str):
                    raise InputError(f"{path}: record {i} (counting from 0) has no "
                                     f"{key!r} string")
            texts.append(f"{record['prompt']} {record['attribute']}")
    else:
        texts = [line.strip() for line in content.splitlines() if line.strip()]
    if not texts:
        raise InputError(f"{path} holds no text")
    return texts[:limit]


def clt_check_command(args) -> int:
    out_dir(args.out)
    device = resolve_device(args.device)
    if not args.prompt:
        raise InputError("--prompt is empty")
    texts = read_texts(args.data, args.limit)
    transcoder = load_transcoder(args.clt, format=args.format, device=device)
    model, tokenizer = load_model(args.model, device=device)
    pairing = check_pairing(model, tokenizer, transcoder, texts, bos=args.bos)
    print(pairing.verdict())
    print("FVU per layer: " + " ".join(f"{v:.3f}" for v in pairing.fvu_per_layer))
    anchor = replacement_anchor(model, tokenizer, transcoder, texts, prompt=args.prompt,
                                answer=fact_default("answer", args.prompt, args.answer),
                                bos=args.bos)
    print(anchor.summary())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(json.dumps({"pairing": pairing.to_dict(), "anchor": anchor.to_dict()},
                              indent=2), args.out / "clt_check.json")
        print(f"wrote {args.out / 'clt_check.json'}")
    return 0 if pairing.paired else 1
