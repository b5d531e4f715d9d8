"""Causal traces over a dataset of facts (or task prompts), streamed to disk and resumable.

    records, errors = read_records("known_1000.json")
    result = trace_dataset(model, tokenizer, records, out="runs/known", limit=200,
                           kinds=("residual", "mlp", "attn"), seeds=3)
    result.to_dataframe(); result.plot("figure1.png")

Steps (docs/datasets.md): *screen* records in order until ``limit`` facts are kept; compute
ROME's sigma once over the kept subjects; trace every kept fact for every kind with one
:class:`~pyvene_causaltrace.tracing.Tracer` (its clean and corrupted runs shared by the kinds);
write each (fact, kind, seed) row as soon as its kind is done. A rerun into the same directory
traces a fact with anything left to do again with all its seeds (the same batches, so the same
rounding) and writes only the missing rows: a resumed run's rows equal an uninterrupted run's
bit for bit. With a ``transcoder`` each kept fact also gets its attribution graph
(:mod:`.graphs`, aggregated by :mod:`.graph_aggregate`; files: :mod:`.store`).

``shard=(rank, world)`` traces every ``world``-th kept fact into ``out/shard-RR-of-WW`` (each
shard screens every record itself); :func:`merge_shards` joins them, and the aggregate equals a
single-process run's exactly. :func:`trace_dataset_distributed` does both under ``torchrun``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from ..arguments import PositiveInt, checked
from ..attribution.settings import FaithfulnessSettings
from ..bound import BoundModel, bind
from ..errors import DamagedFileError, InputError, ManifestMismatchError, UndefinedCurveError
from ..fingerprint import package_version, tokenizer_fingerprint
from ..interventions.noise import seed_list
from ..prompts import SubjectNotFoundError, answer_token_id, tokenize_prompt
from ..runlock import single_writer
from ..tracing.chunks import check_seeds_fit
from ..tracing.faithfulness import FAITHFUL_KINDS, trace_faithfulness
from ..tracing.noise_scale import resolve_sigma, subject_sigma
from ..tracing.settings import TraceFaithfulnessSettings, TraceSettings
from ..tracing.tracer import Tracer
from ..transcoders import Transcoder
from .aggregate import ROLE_ORDER, aggregate_rows, check_boot_fits
from .faithfulness import faithfulness_row
from .graph_aggregate import TraceGrids, aggregate_graphs
from .graphs import (
    GRAPH_DIR,
    GraphSettings,
    check_faithfulness,
    counterfactuals,
    graph_manifest,
    graph_row,
)
from .records import FactRecord, RecordError
from .results import DatasetResult
from .settings import KNOWN_RULES, DatasetSettings
from .store import (
    FAITHFULNESS,
    GRAPHS,
    MANIFEST,
    RESULTS,
    SCREEN,
    RunDirectory,
    read_jsonl,
    read_manifest,
)

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

_DEFAULT = DatasetSettings()

__all__ = ["KNOWN_RULES", "trace_dataset", "trace_dataset_distributed", "merge_shards",
           "load_dataset_result", "run_path", "screen_record", "shard_dir", "target_split"]


def shard_dir(out: Path, rank: int, world: int) -> Path:
    return Path(out) / f"shard-{rank:02d}-of-{world:02d}"


def _records_digest(records: Sequence[FactRecord]) -> str:
    text = json.dumps([r.to_dict() for r in records], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def target_split(tokenizer: Tokenizer, prompt: str, target: str) -> tuple[str, int, int]:
    """``(prompt, target token id, target length in tokens)``. A leading whitespace-only token
    of the target moves into the prompt (SmolLM2 writes " 9" as " ", "9")."""
    ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InputError(f"target {target!r} tokenizes to nothing")
    first = tokenizer.decode([ids[0]])
    if len(ids) > 1 and first and not first.strip():
        return prompt + first, int(ids[1]), len(ids) - 1
    return prompt, int(ids[0]), len(ids)


@torch.no_grad()
def screen_record(bound: BoundModel, tokenizer: Tokenizer, record: FactRecord,
                  index: int, known: str) -> dict:
    """One line of ``screen.jsonl``: is ``record`` traced, and if not, why."""
    line = {"fact": record.id, "index": index, "kept": False}
    try:
        prompt, target_id, n_target = target_split(tokenizer, record.prompt, record.target)
        tokenized = tokenize_prompt(tokenizer, prompt, record.subject, record.occurrence)
        bound.check_inputs(tokenized.input_ids, target_id)
    except (SubjectNotFoundError, ValueError) as error:
        return {**line, "reason": f"malformed: {error}"}
    if answer_token_id(tokenizer, tokenizer.decode([target_id])) != target_id:
        return {**line, "reason": "malformed: the target's first token does not survive "
                                  "decoding and re-encoding"}
    start, stop = tokenized.subject_range
    if stop >= tokenized.seq_len:
        return {**line, "reason": "malformed: the subject ends at the last token; nothing "
                                  "follows it to read the answer from"}
    ids = tokenized.input_ids.to(bound.device)
    probs = bound.model(input_ids=ids, logits_to_keep=1).logits[0, -1].double().softmax(-1)
    predicted = int(probs.argmax())
    line.update(prompt=prompt, target_id=target_id, target=tokenizer.decode([target_id]),
                target_tokens=n_target, clean_prob=float(probs[target_id]),
                predicted=tokenizer.decode([predicted]))
    if known == "argmax" and predicted != target_id:
        return {**line, "reason": f"not known: predicts {line['predicted']!r}, target "
                                  f"{line['target']!r} has p={line['clean_prob']:.3f}"}
    return {**line, "kept": True, "reason": None}


def _screen(model, tokenizer: Tokenizer, records, known, limit, run: RunDirectory,
            errors: Sequence[RecordError]) -> list[dict]:
    """Kept screen lines, in record order, reusing lines screened before."""
    screened = {line["fact"]: line for line in run.rows(SCREEN)}
    if not screened and errors:
        run.append(SCREEN, [{"fact": e.id, "index": None, "kept": False,
                             "reason": f"malformed: {e}", "where": e.where} for e in errors])
    kept = []
    for index, record in enumerate(records):
        if limit is not None and len(kept) >= limit:
            break
        line = screened.get(record.id)
        if line is None:
            line = screen_record(model, tokenizer, record, index, known)
            run.append(SCREEN, [line])
        if line["kept"]:
            kept.append(line)
    return kept


@checked
def trace_dataset(
    model: nn.Module | BoundModel,
    tokenizer: Tokenizer,
    records: Sequence[FactRecord],
    *,
    out: str | Path | None = None,
    kinds: Sequence[str] = _DEFAULT.kinds,
    seeds: int | Sequence[int] = _DEFAULT.seeds,
    scale: float = _DEFAULT.scale,
    sigma: str | float = _DEFAULT.sigma,
    window: int = _DEFAULT.window,
    known: str = _DEFAULT.known,
    limit: int | None = _DEFAULT.limit,
    memory_budget_mb: float = _DEFAULT.memory_budget_mb,
    shard: tuple[int, int] | None = None,
    errors: Sequence[RecordError] = (),
    progress: bool = True,
    n_boot: int = _DEFAULT.n_boot,
    transcoder: Transcoder | None = None,
    graph_options: GraphSettings | None = None,
    faithfulness: TraceFaithfulnessSettings | None = None,
    graph_faithfulness: FaithfulnessSettings | None = None,
    settings: DatasetSettings | None = None,
) -> DatasetResult:
    """Trace ``records`` (see module docstring); returns the aggregate of what ``out`` holds
    (of this shard only when ``shard`` is given). A second run on the same ``out`` while this
    one writes is refused (:class:`~pyvene_causaltrace.runlock.OutputLockedError`).

    ``settings``: a :class:`~.settings.DatasetSettings`, or its fields as keywords (``kinds``
    to ``n_boot``; a keyword that contradicts ``settings`` is refused).

    ``transcoder``: also build each kept fact's attribution graph with ``graph_options``
    (default :class:`~.graphs.GraphSettings`); a transcoder that does not fit ``model`` is
    refused (:class:`~pyvene_causaltrace.errors.TranscoderMismatchError`) before anything is
    written. ``graph_faithfulness``: also measure each graph's faithfulness curve with these
    settings (:mod:`.graphs`: the counterfactual is another kept fact of the same length, or
    the ablation needs none); refused when the metric needs a foil the ablation does not give,
    or when no fact of this run has a counterfactual.

    ``faithfulness``: also each traced kind's faithfulness curves (residual, mlp, attn;
    :mod:`..tracing.faithfulness`), one row per (fact, kind) in ``faithfulness.jsonl``
    (:func:`.faithfulness.load_faithfulness` averages them); one process only."""
    run_settings = DatasetSettings.merged(
        settings, kinds=kinds, seeds=seeds, scale=scale, sigma=sigma, window=window, known=known,
        limit=limit, memory_budget_mb=memory_budget_mb, n_boot=n_boot)
    kinds, seeds, scale, sigma = (list(run_settings.kinds), run_settings.seeds,
                                  run_settings.scale, run_settings.sigma)
    window, known, limit = run_settings.window, run_settings.known, run_settings.limit
    rank, world = shard or (0, 1)
    if not 0 <= rank < world:
        raise InputError(f"shard rank {rank} outside world size {world}")
    if graph_options is not None and transcoder is None:
        raise InputError("graph_options without a transcoder: pass transcoder= (--clt) to "
                         "build graphs")
    if graph_faithfulness is not None:
        if transcoder is None:
            raise InputError("graph_faithfulness: a graph's curve needs the graph: pass "
                             "transcoder= (--graphs --clt)")
        check_faithfulness(graph_faithfulness)
    if faithfulness is not None and world > 1:
        raise InputError("faithfulness: a sharded run does not merge faithfulness rows yet; "
                         "run it in one process")
    settings = (graph_options or GraphSettings()) if transcoder is not None else None
    model = bind(model)  # the architecture, resolved once for every fact
    graphs = graph_manifest(model, transcoder, settings, graph_faithfulness) \
        if settings is not None else {}
    _check_sizes(model, tokenizer, records, run_settings)
    seeds = seed_list(seeds)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="pvct-dataset-"))
    manifest = {
        "model": model.fingerprint, "tokenizer": tokenizer_fingerprint(tokenizer),
        "version": package_version(),
        "records": _records_digest(records), "n_records": len(records), "kinds": kinds,
        "seeds": seeds, "scale": float(scale), "sigma": sigma, "window": window,
        "known": known, "limit": limit, "shard": [rank, world],
        "about": {"model_name": model.name}, **graphs,
    }
    if faithfulness is not None:  # a run without it keeps its manifest as before
        manifest["faithfulness"] = {**asdict(faithfulness), "sizes": list(faithfulness.sizes),
                                    "top": list(faithfulness.top)}
    if transcoder is not None:
        manifest["about"]["transcoder"] = transcoder.source or transcoder.cfg.model_name
    with RunDirectory(run_path(out, shard), manifest) as run:
        kept = _screen(model, tokenizer, records, known, limit, run, errors)
        if not kept:
            raise InputError(f"no record passed the screen (see {run.path / SCREEN})")
        by_id = {r.id: r for r in records}
        if sigma == "rome":  # ROME: one sigma over the dataset's subjects
            sigma_value = subject_sigma(model, tokenizer,
                                        [by_id[k["fact"]].subject for k in kept])
        else:
            sigma_value = resolve_sigma(sigma, model, tokenizer, None)[1]

        mine = kept[rank::world]
        done = run.done()
        faithful = run.faithfulness_done() if faithfulness is not None else None
        graphed = run.graphs_done() if settings is not None else None
        todo = [(line, [k for k in kinds if any((line["fact"], k, s) not in done for s in seeds)
                        or (faithful is not None and k in FAITHFUL_KINDS
                            and (line["fact"], k) not in faithful)],
                 graphed is not None and line["fact"] not in graphed)
                for line in mine]
        partners = {} if graph_faithfulness is None \
            else counterfactuals(tokenizer, kept, graph_faithfulness)
        if partners and all(isinstance(partners[line["fact"]], str) for line in mine):
            raise InputError(f"graph_faithfulness: ablation 'counterfactual' patches from "
                             f"another kept fact of the same length in tokens with another "
                             f"answer; none of the {len(mine)} facts has one (e.g. "
                             f"{partners[mine[0]['fact']]}): use ablation 'mean' or 'zero' "
                             "(with metric 'prob' or 'kl'), or more facts")
        # a fact's traces (with their curves), its graph, and its graph's curve
        per_graph = (settings is not None) + (graph_faithfulness is not None)
        steps = len(kinds) + per_graph
        bar = tqdm(total=len(mine) * steps,
                   initial=sum(steps - len(t) - per_graph * g for _, t, g in todo),
                   desc="dataset trace" + (" + graphs" if settings else "")
                   + (" + faithfulness" if faithfulness is not None
                      or graph_faithfulness is not None else ""), unit="step",
                   disable=not progress)
        with bar:  # closed (its line ended) on an error or Ctrl-C too
            for line, todo_kinds, needs_graph in todo:
                record = by_id[line["fact"]]
                if todo_kinds:
                    _trace_fact(model, tokenizer, run, line, record, todo_kinds, seeds, done,
                                bar, run_settings.trace(sigma=sigma_value), faithfulness)
                if needs_graph:
                    save_dir = run.path / GRAPH_DIR if settings.save else None
                    run.append(GRAPHS, [graph_row(
                        model, tokenizer, transcoder, line, record, settings, save_dir,
                        faithfulness=graph_faithfulness, counterfactual=partners.get(line["fact"]),
                        built=lambda: bar.update(1))])
                    bar.update(1)
    return load_dataset_result(run.path, n_boot=run_settings.n_boot)


def _trace_fact(model: BoundModel, tokenizer: Tokenizer, run: RunDirectory, line: dict,
                record: FactRecord, todo_kinds: list[str], seeds, done, bar,
                settings: TraceSettings,
                faithfulness: TraceFaithfulnessSettings | None = None) -> None:
    """Trace a fact's kinds still to do and append their missing rows (``settings``: the
    run's, with the sigma it resolved); with ``faithfulness``, each kind's curves' row."""
    # every seed, as an uninterrupted run: a corrupted run and restore chunks of the
    # same rows round the same way; rows already written are not written again
    tracer = Tracer(model, tokenizer, line["prompt"], record.subject, answer=line["target"],
                    occurrence=record.occurrence, settings=replace(settings, seeds=seeds))
    scale, sigma_value = settings.scale, settings.sigma
    for kind in todo_kinds:
        result = tracer.trace(kind, progress=False)  # the run's bar counts
        run.append(RESULTS, [{
            "index": line["index"], "fact": record.id, "kind": kind, "seed": seed,
            "tokens": result.tokens, "subject_range": list(result.subject_range),
            "answer": result.answer, "clean": result.clean_prob,
            "corrupt": float(result.corrupt_probs[i]), "scale": float(scale),
            "sigma": sigma_value, "restored": result.restored_probs[i].tolist(),
        } for i, seed in enumerate(seeds) if (record.id, kind, seed) not in done])
        if faithfulness is not None and kind in FAITHFUL_KINDS:
            try:
                curve = trace_faithfulness(tracer, result, settings=faithfulness)
                row = faithfulness_row(line["index"], record.id, curve)
            except UndefinedCurveError as error:  # this fact's, not the run's: the others go on
                row = {"index": line["index"], "fact": record.id, "kind": kind,
                       "skipped": str(error)}
            run.append(FAITHFULNESS, [row])
        bar.update(1)


