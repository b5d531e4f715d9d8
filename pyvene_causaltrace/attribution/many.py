"""Many prompts' graphs, spread over the ranks of a distributed run: one directory per prompt
and an index (the layout, resuming and refusals: docs/attribution.md, "Beyond one device").

    prompts = read_prompts("prompts.jsonl")     # {"prompt": ..., "answer": ..., "target": ...}
    index = attribute_many(model, tokenizer, transcoder, prompts, out="graphs/")

Prompt ``i`` goes to rank ``i % world``, which builds its graph alone
(:func:`~pyvene_causaltrace.distributed.alone`) into ``out/<i>/``; a done graph is skipped on a
rerun, one made from other inputs refused (:class:`ManifestMismatchError`). The transcoder must
be whole on every rank."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from ..atomic import write_text
from ..bound import BoundModel
from ..distributed import alone, current
from ..errors import InputError, ManifestMismatchError
from ..fingerprint import tokenizer_fingerprint, transcoder_fingerprint
from ..model_guard import measured
from ..strict_json import loads
from ..transcoders.transcoder import Transcoder
from .attribute import attribute
from .checkpoint import remove_checkpoint
from .identity import text_digest
from .settings import AttributionSettings
from .targets import TARGET_KINDS

if TYPE_CHECKING:  # transformers takes seconds to import; only the annotations need it
    from transformers import PreTrainedTokenizerBase

__all__ = ["INDEX", "attribute_many", "read_prompts"]

#: The index rank 0 writes when every prompt is done.
INDEX = "index.json"
#: What a line of a prompts file may hold.
PROMPT_KEYS = ("prompt", "answer", "target")


def read_prompts(path: str | Path) -> list[dict]:
    """The prompts of a JSONL file: one object per line with ``prompt`` (a non-empty string),
    optionally ``answer`` (a string) and ``target`` (a kind of :data:`~.targets.TARGET_KINDS`);
    anything else is refused naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read the prompts file {path}: {error}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = loads(line)
        except ValueError as error:
            raise InputError(f"{where}: not JSON: {error}") from None
        prompts.append(check_prompt(entry, where))
    if not prompts:
        raise InputError(f"{path} holds no prompt (one JSON object per line: "
                         '{"prompt": "...", "answer": " Paris"})')
    return prompts


