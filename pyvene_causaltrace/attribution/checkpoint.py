"""Rows computed so far, on disk, so an interrupted ``attribute`` resumes where it stopped.

A checkpoint is a directory: ``manifest.json`` (format, schema version, the run's key, the shard
list and the queue of feature rows still pending from the last ranking) and one safetensors
shard per save holding only the rows added since the previous one. A shard is written before
the manifest that names it, and the manifest is replaced atomically, so a kill at any moment
leaves a consistent checkpoint (at worst an unnamed shard, overwritten next time). Nothing in
it is a pickle.

The run's key holds what the rows depend on — the prompt's tokens, the target, the settings,
and fingerprints of the model's weights, the transcoder and the package version — and a
checkpoint saved under another key is refused, naming what differs. While a graph is being built
its checkpoint directory is locked (:mod:`~pyvene_causaltrace.runlock`): a second ``attribute``
on it is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointMismatchError
from .store import RowStore

FORMAT = "pyvene_causaltrace.attribution_rows"
SCHEMA_VERSION = 1


def tensor_digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of the tensors' bytes (CPU, contiguous)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


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

    def load(self, n_columns: int) -> tuple[RowStore, torch.Tensor] | None:
        """``(store, pending)`` saved for this key, or ``None`` (nothing saved, or rows of
        another graph: then the directory is cleared with a warning)."""
        if self.path is None or not (self.path / "manifest.json").exists():
            return None
        from safetensors.torch import load_file

        try:
            manifest = json.loads((self.path / "manifest.json").read_text())
        except json.JSONDecodeError:
            manifest = {}
        if manifest.get("format") != FORMAT:
            warnings.warn(f"{self.path} holds no readable checkpoint; starting afresh",
                          stacklevel=3)
            self.remove()
            return None
        saved = manifest.get("key", {})
        differs = sorted(k for k in set(saved) | set(self.key) if saved.get(k) != self.key.get(k))
        if differs:
            raise CheckpointMismatchError(
                f"{self.path} holds rows of another graph ({', '.join(differs)} differ); "
                "remove it to start afresh, or resume with the same inputs")
        store = RowStore(n_columns)
        for name in manifest["shards"]:
            part = RowStore.from_state(n_columns, load_file(str(self.path / name)))
            store.blocks.extend(part.blocks)
        self.shards = list(manifest["shards"])
        self.saved_blocks = len(store.blocks)
        return store, torch.tensor(manifest["pending"], dtype=torch.long)

    def maybe_save(self, store: RowStore, pending: torch.Tensor, force: bool = False) -> None:
        if self.path is None or (not force and time.monotonic() - self.last < self.every_s):
            return
        from safetensors.torch import save_file

        self.path.mkdir(parents=True, exist_ok=True)
        new = RowStore(store.n_columns, store.blocks[self.saved_blocks:])
        if new.blocks:
            name = f"shard-{len(self.shards):05d}.safetensors"
            save_file(new.state(), str(self.path / name))
            self.shards.append(name)
            self.saved_blocks = len(store.blocks)
        manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "key": self.key,
                    "shards": self.shards, "pending": pending.tolist()}
        tmp = self.path / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, self.path / "manifest.json")
        self.last = time.monotonic()

    def remove(self) -> None:
        if self.path is not None and self.path.exists():
            shutil.rmtree(self.path)
        self.shards, self.saved_blocks = [], 0