def _check_sizes(model: BoundModel, tokenizer: Tokenizer, records: Sequence[FactRecord],
                 settings: DatasetSettings) -> None:
    """Refuse, before screening or allocating, a seed count whose corrupted runs cannot fit the
    budget even on the shortest prompt, or a bootstrap that cannot fit even over one fact."""
    if records:
        shortest = min(len(ids) for ids in tokenizer(
            [r.prompt for r in records], add_special_tokens=False)["input_ids"])
        check_seeds_fit(settings.n_seeds, max(2, shortest), model, settings.memory_budget_mb)
    check_boot_fits(settings.n_boot, 1, len(ROLE_ORDER) * model.n_layers)


def run_path(out: str | Path, shard: tuple[int, int] | None = None) -> Path:
    """The directory a run (or one shard of it) writes."""
    return shard_dir(Path(out), *shard) if shard else Path(out)


@checked
def load_dataset_result(path: str | Path, *,
                        n_boot: PositiveInt = _DEFAULT.n_boot) -> DatasetResult:
    """The aggregate of a run directory (a finished, interrupted or merged one), with the
    graphs' part when the run has graphs. A missing or damaged manifest, or a damaged row, is
    refused naming the file (and line)."""
    path = Path(path)
    manifest = read_manifest(path)
    screen = list(read_jsonl(path / SCREEN))
    graph_rows = list(read_jsonl(path / GRAPHS)) if manifest.get("graphs") is not None else []
    traces = TraceGrids((int(row["index"]) for row in graph_rows), manifest.get("seeds", ()))
    rows = traces.watch(read_jsonl(path / RESULTS))
    try:
        result = aggregate_rows(rows, kinds=manifest["kinds"], manifest=manifest, screen=screen,
                                n_boot=n_boot)
    except DamagedFileError:
        raise
    except InputError as error:  # no rows, rows that do not fit together: say which file
        raise InputError(f"{path / RESULTS}: {error}") from None
    try:
        graphs = aggregate_graphs(graph_rows, n_layers=result.n_layers, kinds=result.kinds,
                                  traces=traces,
                                  window=int(manifest.get("window", _DEFAULT.window)),
                                  n_boot=n_boot, level=result.level)
    except InputError as error:
        raise InputError(f"{path / GRAPHS}: {error}") from None
    return replace(result, graphs=graphs) if graphs is not None else result


