"""Loaders, one per on-disk layout, looked up by name in :data:`FORMATS` (sae-lens's
convention): ``mntss`` (:mod:`.mntss`), ``circuit_tracer`` (:mod:`.circuit_tracer`),
``gemmascope`` (:mod:`.gemmascope`), ``gemmascope2`` (:mod:`.gemmascope2`), ``bytedance``
(:mod:`.bytedance`), ``sae_lens`` (:mod:`.sae_lens`), ``sparsify`` (:mod:`.sparsify`),
``llamascopium`` (:mod:`.llamascopium`); each module's docstring draws its files. Each loader
(:class:`TranscoderLoader`) and detector (:class:`LayoutDetector`) checks everything before it
returns: a missing file or layer, mixed widths, an unknown activation or hook, a ``W_skip`` of
the wrong shape raise :class:`~pyvene_causaltrace.errors.TranscoderFormatError` naming the file.

    tc = load_transcoder("mntss/clt-llama-3.2-1b-524k")          # layout detected
    tc = load_transcoder("path/to/config.yaml", format="circuit_tracer")"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ...arguments import checked
from ...errors import InputError, TranscoderFormatError
from ..transcoder import Transcoder, register_layouts
from . import (
    bytedance,
    circuit_tracer,
    gemmascope,
    gemmascope2,
    llamascopium,
    mntss,
    sae_lens,
    sparsify,
)
from .common import hub_snapshot


class TranscoderLoader(Protocol):
    """Reads one layout into a checked :class:`~..transcoder.Transcoder`, or raises
    :class:`~pyvene_causaltrace.errors.TranscoderFormatError` naming the file. ``source`` is a
    local path (or, where the layout takes them, a hub reference or a list of per-layer files);
    layout options (``lazy_decoder``, ``revision``, ``scan``, ...) may follow ``device`` and
    ``dtype``."""

    def __call__(self, source: str | Path, /, *, device: str | torch.device = ...,
                 dtype: torch.dtype = ...) -> Transcoder: ...


class LayoutDetector(Protocol):
    """Whether a local path (a directory or a config file) holds the layout."""

    def __call__(self, path: Path, /) -> bool: ...


#: Loader by layout name: ``loader(source, *, device, dtype, lazy_decoder, ...) -> Transcoder``;
#: add one to read another layout with ``format=``.
FORMATS: dict[str, TranscoderLoader] = {
    "mntss": mntss.from_pretrained,
    "circuit_tracer": circuit_tracer.load,
    "gemmascope": gemmascope.load,
    "gemmascope2": gemmascope2.load,
    "bytedance": bytedance.load,
    "sae_lens": sae_lens.load,
    "sparsify": sparsify.load,
    "llamascopium": llamascopium.load,
}
#: Which layout a local path holds (every one is tried: two are refused).
_DETECTORS: tuple[tuple[str, LayoutDetector], ...] = (
    ("mntss", mntss.is_layout), ("circuit_tracer", circuit_tracer.is_layout),
    ("bytedance", bytedance.is_layout), ("gemmascope2", gemmascope2.is_layout),
    ("sparsify", sparsify.is_layout), ("gemmascope", gemmascope.is_layout),
    ("sae_lens", sae_lens.is_layout), ("llamascopium", llamascopium.is_layout))
#: Files that make a directory look like a transcoder, for the error naming what was found.
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".yaml", ".yml", ".json")


@checked
def detect_format(path: str | Path) -> str:
    """The layout of a local path (a directory or a config file); a directory holding the files
    of two layouts is refused, naming both (unless a circuit-tracer config lists the files it
    reads)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise TranscoderFormatError(missing_path(root))
    found = [name for name, matches in _DETECTORS if matches(root)]
    if "mntss" in found and "circuit_tracer" in found:  # an mntss config.yaml is one too
        found.remove("circuit_tracer")
    if "circuit_tracer" in found and circuit_tracer.lists_files(root):
        return "circuit_tracer"  # its config names the files it reads
    if len(found) > 1:
        raise TranscoderFormatError(
            f"{root} holds files of {len(found)} layouts, {' and '.join(found)} ({_found(root)}):"
            f" loading one would leave the other unread; move one out, or pass format=...")
    if found:
        return found[0]
    raise TranscoderFormatError(
        f"{root} holds no transcoder layout we know ({', '.join(FORMATS)}); found "
        f"{_found(root)}; pass format=...")


