"""What a load reads from its safetensors files: :class:`Recorder` wraps a ``safe_open`` handle
and records ``(name, shape)`` of every tensor read, whole (``get_tensor``) or a slice
(``get_slice(name)[...]``); :func:`record_reads` puts it under the package's one ``safe_open``.
The sharded-load tests read it to show a rank reads only its rows."""

from __future__ import annotations

from pyvene_causaltrace.transcoders.formats import common


class Recorder:
    """A safetensors handle recording ``(name, shape)`` of every tensor read from it."""

    def __init__(self, handle, reads: list) -> None:
        self.handle, self.reads = handle, reads

    def get_tensor(self, name: str):
        tensor = self.handle.get_tensor(name)
        self.reads.append((name, tuple(tensor.shape)))
        return tensor

    def get_slice(self, name: str):
        return RecordedSlice(self.handle.get_slice(name), name, self.reads)

    def __getattr__(self, name: str):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


class RecordedSlice:
    def __init__(self, part, name: str, reads: list) -> None:
        self.part, self.name, self.reads = part, name, reads

    def __getitem__(self, key):
        tensor = self.part[key]
        self.reads.append((self.name, tuple(tensor.shape)))
        return tensor

    def __getattr__(self, name: str):
        return getattr(self.part, name)


def record_reads(monkeypatch, reads: list | None = None) -> list:
    """Every file the package opens from now on goes through a :class:`Recorder` appending to
    ``reads`` (a new list unless given), which is returned."""
    reads = [] if reads is None else reads
    real = common.safe_open
    monkeypatch.setattr(common, "safe_open", lambda *a, **k: Recorder(real(*a, **k), reads))
    return reads