@checked
def merge_shards(out: str | Path, world: int, *,
                 n_boot: PositiveInt = _DEFAULT.n_boot) -> DatasetResult:
    """Join ``out/shard-*-of-WW`` into ``out`` (rows and graph rows streamed, not held; saved
    graphs copied) and aggregate. The merged files replace the old ones only once all are
    written (the rows last)."""
    out = Path(out)
    shards = [shard_dir(out, rank, world) for rank in range(world)]
    manifests = []
    for path in shards:
        if not (path / MANIFEST).exists():
            raise FileNotFoundError(f"shard {path} is missing: did every rank finish?")
        manifests.append(read_manifest(path))
    base = {k: v for k, v in manifests[0].items() if k != "shard"}
    for path, manifest in zip(shards, manifests, strict=True):
        if {k: v for k, v in manifest.items() if k != "shard"} != base:
            raise ManifestMismatchError(f"shard {path} ran with other settings than {shards[0]}")
    screen = _check_complete(shards, base)
    with single_writer(out):
        rows = (GRAPHS, RESULTS) if base.get("graphs") is not None else (RESULTS,)
        names = (MANIFEST, SCREEN, *rows)
        tmp = {name: out / (name + ".tmp") for name in names}
        try:
            for name in rows:
                with open(tmp[name], "w") as handle:
                    for path in shards:
                        for row in read_jsonl(path / name):
                            handle.write(json.dumps(row, separators=(",", ":")) + "\n")
            for path in shards:  # the graphs the shards saved
                for graph in sorted((path / GRAPH_DIR).glob("*.safetensors")):
                    (out / GRAPH_DIR).mkdir(exist_ok=True)
                    shutil.copy2(graph, out / GRAPH_DIR / graph.name)
            tmp[SCREEN].write_text(screen.read_text())
            tmp[MANIFEST].write_text(json.dumps({**base, "shard": [0, 1], "merged": world},
                                                indent=2, sort_keys=True))
            for name in names:
                os.replace(tmp[name], out / name)
        finally:
            for path in tmp.values():
                path.unlink(missing_ok=True)
    return load_dataset_result(out, n_boot=n_boot)


