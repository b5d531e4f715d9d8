"""The noise unit ``sigma``.

ROME's sigma (the default) is the standard deviation over all elements of the input-embedding
module's outputs for the subject strings tokenized alone (no special tokens) — the spread of the
embeddings a subject actually uses. The embedding matrix's standard deviation is an option with
its own name; the seed shows the two differ enough that 3 sigma of the matrix fails to corrupt
some models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..models import get_adapter, get_module

SIGMA_METHODS = ("rome", "embedding_matrix")


@torch.no_grad()
def rome_sigma(model: nn.Module, tokenizer, subjects: Sequence[str]) -> float:
    """Std of the input-embedding outputs of ``subjects`` tokenized alone."""
    embed = get_module(model, get_adapter(model).embed)
    device = next(model.parameters()).device
    outputs = []
    for subject in subjects:
        ids = tokenizer(subject, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.numel() == 0:
            raise ValueError(f"subject {subject!r} tokenizes to nothing")
        outputs.append(embed(ids.to(device)).float().reshape(-1))
    return float(torch.cat(outputs).std())


@torch.no_grad()
def embedding_matrix_sigma(model: nn.Module) -> float:
    """Std of the input-embedding weight matrix."""
    embed = get_module(model, get_adapter(model).embed)
    return float(embed.weight.float().std())


def resolve_sigma(sigma: str | float, model: nn.Module, tokenizer, subject: str | None) -> float:
    """A number for ``sigma`` given as ``"rome"``, ``"embedding_matrix"`` or a number."""
    if isinstance(sigma, (int, float)):
        return float(sigma)
    if sigma == "rome":
        if subject is None:
            raise ValueError("sigma 'rome' needs a subject")
        return rome_sigma(model, tokenizer, [subject])
    if sigma == "embedding_matrix":
        return embedding_matrix_sigma(model)
    raise ValueError(f"sigma must be a number or one of {SIGMA_METHODS}, got {sigma!r}")
