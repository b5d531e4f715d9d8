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
    """Tokenize ``prompt`` (with the tokenizer's usual special tokens) and locate ``subject``.

    ``occurrence`` picks which appearance of the subject (0 = first). Raises
    :class:`SubjectNotFoundError` when the subject is not in the prompt.
    """
    if not prompt:
        raise InputError("the prompt is empty")
    encoded = tokenizer(prompt, return_tensors="pt", return_offsets_mapping=True)
    input_ids = encoded["input_ids"]
    offsets = encoded["offset_mapping"][0].tolist()
    tokens = tuple(tokenizer.decode([i]) for i in input_ids[0].tolist())
    span = None
    if subject is not None:
        span = _subject_span(prompt, subject, occurrence, offsets)
    return TokenizedPrompt(prompt, input_ids, tokens, subject, span)


def _subject_span(prompt: str, subject: str, occurrence: int, offsets) -> tuple[int, int]:
    if not subject:
        raise InputError("the subject is empty")
    start = -1
    for _ in range(occurrence + 1):
        start = prompt.find(subject, start + 1)
        if start < 0:
            raise SubjectNotFoundError(
                f"subject {subject!r} occurs fewer than {occurrence + 1} time(s) in "
                f"prompt {prompt!r}"
            )
    stop = start + len(subject)
    inside = [
        i for i, (a, b) in enumerate(offsets)
        if b > a and a < stop and b > start  # special tokens have empty offsets
    ]
    if not inside:
        raise SubjectNotFoundError(f"no token of {prompt!r} covers subject {subject!r}")
    return inside[0], inside[-1] + 1


def answer_token_id(tokenizer: Tokenizer, answer: str, strict: bool = False) -> int:
    """The first token of ``answer`` (tokenized without special tokens).

    Warns when the answer spans several tokens: only the first is the target. With ``strict``
    that is a :class:`MultiTokenAnswerError` instead.
    """
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InputError(f"answer {answer!r} tokenizes to nothing")
    if len(ids) > 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        if strict:
            raise MultiTokenAnswerError(
                f"answer {answer!r} is {len(ids)} tokens {pieces}; attribution explains one "
                f"logit: give a single-token answer (e.g. {pieces[0]!r})")
        warnings.warn(
            f"answer {answer!r} is {len(ids)} tokens {pieces}; the target is its first token "
            f"{pieces[0]!r}",
            stacklevel=2,
        )
    return int(ids[0])
