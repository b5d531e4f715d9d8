"""Transcoders: cross-layer (CLT) and per-layer sets (PLT, optionally with skip), one module;
loaders for every layout people publish; pairing and replacement checks; fitting.

    from pyvene_causaltrace.transcoders import load_transcoder
    clt = load_transcoder("mntss/clt-llama-3.2-1b-524k")
    plt = load_transcoder("path/to/circuit-tracer/config.yaml")
"""

from __future__ import annotations

from ..errors import TranscoderFormatError, TranscoderMismatchError
from .config import TranscoderConfig
from .formats import (
    FORMATS,
    LayoutDetector,
    TranscoderLoader,
    detect_format,
    load_transcoder,
    save_transcoder,
)
from .formats.mntss import from_pretrained, load_from_disk, read_config, save_model
from .lorsa import load_lorsa, lorsa_fvu, save_lorsa
from .transcoder import Transcoder, check_fits, feature_range

__all__ = [
    "FORMATS",
    "LayoutDetector",
    "Transcoder",
    "TranscoderConfig",
    "TranscoderFormatError",
    "TranscoderLoader",
    "TranscoderMismatchError",
    "check_fits",
    "detect_format",
    "feature_range",
    "from_pretrained",
    "load_from_disk",
    "load_lorsa",
    "load_transcoder",
    "lorsa_fvu",
    "read_config",
    "save_lorsa",
    "save_model",
    "save_transcoder",
]
