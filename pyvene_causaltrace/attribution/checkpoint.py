"""Rows computed so far, on disk, so an interrupted ``attribute`` resumes where it stopped.

A directory: ``manifest.json`` (the run's key, the shards' sizes and SHA-256, the pending queue)
and one safetensors shard per save. Shards are renamed into place before the manifest naming
them, so a kill leaves a consistent checkpoint; damage or another graph's key raises
:class:`CheckpointMismatchError` naming the directory, never a partial resume. Locked while a
graph is built (:mod:`~pyvene_causaltrace.runlock`); :func:`remove_checkpoint` deletes it."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import safetensors.torch
import torch

from ..arguments import checked
from ..atomic import replacing, write_text
from ..errors import CheckpointMismatchError, InputError
from ..runlock import LOCK_NAME, single_writer
from ..strict_json import loads
from .store import RowStore

FORMAT = "pyvene_causaltrace.attribution_rows"
#: 2: each shard's size and SHA-256 in the manifest (1 had none, and is refused).
SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
_SHARD = re.compile(r"shard-\d{5}\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def tensor_digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of the tensors' bytes (CPU, contiguous)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@checked
def remove_checkpoint(path: str | Path) -> None:
    """Delete the checkpoint at ``path``: its manifest, shards, temporary files and lock, then
    the directory if nothing else is in it. Refused (:class:`OutputLockedError`) while another
    run holds it. Call it once the graph built from it is saved."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise InputError(f"checkpoint {path} is not a directory")
    with single_writer(path):
        (path / MANIFEST).unlink(missing_ok=True)
        for pattern in ("shard-*.safetensors", ".shard-*.tmp*", ".manifest.*.tmp*",
                        f"{MANIFEST}.tmp"):
            for file in path.glob(pattern):
                file.unlink(missing_ok=True)
    (path / LOCK_NAME).unlink(missing_ok=True)
    if not any(path.iterdir()):
        path.rmdir()


