"""What every layout's loader shares: the format error, safetensors access (headers, memory-mapped
tensors), hub references resolved through huggingface_hub, and assembling per-layer tensors into
one checked :class:`~..transcoder.Transcoder`."""

from __future__ import annotations

import json
import math
import mmap
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open

from ...errors import InputError, TranscoderFormatError
from ...finite import check_weight, dtype_error
from ..config import TRANSCODER_SET, TranscoderConfig
from ..transcoder import Transcoder, feature_range

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: safetensors' names of the dtypes we refuse, as torch names them (for the error).
STORED_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
                "I64": "int64", "U16": "uint16", "U32": "uint32", "U64": "uint64",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64"}
#: Tensors that hold settings, not weights (circuit-tracer's integer ``k``): not dtype-checked.
SETTING_TENSORS = ("k",)
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F64": torch.float64}


class LayerSlicer:
    """A rank's slice of each layer of a per-layer set, cut as each layer is read (so a sharded
    load holds one whole layer at a time, never the whole set): ``slicer(layer)`` returns the
    layer with features ``[lo, hi)`` (copies: the whole layer's memory is freed), every layer's
    width checked against the first's; ``slicer.options`` are :func:`assemble_set`'s."""

    def __init__(self, shard: tuple[int, int] | None) -> None:
        if shard is not None and (not isinstance(shard, tuple | list) or len(shard) != 2):
            raise InputError(f"shard must be (rank, world), got {shard!r}")
        self.shard = shard
        self.width: int | None = None
        self.range: tuple[int, int] | None = None

    def __call__(self, layer: LayerTensors) -> LayerTensors:
        if self.shard is None:
            return layer
        width = int(layer.W_enc.shape[0])
        if self.width is None:
            self.width, self.range = width, feature_range(width, *self.shard)
        elif width != self.width:
            raise TranscoderFormatError(f"{layer.origin}: {width} features, the first layer "
                                        f"{self.width}")
        lo, hi = self.range

        def cut(tensor):
            return None if tensor is None else tensor[lo:hi].clone()

        mapped = bool(layer.handles)
        return LayerTensors(layer.origin, W_enc=cut(layer.W_enc),
                            W_dec=layer.W_dec[lo:hi] if mapped else cut(layer.W_dec),
                            b_enc=cut(layer.b_enc), b_dec=layer.b_dec,
                            threshold=cut(layer.threshold), W_skip=layer.W_skip,
                            handles=layer.handles)

    @property
    def options(self) -> dict:
        """``features`` and ``d_transcoder`` for :func:`assemble_set` (none when whole)."""
        return {} if self.shard is None else {"features": self.range, "d_transcoder": self.width}


#: More layers than any model has (the largest have about 130): a layer number parsed from a
#: file or folder name at or past it is refused before anything is sized by it (the list of
#: layers missing below ``layer_900000000000`` once grew to 21 GB).
MAX_LAYERS = 1000


def named_layers(found: dict[int, Path] | list[tuple[int, Path]], limit: int | None = None,
                 source: str = "") -> dict[int, Path]:
    """``found`` (``{layer number parsed from its name: path}``, or its ``(layer, path)``
    pairs) once every number is below :data:`MAX_LAYERS` and ``limit`` (a config's layer count,
    ``source`` saying which, where known) and no two pairs name one layer (``layer_1`` and
    ``layer_01``: one would be read, unsaid); else a :class:`TranscoderFormatError` naming the
    files."""
    if not isinstance(found, dict):
        pairs, found = found, {}
        for layer, path in sorted(pairs, key=lambda pair: str(pair[1])):
            if layer in found:
                raise TranscoderFormatError(f"{found[layer]} and {path} both name layer {layer};"
                                            " remove one")
            found[layer] = path
    bound = MAX_LAYERS if limit is None else min(limit, MAX_LAYERS)
    for layer, path in found.items():
        if layer >= bound:
            why = (f"{source} says {limit} layers" if limit is not None and limit <= MAX_LAYERS
                   else f"no model has {MAX_LAYERS} layers")
            raise TranscoderFormatError(f"{path}: its name says layer {layer}, but {why}; "
                                        "rename or remove it")
    return found