def check_prompt(entry: object, where: str) -> dict:
    """One prompt entry, checked (:func:`read_prompts`)."""
    if not isinstance(entry, dict):
        raise InputError(f"{where}: a line is a JSON object with 'prompt'")
    unknown = sorted(set(entry) - set(PROMPT_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(unknown)} (known: "
                         f"{', '.join(PROMPT_KEYS)})")
    if not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
        raise InputError(f"{where}: 'prompt' must be a non-empty string")
    if entry.get("answer") is not None and not isinstance(entry["answer"], str):
        raise InputError(f"{where}: 'answer' must be a string")
    if entry.get("target") is not None and entry["target"] not in TARGET_KINDS:
        raise InputError(f"{where}: 'target' must be one of {', '.join(TARGET_KINDS)}, got "
                         f"{entry['target']!r}")
    return {"prompt": entry["prompt"], "answer": entry.get("answer"),
            "target": entry.get("target")}


@measured  # bound once for every prompt's graph; one run per model at a time, in eval mode
def attribute_many(model: BoundModel, tokenizer: PreTrainedTokenizerBase,
                   transcoder: Transcoder, prompts: Sequence[dict] | str | Path,
                   out: str | Path, *, settings: AttributionSettings | None = None,
                   progress: bool = False) -> list[dict] | None:
    """Every prompt's graph in ``out/<index>/``, the prompts spread over the ranks (module
    docstring); returns the index on rank 0 (and in one process), None on the other ranks."""
    prompts = read_prompts(prompts) if isinstance(prompts, str | Path) else [
        check_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
    if transcoder.features is not None:
        raise InputError("attribute_many builds each prompt's graph on one rank, which needs "
                         "the whole transcoder: load it without shard=")
    settings = settings or AttributionSettings()
    out = Path(out)
    ranks = current()
    rank, world = (0, 1) if ranks is None else (ranks.rank, ranks.world)
    if ranks is not None:
        ranks.agree("prompts", prompts)
        ranks.agree("settings", repr(settings))
    run = {"model": model.fingerprint, "tokenizer": tokenizer_fingerprint(tokenizer),
           "transcoder": transcoder_fingerprint(transcoder), "settings": repr(settings)}
    wanted = [_inputs(prompt, run) for prompt in prompts]
    check_done(out, wanted)  # every rank, before any graph: all refuse or none
    out.mkdir(parents=True, exist_ok=True)
    mine = [i for i in range(len(prompts)) if i % world == rank]
    bar = tqdm(total=len(mine), desc=f"prompts (rank {rank} of {world})", unit="graph",
               disable=not (progress and rank == 0))
    with alone():
        for i in mine:
            _one(model, tokenizer, transcoder, prompts[i], out / f"{i:05d}", settings,
                 wanted[i])
            bar.update(1)
    bar.close()
    if ranks is not None:
        ranks.barrier("waiting for every rank's prompts")
        if not ranks.first:
            return None
    index = [_entry(i, prompts[i], out, wanted[i]) for i in range(len(prompts))]
    write_text(json.dumps({"prompts": index, "world": world, "settings": repr(settings),
                           "inputs": run}, indent=2), out / INDEX)
    return index


def _inputs(prompt: dict, run: dict) -> dict:
    """What prompt ``prompt``'s graph is made from (module docstring)."""
    return {"prompt_sha256": text_digest(prompt["prompt"]), "answer": prompt["answer"],
            "target": prompt["target"], **run}


#: How a refusal names each input that changed.
_CHANGED = {"prompt_sha256": "prompt text", "answer": "answer", "target": "target",
            "model": "model weights", "tokenizer": "tokenizer", "transcoder": "transcoder",
            "settings": "settings"}


def check_done(out: Path, wanted: list[dict]) -> None:
    """Refuse (:class:`ManifestMismatchError`) the done graphs under ``out`` made from other
    inputs than ``wanted`` (one entry per prompt), naming them, what changed and what to do."""
    stale = []
    for i, inputs in enumerate(wanted):
        folder = out / f"{i:05d}"
        if not (folder / "graph.safetensors").exists():
            continue
        try:
            recorded = json.loads((folder / "summary.json").read_text(encoding="utf-8"))["inputs"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None  # a summary without inputs: written by an older version, or damaged
        changed = _changed(recorded, inputs)
        if changed:
            stale.append((folder, changed))
    if stale:
        names = "; ".join(f"{folder.name}: {what}" for folder, what in stale[:5])
        more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
        raise ManifestMismatchError(
            f"{out} holds graphs made from other inputs than this run's ({names}{more} "
            "changed); remove those directories to rebuild them, or write to another --out")


def _changed(recorded: object, inputs: dict) -> str:
    """What differs between the ``recorded`` inputs of a graph and ``inputs`` ('' if none)."""
    if not isinstance(recorded, dict):
        return "its inputs (not recorded: an older version's graph)"
    return ", ".join(name for key, name in _CHANGED.items() if recorded.get(key) != inputs[key])


def _one(model, tokenizer, transcoder: Transcoder, prompt: dict, folder: Path,
         settings: AttributionSettings, inputs: dict) -> None:
    """One prompt's graph into ``folder`` unless it is there already."""
    if (folder / "graph.safetensors").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = folder / "rows.partial"
    chosen = settings if prompt["target"] is None else replace(settings, target=prompt["target"])
    graph = attribute(model, tokenizer, transcoder, prompt["prompt"], prompt["answer"],
                      settings=chosen, checkpoint=checkpoint)
    summary = {"prompt": prompt["prompt"], "answer": graph.answer,
               "answer_prob": graph.answer_prob, "n_features": graph.n_features,
               "n_explored": graph.n_explored, "closure": graph.closure.to_dict(),
               "inputs": inputs, "metadata": graph.metadata}
    write_text(json.dumps(summary, indent=2, default=str), folder / "summary.json")
    graph.save(folder / "graph.safetensors")  # whole or not at all, last: it means done
    remove_checkpoint(checkpoint)


def _entry(i: int, prompt: dict, out: Path, inputs: dict) -> dict:
    """Prompt ``i``'s line of the index, read from its summary (refused if it was made from
    other inputs)."""
    folder = out / f"{i:05d}"
    summary = json.loads((folder / "summary.json").read_text())
    changed = _changed(summary.get("inputs"), inputs)
    if changed:  # made by another run while this one ran
        raise ManifestMismatchError(f"{folder} holds a graph made from other inputs ({changed} "
                                    "changed); remove it and rerun")
    return {"index": i, "prompt": prompt["prompt"], "prompt_sha256": inputs["prompt_sha256"],
            "answer": summary["answer"],
            "dir": folder.name, "answer_prob": summary["answer_prob"],
            "n_features": summary["n_features"], "n_explored": summary["n_explored"],
            "closure": summary["closure"]["relative"]}
