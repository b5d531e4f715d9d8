"""Causal-tracing metrics as pure tensor functions (no model access).

With ``clean`` = P(answer) in the clean run, ``corrupt`` = P(answer) with the subject noised and
``restored`` = P(answer) with the noise and one restoration:

- total effect ``TE = clean - corrupt``;
- indirect effect ``IE = restored - corrupt``;
- recovery ``IE / TE``, per noise seed (average recoveries, not probabilities, across seeds).
"""

from __future__ import annotations

import torch


def answer_probs(logits: torch.Tensor, answer_id: int) -> torch.Tensor:
    """P(answer) at the last position: ``[batch, seq, vocab]`` logits -> ``[batch]`` float64."""
    return logits[:, -1].double().softmax(-1)[:, answer_id]


def total_effect(clean: torch.Tensor | float, corrupt: torch.Tensor) -> torch.Tensor:
    return clean - corrupt


def indirect_effect(restored: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    return restored - corrupt


def recovery(
    restored: torch.Tensor, corrupt: torch.Tensor, clean: torch.Tensor | float
) -> torch.Tensor:
    """``(restored - corrupt) / (clean - corrupt)``, broadcast over leading dimensions."""
    return indirect_effect(restored, corrupt) / total_effect(clean, corrupt)
