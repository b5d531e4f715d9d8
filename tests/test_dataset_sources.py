"""Datasets by name: fetched once into the cache through pooch with a SHA-256 check, from a
local file URL here (never the network); a local copy through an environment variable; offline
and checksum errors that say what to do."""

from __future__ import annotations

import hashlib
import json

import pytest
from _support.data import fetch_file_urls

from pyvene_causaltrace.dataset import read_records, sources
from pyvene_causaltrace.dataset.sources import (
    DatasetSource,
    DatasetUnavailableError,
    dataset_path,
)

FACTS = [{"known_id": i, "subject": "Paris", "attribute": "France",
          "prompt": "Paris is the capital of"} for i in range(3)]


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A dataset 'tiny' whose canonical copy is a file URL, and an empty cache."""
    monkeypatch.setenv("PYVENE_CAUSALTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PVCT_TINY", raising=False)
    data = (json.dumps(FACTS) + "\n").encode()
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "tiny.json").write_bytes(data)
    source = DatasetSource(url=(tmp_path / "mirror" / "tiny.json").as_uri(),
                           sha256=hashlib.sha256(data).hexdigest(), filename="tiny.json",
                           env="PVCT_TINY", licence="test")
    monkeypatch.setitem(sources.DATASETS, "tiny", source)
    fetch_file_urls(monkeypatch)
    return tmp_path, source


def test_fetched_once_then_read_from_the_cache(mirror):
    root, _ = mirror
    path = dataset_path("tiny")
    assert path == root / "cache" / "data" / "tiny.json"
    (root / "mirror" / "tiny.json").unlink()  # a second call must not need the source
    assert dataset_path("tiny") == path
    records, errors = read_records("tiny")
    assert [r.subject for r in records] == ["Paris"] * 3 and not errors


def test_a_checksum_mismatch_is_refused_and_nothing_is_cached(mirror, monkeypatch):
    root, source = mirror
    monkeypatch.setitem(sources.DATASETS, "tiny", DatasetSource(
        source.url, "0" * 64, source.filename, source.env, source.licence))
    with pytest.raises(DatasetUnavailableError, match="failed its checksum"):
        dataset_path("tiny")
    assert not (root / "cache" / "data" / "tiny.json").exists()


def test_offline_says_where_to_put_the_file(mirror):
    root, _ = mirror
    (root / "mirror" / "tiny.json").unlink()  # the canonical copy is unreachable
    with pytest.raises(DatasetUnavailableError, match=r"could not fetch tiny from file:.*"
                                                      r"download it by hand to .*tiny\.json, "
                                                      r"or set PVCT_TINY"):
        dataset_path("tiny")


def test_an_environment_variable_names_a_local_copy(mirror, monkeypatch, tmp_path):
    root, _ = mirror
    monkeypatch.setenv("PVCT_TINY", str(root / "mirror" / "tiny.json"))
    assert dataset_path("tiny") == root / "mirror" / "tiny.json"
    (tmp_path / "other.json").write_text("[]")
    monkeypatch.setenv("PVCT_TINY", str(tmp_path / "other.json"))
    with pytest.raises(DatasetUnavailableError, match="is not tiny: SHA-256"):
        dataset_path("tiny")


def test_an_unknown_name_lists_the_named_datasets():
    with pytest.raises(FileNotFoundError, match="named datasets: known_1000"):
        read_records("known_1001")
    with pytest.raises(ValueError, match="unknown dataset 'known_1001'"):
        dataset_path("known_1001")


def test_rome_known_1000_checksum_matches_the_real_file(monkeypatch):
    from _support.data import known_facts

    monkeypatch.setenv("PVCT_KNOWN_1000", str(known_facts()))
    records, errors = read_records("known_1000")
    assert len(records) == 1209 and not errors
