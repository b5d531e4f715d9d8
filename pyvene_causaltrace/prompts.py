"""Prompts as token sequences: subject spans and answer tokens.

    prompt = tokenize_prompt(tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower")
    prompt.tokens          # ['The', ' E', 'iffel', ' Tower', ' is', ' in', ' the', ' city', ' of']
    prompt.subject_range   # (0, 4): token positions [0, 4) hold the subject

The subject span comes from character offsets, so it is right for BPE and SentencePiece pieces
alike: a token belongs to the subject when its characters overlap the subject's characters.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import InputError, MultiTokenAnswerError, SubjectNotFoundError

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt's token ids and strings, and where its subject is."""

    text: str
    input_ids: torch.Tensor  # [1, seq]
    tokens: tuple[str, ...]
    subject: str | None
    subject_range: tuple[int, int] | None  # [start, stop) in token positions

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: str, subject: str | None = None, occurrence: int = 0
) -> TokenizedPrompt:
    """Tokenize ``prompt`` (with the tokenizer's usual special tokens) and locate the
    ``occurrence``-th ``subject`` (:class:`SubjectNotFoundError` when it is not there)."""
    if not prompt:
        raise InputError("the prompt is empty")
    encoded = tokenizer(prompt, return_tensors="pt", return_offsets_mapping=True)
    input_ids = encoded["input_ids"]
    offsets = encoded["offset_mapping"][0].tolist()
    tokens = tuple(tokenizer.decode([i]) for i in input_ids[0].tolist())
    span = None if subject is None else _subject_span(prompt, subject, occurrence, offsets)
    return TokenizedPrompt(prompt, input_ids, tokens, subject, span)


def _subject_span(prompt: str, subject: str, occurrence: int, offsets) -> tuple[int, int]:
    if not subject:
        raise InputError("the subject is empty")
    if isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 0:
        raise InputError(f"occurrence={occurrence!r}: expected an int >= 0 (0: the subject's "
                         "first appearance; counting from the end is not supported)")
    start = -1
    for _ in range(occurrence + 1):
        start = prompt.find(subject, start + 1)
        if start < 0:
            raise SubjectNotFoundError(f"subject {subject!r} occurs fewer than "
                                       f"{occurrence + 1} time(s) in prompt {prompt!r}")
    stop = start + len(subject)
    inside = [i for i, (a, b) in enumerate(offsets)  # special tokens have empty offsets
              if b > a and a < stop and b > start]
    if not inside:
        raise SubjectNotFoundError(f"no token of {prompt!r} covers subject {subject!r}")
    return inside[0], inside[-1] + 1


def answer_token_id(tokenizer: Tokenizer, answer: str, strict: bool = False) -> int:
    """The first token of ``answer`` (tokenized without special tokens); a longer answer warns
    (only the first token is the target), or with ``strict`` raises
    :class:`MultiTokenAnswerError`."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InputError(f"answer {answer!r} tokenizes to nothing")
    if len(ids) > 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        if strict:
            raise MultiTokenAnswerError(
                f"answer {answer!r} is {len(ids)} tokens {pieces}; attribution explains one "
                f"logit: give a single-token answer (e.g. {pieces[0]!r})")
        warnings.warn(f"answer {answer!r} is {len(ids)} tokens {pieces}; the target is its "
                      f"first token {pieces[0]!r}", stacklevel=2)
    return int(ids[0])


# ------------------------------------------------------------------------- position 0 (BOS)

#: How position 0 is treated by the splice, attribution, fitting and the pairing check:
#: ``"auto"`` — as BOS (never spliced, no features, left out of fits and FVUs: the attention
#: sink no dictionary is trained on) only when the tokenizer prepends a special token;
#: ``"always"`` — as BOS whatever the tokenizer does (circuit-tracer's convention);
#: ``"never"`` — like any other token.
BOS_MODES = ("auto", "always", "never")
_PROBE = "The"


def tokenizer_adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` (called as everything here calls it, with its special tokens)
    prepends a special token: what it does, not whether ``bos_token`` is set (SmolLM2's has one
    and adds none)."""
    full = list(tokenizer(_PROBE)["input_ids"])
    plain = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    return (len(full) > len(plain) and full[1:1 + len(plain)] == plain
            and (full[0] in special or full[0] == tokenizer.bos_token_id))


def check_bos_mode(bos: object) -> None:
    """Refuse a ``bos`` setting outside :data:`BOS_MODES`."""
    if bos not in BOS_MODES:
        raise InputError(f"bos must be one of {', '.join(BOS_MODES)} (how position 0 is "
                         f"treated), got {bos!r}")


def first_position(tokenizer: Tokenizer, bos: str) -> int:
    """The first position spliced, attributed, fitted and scored under ``bos``
    (:data:`BOS_MODES`): 1 when position 0 is BOS, else 0."""
    check_bos_mode(bos)
    if bos == "auto":
        return int(tokenizer_adds_bos(tokenizer))
    return int(bos == "always")


def bos_metadata(tokenizer: Tokenizer, bos: str, first_token: str | None = None) -> dict:
    """What a result records about position 0: the setting, whether the tokenizer adds a BOS,
    the first position spliced, and in words what position 0 was."""
    adds = tokenizer_adds_bos(tokenizer)
    start = first_position(tokenizer, bos)
    token = "" if first_token is None else f" ({first_token!r})"
    if start:
        why = ("the tokenizer adds one" if adds else
               "bos='always', circuit-tracer's convention, though the tokenizer adds none")
        rule = (f"position 0{token} treated as BOS ({why}): not spliced, no features; its "
                "error node is the MLP output minus b_dec (a constant) and any skip path")
    else:
        why = "the tokenizer adds none" if not adds else "bos='never'"
        rule = (f"position 0{token} is a real token ({why}): spliced, attributed and fitted "
                "like any other")
    return {"setting": bos, "tokenizer_adds_bos": adds, "first_spliced_position": start,
            "rule": rule}