def encoder_layers(root: Path, limit: int | None = None, source: str = "") -> int:
    """How many layers' ``W_enc_{l}.safetensors`` (mntss's and ByteDance's encoders) ``root``
    holds, once they are layers 0..L-1 (``limit``, ``source``: :func:`named_layers`')."""
    layers = sorted(named_layers([(int(p.stem.removeprefix("W_enc_")), p)
                                  for p in root.glob("W_enc_*.safetensors")
                                  if p.stem.removeprefix("W_enc_").isdecimal()], limit, source))
    if not layers or layers != list(range(len(layers))):
        raise TranscoderFormatError(f"{root}: encoder files for layers {layers}; expected "
                                    "W_enc_0 .. W_enc_<L-1>")
    return len(layers)


def in_layer_order(found: dict, what: str) -> list:
    """``found``'s values (``{layer: item}``) in layer order once its layers are 0..L-1; else a
    :class:`TranscoderFormatError`: ``what`` (the folder and the files it lacks) "for layer(s)"
    the missing ones."""
    missing = sorted(set(range(max(found) + 1)) - set(found)) if found else [0]
    if missing:
        raise TranscoderFormatError(f"{what} for layer(s) {missing}")
    return [found[layer] for layer in range(len(found))]


def existing(path: Path) -> Path:
    """``path``, or a :class:`TranscoderFormatError` when there is no such file."""
    if not Path(path).exists():
        raise TranscoderFormatError(f"missing file {path}")
    return path


def transcoder_config(where, *fields, **options) -> TranscoderConfig:
    """A :class:`TranscoderConfig`; its refusal is a :class:`TranscoderFormatError` naming
    ``where``."""
    try:
        return TranscoderConfig(*fields, **options)
    except ValueError as error:
        raise TranscoderFormatError(f"{where}: {error}") from None


def refuse_shard(transcoder: Transcoder) -> None:
    """A shard holds some features of each layer: writing it as a transcoder would lose the
    rest."""
    if transcoder.features is not None:
        raise InputError(f"this transcoder is a shard (features {transcoder.features} of "
                         f"{transcoder.cfg.d_transcoder} per layer); write the whole one")


def check_shapes(where: object, shapes: dict, want: dict, what: str) -> None:
    """Refuse, naming ``where``, tensors whose shapes (``shapes``) are not ``want``'s or that
    ``want`` does not name: they disagree with ``what``."""
    wrong = {name: shapes.get(name) for name in [*want, *shapes]
             if shapes.get(name) != want.get(name)}
    if wrong:
        raise TranscoderFormatError(f"{where}: shapes {wrong} disagree with {what} (expected "
                                    f"{want})")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise InputError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")


