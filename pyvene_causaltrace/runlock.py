"""One writer per output directory.

    with single_writer(out):          # a second run on ``out`` gets OutputLockedError at once
        ...                           # write rows

The lock is an operating-system file lock (``filelock``) on ``<dir>/.pvct.lock``: the system
drops it when its process ends, so a lock left by a killed run does not block the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import OutputLockedError

LOCK_NAME = ".pvct.lock"


def single_writer(directory: str | Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``directory``'s lock for the block (creating the directory); refuse at once if
    another process holds it."""
    return exclusive(Path(directory) / LOCK_NAME, Path(directory))


@contextlib.contextmanager
def exclusive(lock_file: Path, target: Path) -> Iterator[None]:
    """Hold ``lock_file`` (creating its folder) for the block; refuse at once, naming
    ``target``, if another process holds it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_file)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise OutputLockedError(
            f"{target} is being written by another run (it holds {lock_file}); "
            "wait for it to finish or choose another output directory") from None
    try:
        yield
    finally:
        lock.release()
