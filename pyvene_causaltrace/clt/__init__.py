"""Cross-layer transcoders: the module, its exact loader and writer, and checks.

    from pyvene_causaltrace.clt import CrossLayerTranscoder
    clt = CrossLayerTranscoder.from_pretrained("mntss/clt-llama-3.2-1b-524k")
"""

from __future__ import annotations

from .config import CLTConfig
from .loaders import CLTFormatError, from_pretrained, load_from_disk, read_config, save_model
from .transcoder import CLTMismatchError, CrossLayerTranscoder, check_fits

__all__ = [
    "CLTConfig",
    "CLTFormatError",
    "CLTMismatchError",
    "CrossLayerTranscoder",
    "check_fits",
    "from_pretrained",
    "load_from_disk",
    "read_config",
    "save_model",
]