# ------------------------------------------------------------------------------ safetensors
def open_safetensors(path: Path):
    """A ``safe_open`` handle, or a :class:`TranscoderFormatError` naming the file."""
    try:
        return safe_open(str(existing(path)), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise TranscoderFormatError(f"{path} is not a readable safetensors file: {error}") \
            from None


def shapes_of(handle) -> dict[str, tuple[int, ...]]:
    return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


def read_tensors(path: Path, names=None, features: tuple[int, int] | None = None,
                 axes: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (or ``names``) of a safetensors file; format errors name the file. With
    ``features=(lo, hi)`` each tensor named in ``axes`` is cut to those features along its
    feature axis ``axes[name]`` as it is read (:func:`read_features`); the others are whole.
    Every tensor is checked as it is read (:func:`~...finite.check_weight`: dtype, NaN/inf)."""
    handle = open_safetensors(path)
    axes = axes or {}
    with reading(path):
        return {name: check_weight(read_features(handle, name, features, axes.get(name)),
                                   path, name)
                for name in (names or handle.keys())}


def norm_factor(path: Path, name: str, tensors: dict, d_model: int) -> float:
    """llamascopium's ``sqrt(d_model) / norm`` of the dataset's average norm ``tensors[name]``
    (``dataset_average_activation_norm.<hook>``), refused unless the norm is positive (0
    divides by zero, a negative one flips the signs the fold keeps)."""
    norm = float(tensors[name])
    if not norm > 0:
        raise TranscoderFormatError(f"{path}: {name} is {norm:g}: not a positive norm (a "
                                    "damaged file)")
    return math.sqrt(d_model) / norm


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 at least (float64 kept): what a fold of stored weights is
    computed in, so a half-precision file is rounded once, at the cast to the dtype asked."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


@contextmanager
def reading(path: Path):
    """Errors of reading tensors (a truncated data section surfaces only then) as a
    :class:`TranscoderFormatError` naming the file."""
    try:
        yield
    except TranscoderFormatError:
        raise
    except Exception as error:
        raise TranscoderFormatError(f"{path}: could not read tensors: {error}") from None


def check_stored_dtypes(path: Path, handle, names=None) -> None:
    """Refuse (naming the file and tensor) a tensor of ``names`` (default: every one but
    :data:`SETTING_TENSORS`) whose header dtype is not a weight dtype, before it is read: for
    what is memory-mapped or handed to another library that would cast it."""
    for name in names or [key for key in handle.keys() if key not in SETTING_TENSORS]:
        code = str(handle.get_slice(name).get_dtype())
        if code not in TORCH_DTYPES:
            raise dtype_error(path, name, STORED_NAMES.get(code, code))


def read_features(handle, name: str, features: tuple[int, int] | None,
                  axis: int | None = 0) -> torch.Tensor:
    """Tensor ``name`` of a ``safe_open`` handle, or (``features=(lo, hi)``, ``axis`` not None)
    only its entries ``[lo, hi)`` along ``axis``, through ``get_slice``: only those bytes are
    read. Either is a view of the file's map: copy (stack, clone, ``.to``) before keeping it."""
    if features is None or axis is None:
        return handle.get_tensor(name)
    return handle.get_slice(name)[(slice(None),) * axis + (slice(*features),)]


@dataclass(frozen=True)
class MappedFile:
    """A read-only memory map of a safetensors file and the tensor of it that is mapped: a
    Transcoder holds one per layer of a memory-mapped decoder, and checks each row it gathers
    naming ``origin`` (file, tensor)."""

    mapped: mmap.mmap
    origin: tuple[str, str]


def mmap_tensor(path: Path, name: str, features: tuple[int, int] | None = None
                ) -> tuple[torch.Tensor, MappedFile]:
    """``(tensor, map)``: ``name`` from a safetensors file (its rows ``[lo, hi)`` with
    ``features``) as a view of a read-only memory map advised for random access (decoder rows
    are read a few at a time, scattered over the file).
    The layout is safetensors': an 8-byte header length, a JSON header, then raw data. Its
    dtype is checked here; its values as rows are read (:meth:`~..Transcoder.decoder_rows`)."""
    with open(path, "rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(header_len))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    info = header[name]
    if info["dtype"] not in TORCH_DTYPES:
        raise dtype_error(path, name, STORED_NAMES.get(info["dtype"], info["dtype"]))
    start, stop = (8 + header_len + offset for offset in info["data_offsets"])
    dtype = TORCH_DTYPES[info["dtype"]]
    with warnings.catch_warnings():  # the buffer is read-only; we never write to it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapped, dtype=dtype, count=(stop - start) // dtype.itemsize,
                                offset=start)
    tensor = flat.view(info["shape"])
    if features is not None:
        tensor = tensor[features[0]:features[1]]  # a view: nothing read
    return tensor, MappedFile(mapped, (str(path), name))


def read_decoders(files: list[tuple[Path, str]], features: tuple[int, int] | None, *,
                  lazy_decoder: bool, device: str | torch.device, dtype: torch.dtype,
                  first_targets: list[int] | None = None
                  ) -> tuple[list[torch.Tensor], list[MappedFile]]:
    """A CLT's decoders, ``(file, tensor name)`` per layer in layer order: each one's rows
    ``[lo, hi)`` with ``features`` (only those are read), its targets from
    ``first_targets[layer]`` on when given (a file holding every layer's). With
    ``lazy_decoder`` each is a view of its file's memory map (:func:`mmap_tensor`; the maps are
    returned, one per layer, for ``Transcoder._handles``), else read, checked and copied to
    ``device`` and ``dtype`` (no maps)."""
    W_dec, maps = [], []
    for layer, (path, name) in enumerate(files):
        if lazy_decoder:
            w, mapped = mmap_tensor(path, name, features)
            maps.append(mapped)
        else:  # a view of safetensors' map of the file: copied below
            w = read_tensors(path, [name], features, {name: 0})[name]
        if first_targets is not None:
            w = w[:, first_targets[layer]:]
        W_dec.append(w if lazy_decoder else w.to(device, dtype, copy=True))
    return W_dec, maps


# ------------------------------------------------------------------------------------- hub
def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no")


def hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One file of a hub repo, downloaded or (``HF_HUB_OFFLINE=1``) from the local cache."""
    from huggingface_hub import hf_hub_download  # ~0.3 s to import; only hub references need it
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError  # likewise

    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except (LocalEntryNotFoundError, EntryNotFoundError, OSError) as error:
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline() else ""
        raise TranscoderFormatError(
            f"missing file {filename!r} of hub repo {repo_id!r}{hint}: {error}") from None


def hub_snapshot(repo_id: str, revision: str | None = None,
                 allow_patterns: list[str] | None = None) -> Path:
    """A hub repo's files (matching ``allow_patterns``), downloaded or from the local cache."""
    from huggingface_hub import snapshot_download  # ~0.3 s to import; only hub references need it
    from huggingface_hub.errors import LocalEntryNotFoundError  # likewise

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns))
    except (LocalEntryNotFoundError, OSError, ValueError) as error:
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline() else ""
        raise TranscoderFormatError(f"{repo_id!r} is neither a local path nor a reachable hub "
                                    f"repo{hint}: {error}") from None


