"""ROME's token roles, for reading a trace by what each position is.

ROME's six buckets, plus one for tokens before the subject (ROME's prompts mostly start with
the subject; known_1000 has some that do not). When buckets overlap the subject roles win, then
"Last token":

    token_role(3, subject_range=(1, 4), seq_len=9)   # "Last subject token"
"""

from __future__ import annotations

from ..arguments import checked
from ..errors import InputError

ROLES = (
    "First subject token",
    "Middle subject tokens",
    "Last subject token",
    "First subsequent token",
    "Further tokens",
    "Last token",
)
BEFORE_SUBJECT = "Before subject"


@checked
def token_role(position: int, subject_range: tuple[int, int], seq_len: int) -> str:
    """The role of ``position`` given the subject's ``[start, stop)`` token range."""
    start, stop = subject_range
    if not (0 <= position < seq_len and 0 <= start < stop <= seq_len):
        raise InputError(f"position {position} / subject {subject_range} outside {seq_len} tokens")
    if position == stop - 1:
        return "Last subject token"
    if position == start:
        return "First subject token"
    if start < position < stop:
        return "Middle subject tokens"
    if position == seq_len - 1:
        return "Last token"
    if position == stop:
        return "First subsequent token"
    if position > stop:
        return "Further tokens"
    return BEFORE_SUBJECT


def role_positions(subject_range: tuple[int, int], seq_len: int) -> dict[str, list[int]]:
    """ROME's bucketing for averaging over facts: the positions each role averages over.
    Unlike :func:`token_role`'s, buckets may share a position or be empty, as in ROME's code (a
    one-token subject is its first and last token; a subject ending right before the last token
    makes that token first subsequent and last, and leaves "Further tokens" empty). Middle and
    further tokens are averaged within a prompt first."""
    start, stop = subject_range
    if not (0 <= start < stop <= seq_len - 1):
        raise InputError(f"subject {subject_range} must end before the last of {seq_len} tokens")
    last = seq_len - 1
    return {
        BEFORE_SUBJECT: list(range(0, start)),
        "First subject token": [start],
        "Middle subject tokens": list(range(start + 1, stop - 1)),
        "Last subject token": [stop - 1],
        "First subsequent token": [stop],
        "Further tokens": list(range(stop + 1, last)),
        "Last token": [last],
    }
