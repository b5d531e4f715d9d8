"""``dataset`` and ``aggregate``: indirect effects averaged over a fact dataset or a task,
and with ``--graphs --clt DIR`` each fact's attribution graph beside its traces.

Every flag, the output directory (rows without a manifest, a damaged manifest) and the
transcoder's files are checked before the model loads; sizes that cannot fit are refused before
anything large is allocated, and a transcoder that does not fit the model before any row.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import distributed
from ..atomic import replacing, write_text
from ..dataset import get_task, read_records
from ..dataset.faithfulness import load_faithfulness
from ..dataset.graphs import GraphSettings, check_faithfulness
from ..dataset.run import (
    load_dataset_result,
    merge_shards,
    run_path,
    trace_dataset_distributed,
)
from ..dataset.settings import DatasetSettings
from ..dataset.store import check_run_directory
from ..errors import InputError
from ..models import OFFLINE_DEFAULT, load_model
from ..transcoders import load_transcoder
from .common import number_or_name, out_dir, resolve_device, settings_of
from .evaluate import faithfulness_settings as graph_faithfulness_settings
from .trace import faithfulness_settings as trace_faithfulness_settings


def graph_settings(args) -> GraphSettings | None:
    """The graph settings the flags ask for (``None`` without ``--graphs``; a graph flag
    without it is refused by :mod:`.flags`); ``--graphs`` without ``--clt`` is refused."""
    if not args.graphs:
        return None
    if args.clt is None:
        raise InputError("--graphs needs a transcoder: --clt DIR")
    given = {"max_feature_nodes": args.max_feature_nodes, "memory_mb": args.graph_memory_mb,
             "bos": args.bos}  # a flag not given: GraphSettings' default
    return GraphSettings(**{key: value for key, value in given.items() if value is not None},
                         save=args.save_graphs)


#: The ``dataset`` flags that are :class:`~..dataset.settings.DatasetSettings`' fields:
#: argparse dest -> field (the other flags: the data, the model, the output, the graphs').
DATASET_FLAGS = {"kinds": "kinds", "seeds": "seeds", "scale": "scale", "sigma": "sigma",
                 "window": "window", "known": "known", "limit": "limit",
                 "budget_mb": "memory_budget_mb", "boot": "n_boot"}


def dataset_settings(args, default_known: str) -> DatasetSettings:
    """The :class:`~..dataset.settings.DatasetSettings` the flags ask for (checked: a flag it
    refuses is refused before the model loads, naming the flag); ``--known`` not given is
    ``default_known`` (a built-in task's)."""
    given = {field: getattr(args, dest) for dest, field in DATASET_FLAGS.items()}
    given.update(kinds=args.kinds.split(","), sigma=number_or_name(args.sigma),
                 known=args.known or default_known)
    return settings_of(DatasetSettings, given, DATASET_FLAGS)


def dataset_command(args) -> int:
    launch = distributed.environment()  # first: a wrong WORLD_SIZE/RANK/... is named at once
    out_dir(args.out)
    device = resolve_device(args.device)
    if args.task:
        task = get_task(args.task)
        records, errors, default_known = list(task.records), [], task.known
    else:
        (records, errors), default_known = read_records(args.data), DatasetSettings.known
        if not records:
            raise InputError(f"no record could be read from {args.data}"
                             + (f": {errors[0]}" if errors else ""))
    settings = dataset_settings(args, default_known)  # checked before the model loads
    graphs = graph_settings(args)
    faithfulness = trace_faithfulness_settings(args)  # None without --faithfulness
    graph_faith = None
    if faithfulness is not None and graphs is not None:  # and each graph's curve
        graph_faith = graph_faithfulness_settings(args)
        try:
            check_faithfulness(graph_faith)
        except InputError as error:
            raise InputError(f"--{error}") from None  # "--metric: ..."
    shard = None if launch is None else (launch.rank, launch.world)
    if faithfulness is not None and shard is not None:
        raise InputError("--faithfulness: a sharded run does not merge its rows yet; run it in "
                         "one process")
    check_run_directory(run_path(args.out, shard))
    # the transcoder's files are read before the model loads: a wrong --clt costs no model load
    transcoder = None if graphs is None else load_transcoder(args.clt, format=args.format,
                                                             device=device)
    for error in errors[:10]:
        print(f"skipping malformed record {error}", file=sys.stderr)
    if len(errors) > 10:
        print(f"... and {len(errors) - 10} more malformed records", file=sys.stderr)
    model, tokenizer = load_model(args.model or OFFLINE_DEFAULT, device=device)
    result = trace_dataset_distributed(model, tokenizer, records, out=args.out, errors=errors,
                                       settings=settings, progress=not args.no_progress,
                                       transcoder=transcoder, graph_options=graphs,
                                       graph_faithfulness=graph_faith, faithfulness=faithfulness)
    if result is not None:  # rank 0, or a single process
        write_dataset_report(result, args.out)
    if faithfulness is not None:
        faithful = load_faithfulness(args.out, n_boot=settings.n_boot)
        write_text(faithful.to_json(), args.out / "faithfulness.json")
        with replacing(args.out / "faithfulness.csv") as tmp:
            faithful.to_dataframe().to_csv(tmp, index=False)
        print(faithful.summary())
        print(f"wrote faithfulness.json and faithfulness.csv to {args.out}")
    return 0


def write_dataset_report(result, out: Path) -> None:
    """aggregate.json, aie.csv, peaks.csv (and graphs.csv with graphs), figure1.png and
    curves.png, each written whole or not at all."""
    write_text(result.to_json(), out / "aggregate.json")
    tables = [("aie.csv", lambda p: result.to_dataframe().to_csv(p, index=False)),
              ("peaks.csv", lambda p: result.peaks().to_csv(p, index=False))]
    if result.graphs is not None:
        tables.append(("graphs.csv", lambda p: result.graph_dataframe().to_csv(p, index=False)))
    outputs = [*tables, ("figure1.png", result.plot), ("curves.png", result.plot_curves)]
    for name, write in outputs:
        with replacing(out / name) as tmp:
            write(tmp)
    print(result.summary())
    print(f"wrote aggregate.json, {', '.join(name for name, _ in outputs)} to {out}")


def aggregate_command(args) -> int:
    shards = sorted(args.out.glob("shard-*-of-*"))
    if shards and not (args.out / "results.jsonl").exists():
        result = merge_shards(args.out, int(shards[0].name.rsplit("-", 1)[1]), n_boot=args.boot)
    else:
        result = load_dataset_result(args.out, n_boot=args.boot)
    write_dataset_report(result, args.out)
    return 0