class Checkpoint:
    """Save and restore a :class:`~.store.RowStore` and the pending queue under ``path``
    (``None``: a no-op)."""

    def __init__(self, path: str | Path | None, key: dict, every_s: float) -> None:
        self.path = None if path is None else Path(path)
        self.key = json.loads(json.dumps(key))  # as it reads back from the manifest
        self.every_s = every_s
        self.last = time.monotonic()
        self.saved_blocks = 0
        self.shards: list[str] = []
        self.checksums: dict[str, dict] = {}

    def _damaged(self, what: str) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"{what}; remove {self.path} to start afresh (its rows cannot be trusted)")

    def _manifest(self) -> dict:
        """The manifest, checked for form; refused when it cannot be read or is not ours."""
        path = self.path / MANIFEST
        try:
            manifest = loads(path.read_text(encoding="utf-8"))
        except ValueError as error:  # not UTF-8, not JSON, or a NaN/inf in it
            raise self._damaged(f"checkpoint manifest {path} is damaged ({error})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise self._damaged(f"{path} is not an attribution checkpoint manifest")
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise self._damaged(f"{path} has checkpoint schema version "
                                f"{manifest.get('schema_version')!r}; this version reads "
                                f"{SCHEMA_VERSION} (shards with checksums)")
        shards, pending = manifest.get("shards"), manifest.get("pending")
        sums = manifest.get("checksums")
        well_formed = isinstance(manifest.get("key"), dict) and isinstance(shards, list) \
            and isinstance(sums, dict) and len(set(map(str, shards))) == len(shards) \
            and all(isinstance(name, str) and _SHARD.fullmatch(name)
                    and isinstance(sums.get(name), dict)
                    and isinstance(sums[name].get("bytes"), int)
                    and isinstance(sums[name].get("sha256"), str)
                    and _SHA256.fullmatch(sums[name]["sha256"]) for name in shards) \
            and isinstance(pending, list) \
            and all(isinstance(i, int) and not isinstance(i, bool) and abs(i) < 2**62
                    for i in pending)
        if not well_formed:
            raise self._damaged(f"checkpoint manifest {path} is damaged (malformed key, "
                                "shard list or pending queue)")
        return manifest

    def _shard(self, n_columns: int, name: str, entry: dict, n_logits: int = 1) -> RowStore:
        """One shard's rows, after its size and SHA-256 (``entry``) match the manifest's."""
        path = self.path / name
        if not path.is_file():
            raise self._damaged(f"checkpoint shard {path} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise self._damaged(f"checkpoint shard {path} is damaged: {size:,} bytes, the "
                                f"manifest says {entry['bytes']:,}")
        if file_digest(path) != entry["sha256"]:
            raise self._damaged(f"checkpoint shard {path} is damaged: its SHA-256 does not "
                                "match the manifest's")
        try:
            return RowStore.from_state(n_columns, safetensors.torch.load_file(str(path)),
                                       n_logits=n_logits)
        except MemoryError:
            raise
        except Exception as error:  # safetensors raises its own types; from_state InputError
            raise self._damaged(f"checkpoint shard {path} is unreadable ({error})") from None

    def load(self, n_columns: int, n_features: int | None = None, n_logits: int = 1
             ) -> tuple[RowStore, torch.Tensor] | None:
        """``(store, pending)`` saved for this key, or ``None`` when nothing is saved; another
        graph's or a damaged checkpoint raises :class:`CheckpointMismatchError`. Rows and the
        queue are checked against ``n_features``; each of the ``n_logits`` logit nodes must have
        its row."""
        if self.path is None or not (self.path / MANIFEST).exists():
            return None
        manifest = self._manifest()
        saved = manifest["key"]
        differs = sorted(k for k in set(saved) | set(self.key) if saved.get(k) != self.key.get(k))
        if differs:
            raise CheckpointMismatchError(
                f"{self.path} holds rows of another graph ({', '.join(differs)} differ); "
                f"remove {self.path} to start afresh, or resume with the same inputs")
        store = RowStore(n_columns)
        for name in manifest["shards"]:
            store.blocks.extend(self._shard(n_columns, name, manifest["checksums"][name],
                                            n_logits).blocks)
        self._check_rows(store, manifest["pending"], n_columns, n_features, n_logits)
        self.shards = list(manifest["shards"])
        self.checksums = {name: manifest["checksums"][name] for name in self.shards}
        self.saved_blocks = len(store.blocks)
        return store, torch.tensor(manifest["pending"], dtype=torch.long)

    def _check_rows(self, store: RowStore, pending: list[int], n_columns: int,
                    n_features: int | None, n_logits: int = 1) -> None:
        """Refuse rows that cannot be this graph's: a node twice, a row for a node that has
        none (an error or token), no target row, a queue entry outside the features or done."""
        where = self.path / MANIFEST
        nodes = store.nodes
        if len(torch.unique(nodes)) != len(nodes):
            raise self._damaged(f"the shards of {self.path} hold a node's row twice")
        logits = n_columns + torch.arange(n_logits)
        if not bool(torch.isin(logits, nodes).all()):
            raise self._damaged(f"the shards of {self.path} miss a target row")
        if n_features is None:
            return
        if bool(((nodes >= n_features) & (nodes < n_columns)).any()):
            raise self._damaged(f"the shards of {self.path} hold rows of nodes that are not "
                                "features")
        queue = torch.tensor(pending, dtype=torch.long)
        if bool(((queue < 0) | (queue >= n_features)).any()) or \
                len(torch.unique(queue)) != len(queue) or bool(torch.isin(queue, nodes).any()):
            raise self._damaged(f"checkpoint manifest {where} is damaged (its pending queue "
                                "names features outside the graph, twice, or already done)")

    def maybe_save(self, store: RowStore, pending: torch.Tensor, force: bool = False) -> None:
        """Save the rows added since the last save as a new shard, and the manifest, when
        ``every_s`` has passed since (or ``force``)."""
        if self.path is None or (not force and time.monotonic() - self.last < self.every_s):
            return
        self.path.mkdir(parents=True, exist_ok=True)
        new = RowStore(store.n_columns, store.blocks[self.saved_blocks:])
        if new.blocks:
            name = f"shard-{len(self.shards):05d}.safetensors"
            with replacing(self.path / name) as tmp:
                safetensors.torch.save_file(new.state(), str(tmp))
                entry = {"bytes": tmp.stat().st_size, "sha256": file_digest(tmp)}
            self.shards.append(name)
            self.checksums[name] = entry
            self.saved_blocks = len(store.blocks)
        manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "key": self.key,
                    "shards": self.shards, "checksums": self.checksums,
                    "pending": pending.tolist()}
        write_text(json.dumps(manifest, allow_nan=False), self.path / MANIFEST)
        self.last = time.monotonic()
