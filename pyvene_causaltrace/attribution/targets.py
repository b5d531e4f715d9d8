"""What an attribution graph explains: a fixed linear function of the last position's logits.

A :class:`Target` is a coefficient vector ``c`` over the vocabulary, chosen once on the clean
logits and then held fixed, so ``target = c . logits[-1]`` is linear in the leaves of the local
replacement model. Two constructions:

- :func:`demeaned_logit`: the answer's logit minus the mean of the top-``k`` logits (k = 10): a
  direction that raises every logit equally does not change the prediction.
  (circuit-tracer demeans by the vocabulary mean instead: ``demean="vocab"``.)
- :func:`logit_difference`: ``logit[token] - logit[other]``.

:func:`make_target` picks one by name (:data:`TARGET_KINDS`) for a prompt's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import InputError
from ..prompts import answer_token_id

if TYPE_CHECKING:  # transformers takes seconds to import; only the annotations need it
    from transformers import PreTrainedTokenizerBase

#: The target kinds :func:`make_target` builds.
TARGET_KINDS = ("demeaned", "demeaned_vocab", "difference")


@dataclass(frozen=True)
class Target:
    """``coefficients`` ``[V]`` on the last position's logits; ``token`` is the answer."""

    name: str
    token: int
    coefficients: torch.Tensor

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's value from ``[1, P, V]`` (or ``[P, V]``) logits."""
        last = logits[..., -1, :].reshape(-1)
        return last @ self.coefficients.to(last.device, last.dtype)

    def describe(self) -> dict:
        nonzero = self.coefficients.nonzero().squeeze(-1).tolist()
        return {"name": self.name, "token": self.token,
                "coefficients": {int(i): float(self.coefficients[i]) for i in nonzero}}


def demeaned_logit(logits: torch.Tensor, token: int, k: int = 10,
                   demean: str = "topk") -> Target:
    """``logit[token] - mean(top-k logits)`` (``demean="topk"``, our default) or
    ``logit[token] - mean(all logits)`` (``demean="vocab"``, circuit-tracer's)."""
    last = logits.detach()[..., -1, :].reshape(-1).float()
    vocab = last.numel()
    if not 0 <= token < vocab:
        raise InputError(f"token id {token} is outside the vocabulary (size {vocab})")
    c = torch.zeros(vocab)
    if demean == "topk":
        if not 1 <= k <= vocab:
            raise InputError(f"k must be in 1..{vocab}, got {k}")
        c[last.topk(k).indices.cpu()] -= 1.0 / k
        name = f"demeaned logit (top-{k})"
    elif demean == "vocab":
        c -= 1.0 / vocab
        name = "demeaned logit (vocabulary mean)"
    else:
        raise InputError(f"demean must be 'topk' or 'vocab', got {demean!r}")
    c[token] += 1.0
    return Target(name, int(token), c)


def logit_difference(vocab_size: int, token: int, other: int) -> Target:
    """``logit[token] - logit[other]``."""
    if token == other:
        raise InputError("a logit difference needs two different tokens")
    for t in (token, other):
        if not 0 <= t < vocab_size:
            raise InputError(f"token id {t} is outside the vocabulary (size {vocab_size})")
    c = torch.zeros(vocab_size)
    c[token], c[other] = 1.0, -1.0
    return Target(f"logit difference ({token} - {other})", int(token), c)


def make_target(logits: torch.Tensor, tokenizer: PreTrainedTokenizerBase, answer: str | None,
                *, kind: str = "demeaned", other: str | None = None, k: int = 10) -> Target:
    """The target on clean ``logits``: ``kind`` is ``"demeaned"`` (top-k, the default),
    ``"demeaned_vocab"`` or ``"difference"`` (``answer`` minus ``other``). No ``answer``: the
    clean argmax."""
    token = (int(logits[0, -1].argmax()) if answer is None
             else answer_token_id(tokenizer, answer, strict=True))
    if kind == "demeaned":
        return demeaned_logit(logits, token, k)
    if kind == "demeaned_vocab":
        return demeaned_logit(logits, token, demean="vocab")
    if kind == "difference":
        if other is None:
            raise InputError("a logit-difference target needs the other token (other=...)")
        return logit_difference(logits.shape[-1], token,
                                answer_token_id(tokenizer, other, strict=True))
    raise InputError(f"target kind must be demeaned, demeaned_vocab or difference, got {kind!r}")
