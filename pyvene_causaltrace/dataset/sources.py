"""Datasets by name: ROME's files fetched once into the cache, checked by SHA-256.

    path = dataset_path("known_1000")         # ~/.cache/pyvene_causaltrace/data/known_1000.json

Downloaded through ``pooch`` from the URL ROME's code uses; ``PVCT_KNOWN_1000`` names a local
copy instead (checked the same way). Offline, the error says where to put the file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import DatasetUnavailableError, InputError
from ..models import cache_dir


@dataclass(frozen=True)
class DatasetSource:
    """Where a named dataset lives and what its bytes hash to."""

    url: str
    sha256: str
    filename: str
    env: str
    licence: str


#: The named datasets. CounterFact is not listed: its published file has no checksum we could
#: verify here.
DATASETS: dict[str, DatasetSource] = {
    "known_1000": DatasetSource(
        url="https://rome.baulab.info/data/dsets/known_1000.json",
        sha256="61daca55318bb5260c1e62e133debef9102c7b278bbc7b19dd2ac655543f333a",
        filename="known_1000.json", env="PVCT_KNOWN_1000",
        licence="MIT (ROME, Meng et al. 2022)"),
}


def dataset_path(name: str, *, progress: bool = False) -> Path:
    """The local file of dataset ``name``: ``$<env>`` if set, else the cache, fetching it on
    first use. Every copy is checked against the dataset's SHA-256."""
    import pooch  # pooch only fetches a named dataset, on first use

    if name not in DATASETS:
        raise InputError(f"unknown dataset {name!r}; named datasets: {', '.join(DATASETS)} "
                         "(or give a path to a JSON/JSONL file)")
    source = DATASETS[name]
    local = os.environ.get(source.env)
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise DatasetUnavailableError(f"${source.env} points at {path}, which is not a file")
        digest = pooch.file_hash(str(path))
        if digest != source.sha256:
            raise DatasetUnavailableError(
                f"{path} (from ${source.env}) is not {name}: SHA-256 {digest}, expected "
                f"{source.sha256}")
        return path
    folder = cache_dir() / "data"
    try:
        fetched = pooch.retrieve(source.url, known_hash=f"sha256:{source.sha256}",
                                 fname=source.filename, path=folder, progressbar=progress)
    except ValueError as error:  # pooch's checksum mismatch
        raise DatasetUnavailableError(f"{name} from {source.url} failed its checksum: "
                                      f"{str(error).splitlines()[0]}") from None
    except Exception as error:  # no network, a proxy, a server error: say where to put it
        raise DatasetUnavailableError(
            f"could not fetch {name} from {source.url} ({type(error).__name__}: {error}); "
            f"download it by hand to {folder / source.filename}, or set {source.env} to a local "
            "copy") from None
    return Path(fetched)
