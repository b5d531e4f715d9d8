"""The unembedding written into one buffer that every chunk of a run reuses.

A chunk's logits are large (57 MB for 290 SmolLM2 rows), and on the CPU fresh memory that size
costs page faults on every call: 48 G multiply-adds/s against 67 into a reused buffer
(``benchmarks/head_buffer.py``), the same values bit for bit. Only a bias-free ``nn.Linear``
head on the CPU that no hook watches (one might keep logits the next chunk overwrites) is
redirected, in the installing thread only (:func:`..hooking.thread_gate`).

    with ReusedHead(model.lm_head).installed():
        for chunk in chunks:
            probs = token_probs(model(**chunk).logits[:, -1], answer)  # read before the next"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..hooking import thread_gate


class ReusedHead:
    """``head``'s forward into a buffer kept while :meth:`installed` is entered."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.buffer: torch.Tensor | None = None

    def applies(self) -> bool:
        head = self.head
        watched = (head._forward_hooks or head._forward_pre_hooks
                   or nn.modules.module._global_forward_hooks
                   or nn.modules.module._global_forward_pre_hooks)
        return (type(head) is nn.Linear and head.bias is None and not watched
                and head.weight.device.type == "cpu" and "forward" not in head.__dict__)

    @contextlib.contextmanager
    def installed(self) -> Iterator[ReusedHead]:
        if not self.applies():
            yield self
            return
        ours = thread_gate()
        own = self.head.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            return self._forward(hidden) if ours() else own(hidden)

        self.head.forward = forward
        try:
            yield self
        finally:
            del self.head.forward
            self.buffer = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        if hidden.dtype != weight.dtype or torch.is_grad_enabled():
            return nn.functional.linear(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.buffer is None or self.buffer.shape[0] < flat.shape[0]:
            self.buffer = torch.empty(flat.shape[0], weight.shape[0], dtype=weight.dtype)
        out = self.buffer[:flat.shape[0]]
        torch.mm(flat, weight.t(), out=out)
        return out.view(*hidden.shape[:-1], weight.shape[0])