def resolve_reference(ref: str, base: Path | None = None) -> Path:
    """A file named by a config: ``hf://org/repo/path/in/repo`` (``org/repo@revision/...`` for a
    revision) through the hub cache, else a path (relative to ``base``)."""
    if ref.startswith("hf://"):
        parts = ref.removeprefix("hf://").split("/")
        if len(parts) < 3:
            raise TranscoderFormatError(f"bad hub reference {ref!r}: need hf://org/repo/file")
        repo, revision = f"{parts[0]}/{parts[1]}", None
        if "@" in repo:
            repo, revision = repo.split("@", 1)
        return hub_file(repo, "/".join(parts[2:]), revision)
    path = Path(ref).expanduser()
    return existing(base / path if not path.is_absolute() and base is not None else path)


# ------------------------------------------------------------------------------ assembling
@dataclass
class LayerTensors:
    """One layer of a per-layer set in our orientation: ``W_enc [F, D]``, ``W_dec [F, D]``,
    ``b_enc [F]``, ``b_dec [D]``, ``threshold [F]`` or None, ``W_skip [D, D]`` or None
    (``skip(x) = x @ W_skip.T``); ``origin`` names the file for error messages."""

    origin: str
    W_enc: torch.Tensor
    W_dec: torch.Tensor
    b_enc: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor | None = None
    W_skip: torch.Tensor | None = None
    handles: list = field(default_factory=list)