def _check_complete(shards: list[Path], manifest: dict) -> Path:
    """Refuse to merge shards missing rows of their kept facts (a rank that stopped early:
    its rows merged alone gave an aggregate over fewer facts, without an error); the screen
    file that saw the most records (every shard screens them all), which the merge keeps."""
    screen = max((path / SCREEN for path in shards), key=lambda p: len(list(read_jsonl(p))))
    kept = [line["fact"] for line in read_jsonl(screen) if line["kept"]]
    for rank, path in enumerate(shards):
        done = {(row["fact"], row["kind"], row["seed"]) for row in read_jsonl(path / RESULTS)}
        need = [(fact, kind, seed) for fact in kept[rank::len(shards)]
                for kind in manifest["kinds"] for seed in manifest["seeds"]]
        missing = [key for key in need if key not in done]
        if missing:
            raise InputError(f"shard {path} is incomplete: {len(missing)} of its {len(need)} "
                             f"rows are missing (first: fact {missing[0][0]!r}, kind "
                             f"{missing[0][1]!r}, seed {missing[0][2]}); rerun rank {rank} with "
                             "the same settings (it resumes), then merge")
    return screen


@checked
def trace_dataset_distributed(model: nn.Module, tokenizer: Tokenizer,
                              records: Sequence[FactRecord], *, out: str | Path,
                              **options) -> DatasetResult | None:
    """:func:`trace_dataset` under ``torchrun``: each rank traces its shard; rank 0 merges after
    all ranks finish and returns the aggregate (other ranks return ``None``). Without a
    ``torchrun`` environment it is a plain single-process run."""
    import torch.distributed as dist  # only under torchrun

    from .. import distributed  # with torch.distributed: only under torchrun

    launch = distributed.environment()  # checked first: a wrong variable is named, not waited on
    if launch is None:
        return trace_dataset(model, tokenizer, records, out=out, **options)
    distributed.init(backend="gloo")  # bounded rendezvous (a no-op if a group is initialised)
    rank, world = dist.get_rank(), dist.get_world_size()
    options["progress"] = options.get("progress", True) and rank == 0
    given = {f.name: options.pop(f.name) for f in fields(DatasetSettings) if f.name in options}
    settings = DatasetSettings.merged(options.pop("settings", None), **given)
    trace_dataset(model, tokenizer, records, out=out, shard=(rank, world), settings=settings,
                  **options)
    dist.barrier()
    merged = merge_shards(out, world, n_boot=settings.n_boot) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()
    return merged
