"""What produced a result: fingerprints of the model, tokenizer, transcoder and package, which a
resumable run stores beside its rows and must match to resume. They identify content, not
names (another spelling of a path is the same model; other weights there are not).
:func:`model_fingerprint` hashes every parameter's name, shape, dtype and a fixed sample of at
most 4,096 evenly spaced values, the whole tensor spanned (cheap, yet it changes when an edit
touches a tensor near its sample); :func:`tokenizer_fingerprint` the vocabulary and special
tokens; :func:`package_version`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

SAMPLE = 4096


def tensors_fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hash of each tensor's name, shape, dtype and a fixed sample of its values."""
    digest = hashlib.sha256()
    for name, tensor in named:
        flat = tensor.detach().reshape(-1)
        step = max(1, -(-flat.numel() // SAMPLE))  # the samples span the whole tensor
        sample = flat[::step][:SAMPLE].to("cpu", torch.float64)
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:20]


def model_fingerprint(model: nn.Module) -> str:
    """Fingerprint of ``model``'s weights (see module docstring)."""
    return tensors_fingerprint(sorted(model.state_dict().items()))


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Fingerprint of ``tokenizer``'s vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    text = json.dumps([vocab, special], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def package_version() -> str:
    try:
        return version("pyvene-causaltrace")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def transcoder_fingerprint(transcoder) -> str:
    """Fingerprint of a transcoder's tensors (encoder, thresholds, biases, decoders, skip, a
    joint top-k's score weights)."""
    named = [("b_enc", transcoder.b_enc), ("threshold", transcoder.threshold),
             ("b_dec", transcoder.b_dec)]
    if transcoder.W_enc is not None:
        named.append(("W_enc", transcoder.W_enc))
    named += [(f"W_dec.{layer}", w) for layer, w in enumerate(transcoder.W_dec)]
    named += [(f"W_skip.{layer}", w) for layer, w in enumerate(transcoder.W_skip or [])]
    if getattr(transcoder, "score_weight", None) is not None:  # joint_topk's ranking weights
        named.append(("score_weight", transcoder.score_weight))
    return tensors_fingerprint(named)
