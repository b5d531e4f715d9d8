"""What an attribution graph explains: fixed linear functions of the model's last states.

A :class:`Target` is a coefficient vector ``c`` on one output of the local replacement model at
one position, chosen on the clean run and held fixed, so ``c . output[pos]`` is linear in the
leaves; one logit node (one row) per target. On ``"logits"``: :func:`demeaned_logit` (the
answer's logit minus the top-``k`` mean, or the vocabulary mean: raising every logit equally
changes nothing) and :func:`logit_difference`; on a residual state, a unit direction
(:func:`direction_target`). :func:`make_targets` builds a graph's targets: the answer's, or
circuit-tracer's salient logits (:func:`salient_logits`), each weighted by its probability."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..arguments import checked
from ..errors import InputError
from ..finite import check_finite, positive_number
from ..prompts import answer_token_id

if TYPE_CHECKING:  # transformers takes seconds to import; only the annotations need it
    from transformers import PreTrainedTokenizerBase

#: The target kinds :func:`make_target` builds.
TARGET_KINDS = ("demeaned", "demeaned_vocab", "difference")
#: Residual-stream outputs a direction target reads (besides the logits).
_SITE = re.compile(r"unembed_input|resid_pre\.(\d+)")
#: The smallest direction norm :func:`direction_target` accepts: ``sqrt`` of float32's smallest
#: normal number (~1.08e-19); below it ``|v|^2`` underflows float32 and products with the
#: model's states lose their precision to subnormals or become 0.
MIN_DIRECTION_NORM = float(torch.finfo(torch.float32).tiny) ** 0.5


@dataclass(frozen=True)
class Target:
    """``coefficients . output[position]`` (module docstring). ``token`` is the logit's vocabulary
    id (a direction's: ``vocab_size + i``, circuit-tracer's virtual index); ``prob`` the real
    model's probability of it (None for a direction); ``weight`` its weight in influence."""

    name: str
    token: int
    coefficients: torch.Tensor
    output: str = "logits"
    position: int = -1
    prob: float | None = None
    weight: float = 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's value from ``[1, P, V]`` (or ``[P, V]``) logits."""
        if self.output != "logits":
            raise InputError(f"{self.name} reads {self.output}, not the logits")
        return self.value(logits)

    def value(self, output: torch.Tensor) -> torch.Tensor:
        """The target's value from its output ``[1, P, N]`` (or ``[P, N]``)."""
        state = output[..., self.position, :].reshape(-1)
        return state @ self.coefficients.to(state.device, state.dtype)

    def seed(self, output: torch.Tensor) -> torch.Tensor:
        """``d value / d output``: the gradient seed, shaped like ``output``."""
        seed = torch.zeros_like(output)
        seed[..., self.position, :] = self.coefficients.to(output.device, output.dtype)
        return seed

    @property
    def is_logit(self) -> bool:
        return self.output == "logits"

    def describe(self) -> dict:
        nonzero = self.coefficients.nonzero().squeeze(-1).tolist()
        return {"name": self.name, "token": self.token,
                "coefficients": {int(i): float(self.coefficients[i]) for i in nonzero},
                "output": self.output, "position": self.position, "prob": self.prob,
                "weight": self.weight, "size": int(self.coefficients.numel())}


@checked
def demeaned_logit(logits: torch.Tensor, token: int, k: int | None) -> Target:
    """``logit[token] - mean(top-k logits)`` (our default target,
    :attr:`~.settings.AttributionSettings.k`) or, with ``k=None``, ``logit[token] - mean(all
    logits)`` (circuit-tracer's)."""
    last = logits.detach()[..., -1, :].reshape(-1).float()
    vocab = last.numel()
    if not 0 <= token < vocab:
        raise InputError(f"token id {token} is outside the vocabulary (size {vocab})")
    c = torch.zeros(vocab)
    if k is None:
        c -= 1.0 / vocab
        name = "demeaned logit (vocabulary mean)"
    else:
        if not 1 <= k <= vocab:
            raise InputError(f"k must be in 1..{vocab}, got {k}")
        c[last.topk(k).indices.cpu()] -= 1.0 / k
        name = f"demeaned logit (top-{k})"
    c[token] += 1.0
    return Target(name, int(token), c)


@checked
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


