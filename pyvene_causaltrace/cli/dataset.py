"""``dataset`` and ``aggregate``: indirect effects averaged over a fact dataset or a task.

Every flag, and the output directory (rows without a manifest, a damaged manifest), is checked
before the model loads; sizes that cannot fit are refused before anything large is allocated.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..atomic import replacing, write_text
from ..dataset import get_task, read_records
from ..dataset.plan import check_options
from ..dataset.run import (
    load_dataset_result,
    merge_shards,
    run_path,
    trace_dataset_distributed,
)
from ..dataset.store import check_run_directory
from ..errors import InputError
from ..models import OFFLINE_DEFAULT, load_model
from .common import number_or_name, out_dir


def dataset_command(args) -> int:
    out_dir(args.out)
    if args.task:
        task = get_task(args.task)
        records, errors, default_known = list(task.records), [], task.known
    else:
        (records, errors), default_known = read_records(args.data), "argmax"
        if not records:
            raise InputError(f"no record could be read from {args.data}"
                             + (f": {errors[0]}" if errors else ""))
    options = dict(kinds=args.kinds.split(","), seeds=args.seeds, scale=args.scale,
                   sigma=number_or_name(args.sigma), window=args.window,
                   known=args.known or default_known, limit=args.limit,
                   memory_budget_mb=args.budget_mb, n_boot=args.boot)
    check_options(**options)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shard = (int(os.environ.get("RANK", "0")), world) if world > 1 else None
    check_run_directory(run_path(args.out, shard))
    for error in errors[:10]:
        print(f"skipping malformed record {error}", file=sys.stderr)
    if len(errors) > 10:
        print(f"... and {len(errors) - 10} more malformed records", file=sys.stderr)
    model, tokenizer = load_model(args.model or OFFLINE_DEFAULT)
    result = trace_dataset_distributed(model, tokenizer, records, out=args.out, errors=errors,
                                       **options)
    if result is not None:  # rank 0, or a single process
        write_dataset_report(result, args.out)
    return 0


def write_dataset_report(result, out: Path) -> None:
    write_text(result.to_json(), out / "aggregate.json")  # each file whole or not at all
    for name, write in (("aie.csv", lambda p: result.to_dataframe().to_csv(p, index=False)),
                        ("peaks.csv", lambda p: result.peaks().to_csv(p, index=False)),
                        ("figure1.png", result.plot), ("curves.png", result.plot_curves)):
        with replacing(out / name) as tmp:
            write(tmp)
    print(result.summary())
    print(f"wrote aggregate.json, aie.csv, peaks.csv, figure1.png, curves.png to {out}")


def aggregate_command(args) -> int:
    if args.boot <= 0:
        raise InputError(f"--boot must be a positive integer, got {args.boot}")
    shards = sorted(args.out.glob("shard-*-of-*"))
    if shards and not (args.out / "results.jsonl").exists():
        result = merge_shards(args.out, int(shards[0].name.rsplit("-", 1)[1]), n_boot=args.boot)
    else:
        result = load_dataset_result(args.out, n_boot=args.boot)
    write_dataset_report(result, args.out)
    return 0
