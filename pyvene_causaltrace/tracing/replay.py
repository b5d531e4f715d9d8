"""Run a model with its lowest blocks *replayed*: they return stored outputs instead of computing.

A restore row equals the corrupted run at every layer below its first restored one, so the
engine does not compute those layers: blocks ``0..first-1`` are swapped for a stand-in that
returns the corrupted run's output of block ``first - 1`` (the blocks below it just pass their
input on; nothing reads it). The model's own ``forward`` still runs around them — embeddings,
rotary tables, masks, the final norm, logit soft-capping — so nothing architecture-specific is
rewritten here.

While a block is replayed only the run's own edits see its output (the applier's hooks, named
in ``keep``, running the edits of the group ``"run"`` alone: :func:`~..applier.only`): another
edit of the package on it (a ``pv.IntervenableModel``'s interventions applied to our runs)
already shaped the stored output in the corrupted run and must not apply twice, and any other
hook of the package is :func:`~..hooking.silenced` for the block. A hook that is not the
package's cannot be silenced without rewriting torch's hook tables, which nothing here does:
:func:`replayable` says whether the blocks carry any (transformers' output-capturing hooks
aside: they record only for a forward that asks for hidden states, which the engine's never
do), and the engine computes every layer
of such a run instead. Each block's own ``forward`` is back when the block ends. Both act on the
forwards of the thread that installed them (:mod:`..hooking`'s gate): a forward of the model from
any other thread runs every block's own forward and every hook, as without them.

    replay = LayerReplay(blocks, returns_tuple=False, keep=engine_hook_ids)
    with replay.below(first=5, output=corrupted_block_4_rows):
        logits = model(input_ids=ids, ...).logits

:class:`RaggedLayers` goes further: rows of different first layers share a forward, and each
block computes only the rows that start at or below it (the engine's default; it needs no
other hook on a block's output, and falls back to :class:`LayerReplay` otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..applier import only
from ..hooking import is_ours, silenced, thread_gate

#: The module of transformers 5's output-capturing hooks (inert unless the forward asks for
#: hidden states or attentions).
_CAPTURING = "transformers.utils.output_capturing"


def _harmless(hook) -> bool:
    return is_ours(hook) or getattr(hook, "__module__", None) == _CAPTURING


def replayable(blocks: Sequence[nn.Module]) -> bool:
    """Whether :class:`LayerReplay` may replay ``blocks``: every forward or pre-forward hook on
    them is the package's (it can be silenced) or transformers' output capturing (inert in our
    forwards). Reads the hook tables, writes nothing."""
    return all(_harmless(hook) for block in blocks
               for table in (block._forward_hooks, block._forward_pre_hooks)
               for hook in table.values())


class LayerReplay:
    """Swaps the lowest ``first`` of ``blocks`` for stored outputs inside :meth:`below`.

    ``returns_tuple``: whether a block returns a tuple (GPT-2 on transformers 4) rather than a
    tensor; ``keep``: ids of the forward hooks that still run on a replayed block's output.
    """

    def __init__(self, blocks: Sequence[nn.Module], returns_tuple: bool,
                 keep: set[int] | None = None) -> None:
        self.blocks = list(blocks)
        self.returns_tuple = returns_tuple
        self.keep = keep if keep is not None else set()

    def _stand_in(self, own, output: torch.Tensor | None):
        ours = thread_gate()

        def forward(*args, **kwargs):
            if not ours():  # another thread's forward: the block's own
                return own(*args, **kwargs)
            value = output if output is not None else (args[0] if args
                                                       else kwargs["hidden_states"])
            return (value,) if self.returns_tuple else value
        return forward

    @contextlib.contextmanager
    def below(self, first: int, output: torch.Tensor | None) -> Iterator[None]:
        """Blocks ``< first`` replayed; block ``first - 1`` returns ``output``. The package's
        hooks on them other than ``keep`` do nothing in this thread's forwards meanwhile
        (other threads' forwards still run them); the caller has checked :func:`replayable`."""
        saved = []
        try:
            for index in range(first):
                block = self.blocks[index]
                saved.append((block, block.__dict__.get("forward")))
                block.forward = self._stand_in(block.forward,
                                               output if index == first - 1 else None)
            with silenced(self.blocks[:first], self.keep), only(self.blocks[:first], ("run",)):
                yield
        finally:
            for block, own_forward in saved:
                if own_forward is None:
                    del block.forward  # the class's forward again
                else:  # e.g. accelerate's wrapper when the model was loaded with a device_map
                    block.forward = own_forward


class RaggedLayers:
    """Every row starts at its own layer: block ``j`` computes only the rows whose first layer
    is ``<= j``, and rows join the batch when they start.

    The chunk's rows are sorted by first layer, so the rows block ``j`` computes are the first
    ``counts[j]`` of the batch. Block ``j``'s wrapper computes them (slicing its batched inputs:
    hidden states, masks) and appends ``stored(j, counts[j], counts[j + 1])``, the stored
    outputs of the rows that start at block ``j + 1``; so block ``j`` returns ``counts[j + 1]``
    rows, and ``counts`` ends with the chunk's size, which the last block returns. Rows that
    have not started are neither copied nor carried. A block whose rows are all stored does
    not run. Unlike :class:`LayerReplay` a block may mix computed and stored rows, so the
    engine uses this only when no hook besides its own sits on a block's output (a user's
    hook there would apply twice to the stored rows).

    The KV cache a chunk gives block ``j`` must hold ``counts[j]`` rows.

        ragged = RaggedLayers(blocks, returns_tuple=False)
        with ragged.installed():
            ragged.counts = [0, 4, 10]  # two blocks, a chunk of 10 rows
            ragged.stored = lambda layer, k, end: outputs[layer][k:end]
            logits = model(input_ids=ids, ...).logits
    """

    def __init__(self, blocks: Sequence[nn.Module], returns_tuple: bool) -> None:
        self.blocks = list(blocks)
        self.returns_tuple = returns_tuple
        self.counts: list[int] = []
        self.stored = None  # (layer, k, end) -> the stored outputs of the batch's rows k..end-1

    @contextlib.contextmanager
    def installed(self) -> Iterator[RaggedLayers]:
        saved = []
        try:
            for layer, block in enumerate(self.blocks):
                saved.append((block, block.__dict__.get("forward")))
                block.forward = self._wrapped(layer, block.forward)
            yield self
        finally:
            for block, own_forward in saved:
                if own_forward is None:
                    del block.forward
                else:
                    block.forward = own_forward

    def _wrapped(self, layer: int, forward):
        ours = thread_gate()

        def ragged(*args, **kwargs):
            if not ours():  # another thread's forward: the block's own
                return forward(*args, **kwargs)
            k, end = self.counts[layer], self.counts[layer + 1]
            if k == 0:
                rest = self.stored(layer, 0, end)
                return (rest,) if self.returns_tuple else rest
            n = self.counts[-1]  # the chunk's rows: masks and other batched inputs have n
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = hidden[:k]
            args = (hidden, *(_first_rows(a, n, k) for a in args[1:])) if args else ()
            kwargs = {key: hidden if key == "hidden_states" else _first_rows(value, n, k)
                      for key, value in kwargs.items()}
            out = forward(*args, **kwargs)
            if end == k:
                return out
            rest = self.stored(layer, k, end)
            if isinstance(out, tuple):
                return (torch.cat([out[0], rest]), *out[1:])
            return torch.cat([out, rest])
        return ragged


def _first_rows(value, n: int, k: int):
    """``value``'s first ``k`` batch rows when it is batched over the chunk's ``n`` rows (a
    tensor of two or more dimensions whose first is ``n``, or a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value[:k] if value.dim() >= 2 and value.shape[0] == n else value
    if isinstance(value, tuple):
        return tuple(_first_rows(item, n, k) for item in value)
    return value