def direction_target(vector: torch.Tensor, *, output: str = "unembed_input", position: int = -1,
                     name: str = "direction", weight: float = 1.0) -> Target:
    """The projection of a residual-stream state on the unit vector ``vector / |vector|``
    (``vector``: ``[d_model]``) at ``position`` (default the last); ``output`` is
    ``"unembed_input"`` or ``"resid_pre.{l}"``. Its node's token id is set when the graph is built
    (``vocab_size + i``). Normalised in float64, so nothing depends on the vector's scale; a vector
    below :data:`MIN_DIRECTION_NORM` (its squared norm underflows float32) or non-finite is
    refused."""
    if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or vector.numel() == 0:
        raise InputError("a direction target is a 1-D tensor [d_model], got "
                         f"{getattr(vector, 'shape', type(vector).__name__)}")
    if not (vector.is_floating_point() or vector.dtype in (torch.int32, torch.int64)):
        raise InputError(f"the direction target's vector must hold real numbers, got "
                         f"{vector.dtype}")
    if not _SITE.fullmatch(output):
        raise InputError(f"a direction target reads 'unembed_input' or 'resid_pre.<layer>', got "
                         f"{output!r}")
    check_finite(vector, "the direction target's vector",
                 "a direction must be finite (target=, --direction)")
    exact = vector.detach().to("cpu", torch.float64)
    norm = float(exact.norm())
    if not norm >= MIN_DIRECTION_NORM:
        raise InputError(
            f"the direction target's vector (target=, --direction) has norm {norm:.3g}, below "
            f"{MIN_DIRECTION_NORM:.3g} = sqrt(float32's smallest normal number): its squared "
            "norm underflows float32, so the model cannot compute along it; give a nonzero "
            "direction of ordinary scale (its scale does not matter: it is normalised)")
    return Target(name, -1, (exact / norm).float(), output, int(position), None,
                  positive_number(weight, "the target's weight"))


def salient_logits(logits: torch.Tensor, probabilities: torch.Tensor, *, max_n_logits: int,
                   desired_logit_prob: float, k: int | None) -> list[Target]:
    """circuit-tracer's salient logits: the ``max_n_logits`` most probable tokens, cut after the
    first whose cumulative probability reaches ``desired_logit_prob``; each a demeaned-logit
    target on ``logits`` (pre-soft-cap; :func:`demeaned_logit` by ``k``), weighted by its
    probability (from ``probabilities``, the real model's ``[V]``)."""
    top_p, top_idx = probabilities.float().topk(min(max_n_logits, probabilities.numel()))
    reach = torch.tensor(desired_logit_prob, device=top_p.device)  # CUDA's searchsorted: one device
    cutoff = int(torch.searchsorted(top_p.cumsum(0), reach)) + 1
    out = []
    for p, token in zip(top_p[:cutoff].tolist(), top_idx[:cutoff].tolist(), strict=True):
        out.append(replace(demeaned_logit(logits, token, k), prob=p, weight=p))
    return out


@checked
def make_target(logits: torch.Tensor, tokenizer: PreTrainedTokenizerBase, answer: str | None,
                *, kind: str, k: int, other: str | None = None) -> Target:
    """The target on clean ``logits``: ``kind`` is ``"demeaned"`` (minus the top-``k`` mean),
    ``"demeaned_vocab"`` or ``"difference"`` (``answer`` minus ``other``); the settings'
    defaults are :class:`~.settings.AttributionSettings`'. No ``answer``: the clean argmax."""
    token = (int(logits[0, -1].argmax()) if answer is None
             else answer_token_id(tokenizer, answer, strict=True))
    if kind == "demeaned":
        return demeaned_logit(logits, token, k)
    if kind == "demeaned_vocab":
        return demeaned_logit(logits, token, None)
    if kind == "difference":
        if other is None:
            raise InputError("a logit-difference target needs the other token (other=...)")
        return logit_difference(logits.shape[-1], token,
                                answer_token_id(tokenizer, other, strict=True))
    raise InputError(f"target kind must be demeaned, demeaned_vocab or difference, got {kind!r}")


def make_targets(logits: torch.Tensor, probabilities: torch.Tensor,
                 tokenizer: PreTrainedTokenizerBase, answer: str | None, *,
                 target: str | Target | torch.Tensor, other: str | None, k: int,
                 max_n_logits: int, desired_logit_prob: float) -> list[Target]:
    """A graph's targets in node order, on the pre-cap ``logits`` ``[1, P, V]``
    (``probabilities`` ``[V]``: the real model's at the last position): for a kind name, one
    target of it with ``answer`` (or ``"difference"``), else the salient logits demeaned by it;
    for a tensor or :class:`Target`, that direction alone (``answer`` must be None)."""
    vocab = logits.shape[-1]
    if isinstance(target, torch.Tensor):
        target = direction_target(target)
    if isinstance(target, Target):
        if answer is not None:
            raise InputError("answer= names a logit target; a direction target= explains its "
                             "projection instead: pass one of them")
        if not target.is_logit:  # a Target built by hand: normalised and checked as well
            target = direction_target(target.coefficients, output=target.output,
                                      position=target.position, name=target.name,
                                      weight=target.weight)
        return [replace(target, token=target.token if target.is_logit else vocab)]
    if answer is not None or target == "difference":
        goal = make_target(logits, tokenizer, answer, kind=target, other=other, k=k)
        return [replace(goal, prob=float(probabilities[goal.token]))]
    if target not in ("demeaned", "demeaned_vocab"):
        raise InputError(f"target kind must be demeaned, demeaned_vocab or difference, got "
                         f"{target!r}")
    return salient_logits(logits, probabilities, max_n_logits=max_n_logits,
                          desired_logit_prob=desired_logit_prob,
                          k=k if target == "demeaned" else None)