def assemble_set(layers: list[LayerTensors], *, model_name: str, activation: str,
                 k: int | None = None, feature_input_hook: str, feature_output_hook: str,
                 scan: str | None = None, source: str | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 lazy_decoder: bool = True, features: tuple[int, int] | None = None,
                 d_transcoder: int | None = None,
                 score_weight: torch.Tensor | None = None) -> Transcoder:
    """A per-layer set from its layers, every shape and dtype checked first. With ``features=
    (lo, hi)`` the layers hold only those features of ``d_transcoder`` per layer: a shard.
    ``score_weight [L, F]``: a ``relu_topk`` set's ranking weights (:mod:`..transcoder`)."""
    check_dtype(dtype)
    if not layers:
        raise TranscoderFormatError(f"{source}: no layers")
    width, d_model = layers[0].W_enc.shape
    if features is None:
        d_transcoder = width
    has_skip = layers[0].W_skip is not None
    for index, layer in enumerate(layers):
        want = {"W_enc": (width, d_model), "W_dec": (width, d_model),
                "b_enc": (width,), "b_dec": (d_model,)}
        if layer.threshold is not None:
            want["threshold"] = (width,)
        if layer.W_skip is not None:
            want["W_skip"] = (d_model, d_model)
        check_shapes(f"{layer.origin} (layer {index})",
                     {name: tuple(getattr(layer, name).shape) for name in want}, want,
                     f"layer 0 (d_transcoder {width}, d_model {d_model})")
        if (layer.W_skip is not None) != has_skip:
            raise TranscoderFormatError(f"{layer.origin} (layer {index}): W_skip "
                                        f"{'present' if layer.W_skip is not None else 'missing'}"
                                        f" while layer 0 {'has' if has_skip else 'has none'}")
        if activation == "jumprelu" and layer.threshold is None:
            raise TranscoderFormatError(f"{layer.origin}: a jumprelu transcoder needs thresholds")
        for name in want:
            if not getattr(layer, name).is_floating_point():
                raise TranscoderFormatError(f"{layer.origin}: {name} is "
                                            f"{getattr(layer, name).dtype}, not floating point")
    cfg = transcoder_config(source, model_name, len(layers), d_model, d_transcoder,
                            feature_input_hook, feature_output_hook, TRANSCODER_SET,
                            str(layers[0].W_enc.dtype).removeprefix("torch."), activation, k,
                            has_skip, scan)
    thresholds = None if activation != "jumprelu" else torch.stack(
        [layer.threshold.to(dtype) for layer in layers])
    W_dec = [layer.W_dec[:, None, :] for layer in layers]
    mapped = lazy_decoder and all(layer.handles for layer in layers)
    if not mapped:  # a map read whole here is checked here; the others were at their read
        W_dec = [check_weight(w, *layer.handles[0].origin) if layer.handles else w
                 for w, layer in zip(W_dec, layers, strict=True)]
        W_dec = [w.to(device, dtype).clone() for w in W_dec]
    return Transcoder(
        cfg, b_enc=torch.stack([layer.b_enc.to(dtype) for layer in layers]), threshold=thresholds,
        b_dec=torch.stack([layer.b_dec.to(dtype) for layer in layers]),
        W_enc=torch.stack([layer.W_enc.to(dtype) for layer in layers]), W_dec=W_dec,
        W_skip=[layer.W_skip for layer in layers] if has_skip else None,
        score_weight=score_weight, dtype=dtype, device=device, source=source, features=features,
        handles=[layer.handles[0] for layer in layers] if mapped else None)


def read_yaml_mapping(path: Path, what: str = "a mapping") -> dict:
    """``path``'s YAML mapping, or a :class:`TranscoderFormatError` naming the file (and the
    line and column of a syntax error)."""
    try:
        meta = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        mark = getattr(error, "problem_mark", None)
        reason = getattr(error, "problem", None) or str(error).splitlines()[0]
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise TranscoderFormatError(f"{path} is not YAML: {reason}{where}") from None
    if not isinstance(meta, dict):
        raise TranscoderFormatError(f"{path} is not {what}")
    return meta


def read_json_object(path: Path) -> dict:
    """``path``'s JSON object, or a :class:`TranscoderFormatError` naming the file."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TranscoderFormatError(f"{path} is not JSON: {error}") from None
    if not isinstance(meta, dict):
        raise TranscoderFormatError(f"{path} is not a JSON object")
    return meta
