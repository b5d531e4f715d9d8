"""Things expensive to make (a trained tiny model, a fitted CLT), made once per test run and
shared by every pytest-xdist worker: the first worker to ask builds into a folder beside the
workers' temporary folders, under a file lock; the others, and later asks, read the files.

Serial and parallel runs read the same files, so a test sees bit-identical weights either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def shared_root(tmp_path_factory) -> Path:
    """The run's temporary root: under xdist every worker's basetemp is one level below it."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``<shared root>/built/<name>``, filled by ``build(folder)`` once per run."""
    folder = shared_root(tmp_path_factory) / "built" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder / ".complete"
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            build(folder)
            done.touch()
    return folder
