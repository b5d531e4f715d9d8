"""Files written whole or not at all: a kill, a full disk or Ctrl-C mid-write leaves the old
file (or none), never half a file.

    with replacing(path) as tmp:     # write tmp however you like (same suffix as path)
        save_file(tensors, str(tmp))
    write_text("...", path)
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so writers that go by it still do) to
    write to: when the block ends, the file is flushed to disk and renamed over ``path``
    (``os.replace``); when it raises (an error, a full disk, Ctrl-C) the temporary file is
    removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(text: str, path: str | Path) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
