"""What each layout module gives the registry in :mod:`.formats`: a loader and a detector.

    def load(source, *, device="cpu", dtype=torch.float32, **layout_options) -> Transcoder
    def is_layout(path: Path) -> bool
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..transcoder import Transcoder


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
