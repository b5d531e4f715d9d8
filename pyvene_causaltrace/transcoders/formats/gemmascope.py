"""GemmaScope transcoders: one ``params.npz`` per layer (``google/gemma-scope-2b-pt-transcoders``).

    root/layer_{l}/width_16k/average_l0_{N}/params.npz
        W_enc [D, F]   W_dec [F, D]   b_enc [F]   b_dec [D]   threshold [F]

JumpReLU (``relu(z) * 1[z > threshold]``, GemmaScope's and sae-lens's: our ``z * 1[z >
threshold]`` once negative thresholds are raised to 0, done here), reading TransformerLens's
``ln2.hook_normalized`` (the MLP norm's input over its RMS, before the gain) and writing
``hook_mlp_out`` (after Gemma-2's post-feedforward norm) — circuit-tracer's and sae-lens's
reading of these files. A root with
several ``average_l0_*`` variants of a layer needs a choice: pass the files, one per layer.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from ...finite import check_weight, dtype_error
from ..transcoder import Transcoder
from .common import (
    LayerSlicer,
    LayerTensors,
    TranscoderFormatError,
    assemble_set,
    existing,
    in_layer_order,
    named_layers,
    resolve_reference,
)

INPUT_HOOK = "ln2.hook_normalized"
OUTPUT_HOOK = "hook_mlp_out"
KEYS = ("W_enc", "W_dec", "b_enc", "b_dec", "threshold")


def read_npz(path: Path) -> LayerTensors:
    """One GemmaScope file in our orientation (``W_enc`` transposed to ``[F, D]``), thresholds
    below 0 raised to 0."""
    try:
        with np.load(existing(path)) as data:
            arrays = {key.lower(): data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise TranscoderFormatError(f"{path} is not a readable npz file: {error}") from None
    missing = [key for key in KEYS if key.lower() not in arrays]
    if missing:
        raise TranscoderFormatError(f"{path}: missing {', '.join(missing)} "
                                    f"(holds {sorted(arrays)})")
    tensors = {}
    for key in KEYS:
        array = arrays[key.lower()]
        try:
            tensors[key] = torch.from_numpy(np.ascontiguousarray(array))
        except TypeError:  # a dtype torch has no tensor for (a float8 stored as raw bytes)
            raise dtype_error(path, key, f"numpy {array.dtype}") from None
        check_weight(tensors[key], path, key)
    if tensors["W_enc"].dim() != 2:
        raise TranscoderFormatError(f"{path}: W_enc has shape {tuple(tensors['W_enc'].shape)}")
    return LayerTensors(str(path), W_enc=tensors["W_enc"].T, W_dec=tensors["W_dec"],
                        b_enc=tensors["b_enc"], b_dec=tensors["b_dec"],
                        threshold=tensors["threshold"].clamp(min=0))


def _layer_dirs(root: Path) -> dict[int, Path]:
    return named_layers([(int(p.name.removeprefix("layer_")), p) for p in root.glob("layer_*")
                         if p.is_dir() and p.name.removeprefix("layer_").isdecimal()])


def is_layout(path: Path) -> bool:
    """A directory of ``layer_{l}/.../params.npz`` files."""
    return path.is_dir() and any(any(d.rglob("params.npz")) for d in _layer_dirs(path).values())


def _files(root: Path) -> list[Path]:
    files = []
    for folder in in_layer_order(_layer_dirs(root), f"{root}: missing layer_<l> directories"):
        found = sorted(folder.rglob("params.npz"))
        if len(found) != 1:
            raise TranscoderFormatError(
                f"{folder}: {len(found)} params.npz files "
                f"({', '.join(str(f.relative_to(root)) for f in found) or 'none'}); pass one "
                "file per layer instead")
        files.append(found[0])
    return files


def load(source: str | Path | list, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", model_name: str = "gemma-2-2b",
         scan: str | None = None, shard: tuple[int, int] | None = None,
         **_ignored) -> Transcoder:
    """A per-layer set from GemmaScope files: a root directory (one ``params.npz`` under each
    ``layer_{l}``) or a list of files, one per layer in order (local paths or ``hf://`` hub
    references). ``shard=(rank, world)``: each layer's slice is cut as the layer is read (an
    npz file is read whole, one layer at a time: the peak is one layer, not the set)."""
    if isinstance(source, list | tuple):
        files = [resolve_reference(str(ref)) for ref in source]
    else:
        files = _files(Path(source).expanduser())
    slicer = LayerSlicer(shard)
    return assemble_set(
        [slicer(read_npz(path)) for path in files], model_name=model_name,
        activation="jumprelu", feature_input_hook=INPUT_HOOK, feature_output_hook=OUTPUT_HOOK,
        scan=scan, source=str(source), dtype=dtype, device=device, lazy_decoder=False,
        **slicer.options)
