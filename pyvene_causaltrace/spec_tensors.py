"""Tensors in a JSON spec: inline as nested lists, or in a safetensors file beside the JSON.

Inline is exact: a float32 becomes a Python float whose JSON repr reads back to the same bits.
A spec saved by :func:`~pyvene_causaltrace.specs.save_spec` moves tensors over
:data:`INLINE_LIMIT` elements (and those holding NaN or infinity, which JSON cannot write) into
``<spec>.safetensors``, referenced as ``{"dtype", "shape", "file", "key", "sha256"}``; a file
changed since is refused by its checksum. Nothing is pickled.
"""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import InputError, SpecError

#: Tensors with more elements than this go to the safetensors file when a spec is saved.
INLINE_LIMIT = 4096

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: Where the entries that hold tensors sit in a spec.
ENTRY_PATH = "$.model_interventions"


def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}``: the tensor inline as nested lists (exact)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype not in _DTYPE_NAMES:
        raise InputError(f"a {tensor.dtype} tensor cannot go in a spec (supported: "
                         f"{', '.join(DTYPES)})")
    return {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
            "data": tensor.tolist()}


def digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(raw.view(torch.uint8).numpy().tobytes()).hexdigest()


def decode_tensor(encoded: dict[str, Any], where: str, base_dir: str | Path | None) -> torch.Tensor:
    """The tensor of an inline or file entry; a :class:`SpecError` at ``where`` when its data,
    file, dtype, shape or checksum do not fit."""
    dtype = DTYPES.get(encoded.get("dtype"))
    if dtype is None:
        raise SpecError(where + ".dtype", f"{encoded.get('dtype')!r} is not one of "
                        f"{', '.join(DTYPES)}")
    shape = list(encoded.get("shape", []))
    if "data" in encoded:
        try:
            tensor = torch.tensor(encoded["data"], dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as error:
            raise SpecError(where + ".data", f"not a {encoded['dtype']} array: {error}") from None
        if list(tensor.shape) != shape:
            raise SpecError(where + ".data", f"holds shape {list(tensor.shape)}, the entry says "
                            f"{shape}")
        if not _exact(encoded["data"], tensor):
            raise SpecError(where + ".data", f"holds values a {encoded['dtype']} cannot hold "
                            "(a fraction or a boolean in integers, a number in booleans, a "
                            "finite number that overflows): it would be rounded silently")
        return tensor
    tensor = _read_file_tensor(encoded, where, base_dir)
    if tensor.dtype != dtype or list(tensor.shape) != shape:
        raise SpecError(where, f"{encoded['file']}[{encoded['key']!r}] is "
                        f"{_DTYPE_NAMES.get(tensor.dtype, tensor.dtype)} {list(tensor.shape)}, "
                        f"the entry says {encoded['dtype']} {shape}")
    if "sha256" in encoded and digest(tensor) != encoded["sha256"]:
        raise SpecError(where, f"{encoded['file']}[{encoded['key']!r}] does not match its "
                        "sha256: the file was changed or belongs to another spec")
    return tensor


def _exact(data: Any, tensor: torch.Tensor) -> bool:
    """Whether inline ``data`` is what ``tensor`` (made from it) holds, up to a float dtype's
    rounding: torch truncates 1.7 to an int64 1, makes 2 a True and 1e300 a float32 inf."""
    values, stack = [], [data]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        else:
            values.append(value)
    if tensor.dtype == torch.bool:
        return all(isinstance(v, bool) for v in values)
    if any(isinstance(v, bool) for v in values):
        return False
    if not tensor.dtype.is_floating_point:
        return all(isinstance(v, int) for v in values)
    return not bool((tensor.isinf() & torch.tensor(data, dtype=torch.float64).isfinite()).any())


def _read_file_tensor(encoded: dict, where: str, base_dir: str | Path | None) -> torch.Tensor:
    name = encoded.get("file")
    if not isinstance(name, str) or "key" not in encoded:
        raise SpecError(where, "a tensor needs 'data', or 'file' and 'key'")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise SpecError(where + ".file", f"{name!r} must be a path inside the spec's folder")
    if base_dir is None:
        raise SpecError(where + ".file", f"{name!r} is relative to the spec file's folder, which "
                        "this spec does not know: load it with load_spec(path)")
    path = Path(base_dir) / relative
    if not path.is_file():
        raise SpecError(where + ".file", f"{path} does not exist (it is written beside the "
                        "spec's JSON by save_spec)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            if encoded["key"] not in handle.keys():
                raise SpecError(where + ".key", f"{path} holds no tensor {encoded['key']!r}")
            return handle.get_tensor(encoded["key"]).clone()
    except SafetensorError as error:
        raise SpecError(where + ".file", f"{path} is not a readable safetensors file: "
                        f"{error}") from None


def _needs_file(encoded: dict[str, Any]) -> bool:
    """Whether an inline tensor goes to the file: too big, or holding NaN or infinity."""
    if math.prod(encoded["shape"]) > INLINE_LIMIT:
        return True
    floating = encoded["dtype"] in ("float64", "float32", "float16", "bfloat16")
    return floating and not _finite(encoded["data"])


def _finite(data: Any) -> bool:
    if isinstance(data, list):
        return all(_finite(item) for item in data)
    return not isinstance(data, float) or math.isfinite(data)


def _tensor_slots(entries: list[dict]):
    """``(entry index, group, name, encoded)`` of every tensor in ``entries``."""
    for index, entry in enumerate(entries):
        for group in ("tensors", "tensor_attributes"):
            for name, encoded in entry.get(group, {}).items():
                yield index, group, name, encoded


def externalize(entries: list[dict], file_name: str, base_dir: str | Path | None
                ) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """``entries`` for a spec saved as a file: big and non-finite tensors become references to
    ``file_name`` (returned as ``{key: tensor}`` to write beside the JSON); references into an
    earlier file (relative to ``base_dir``) are read and written anew."""
    out = copy.deepcopy(entries)
    tensors: dict[str, torch.Tensor] = {}
    for index, group, name, encoded in _tensor_slots(out):
        if "data" in encoded and not _needs_file(encoded):
            continue
        where = f"{ENTRY_PATH}[{index}].{group}.{name}"
        tensor = decode_tensor(encoded, where, base_dir)
        key = f"model_interventions.{index}.{group}.{name}"
        tensors[key] = tensor.contiguous()
        out[index][group][name] = {"dtype": encoded["dtype"], "shape": encoded["shape"],
                                   "file": file_name, "key": key, "sha256": digest(tensor)}
    return out, tensors


def inline(entries: list[dict], base_dir: str | Path | None) -> list[dict]:
    """``entries`` with every file reference read back inline."""
    out = copy.deepcopy(entries)
    for index, group, name, encoded in _tensor_slots(out):
        if "data" not in encoded:
            tensor = decode_tensor(encoded, f"{ENTRY_PATH}[{index}].{group}.{name}", base_dir)
            out[index][group][name] = encode_tensor(tensor)
    return out


__all__ = ["DTYPES", "ENTRY_PATH", "INLINE_LIMIT", "decode_tensor", "digest", "encode_tensor",
           "externalize", "inline"]