def missing_path(path: Path) -> str:
    """The error for a transcoder path that does not exist: it says how to get one."""
    return (f"missing path {path}: no transcoder there. `pyvene-causaltrace fit` (or `make "
            "attribute`, or pyvene_causaltrace.fit_transcoder()) fits one for the bundled model "
            "and saves it as "
            "~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16")


def _found(root: Path, limit: int = 12) -> str:
    """The weight and config files in ``root`` and one level below, named for an error."""
    if not root.is_dir():
        return root.name
    files = sorted(str(p.relative_to(root)) for p in [*root.iterdir(), *root.glob("*/*")]
                   if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        return "no .safetensors/.npz/.yaml/.json files"
    more = f" and {len(files) - limit} more" if len(files) > limit else ""
    return ", ".join(files[:limit]) + more


@checked
def load_transcoder(source: str | Path | list, *, format: str | None = None,
                    **kwargs) -> Transcoder:
    """A transcoder from a local path, a hub reference or (GemmaScope, sae-lens) a list of
    per-layer paths, in layout ``format`` (detected when None). Keyword arguments go to the
    loader (``device``, ``dtype``, ``lazy_decoder``, ...).

    A hub reference (``org/repo[/subfolder][@revision]``) with a ``config.yaml`` is read as
    circuit-tracer's config (which also covers mntss CLT repos); any other repo (or subfolder,
    e.g. ``google/gemma-scope-2-1b-pt/clt/width_262k_l0_medium_affine``) is fetched and its
    layout detected. ``HF_HUB_OFFLINE=1`` serves both from the local cache."""
    if format is not None:
        if format not in FORMATS:
            raise InputError(f"unknown format {format!r}; known: {', '.join(FORMATS)}")
        return FORMATS[format](source, **kwargs)
    if isinstance(source, list | tuple):
        raise InputError("a list of per-layer files needs format='gemmascope', 'gemmascope2' "
                         "or 'sae_lens'")
    path = Path(str(source)).expanduser()
    if path.exists():
        return FORMATS[detect_format(path)](path, **kwargs)
    if str(source).startswith((".", "/", "~")) or str(source).count("/") < 1:
        raise TranscoderFormatError(missing_path(path))
    try:
        return circuit_tracer.load(str(source), **kwargs)
    except TranscoderFormatError as error:
        if "config.yaml" not in str(error):
            raise
    # no config.yaml: fetch the repo (or its subfolder, e.g. GemmaScope-2's clt/<variant>)
    ref, _, at = str(source).partition("@")
    parts = ref.strip("/").split("/")
    repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
    patterns = [f"{sub}/{p}" if sub else p for p in ("*.yaml", "*.json", "*.safetensors",
                                                       "*.npz")] \
        + ([f"{sub}/*/*.json", f"{sub}/*/*.safetensors"] if sub else [])
    path = hub_snapshot(repo, at or kwargs.pop("revision", None), patterns) / sub
    return FORMATS[detect_format(path)](path, **kwargs)


@checked
def save_transcoder(transcoder: Transcoder, path: str | Path) -> None:
    """A CLT in the mntss layout, a per-layer set in circuit-tracer's."""
    if transcoder.cfg.cross_layer:
        mntss.save_model(transcoder, path)
    else:
        circuit_tracer.save(transcoder, path)


register_layouts(load_transcoder, save_transcoder)

__all__ = ["FORMATS", "LayoutDetector", "TranscoderFormatError", "TranscoderLoader",
           "detect_format", "load_transcoder", "save_transcoder"]
