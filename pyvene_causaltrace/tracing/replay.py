"""Run a model with its lowest blocks *replayed*: they return stored outputs instead of computing.

Below its first restored layer a row equals the corrupted run, so blocks ``0..first-1`` are
swapped for a stand-in returning the corrupted output of block ``first - 1``, while the model's
own ``forward`` runs around them (nothing architecture-specific is rewritten). On a replayed
block only the run's own edits run (:func:`~..applier.only`); the package's others already
shaped the stored output and are :func:`~..hooking.silenced`. Hooks that are not ours cannot
be silenced: :func:`replayable` says whether a block carries any, and the engine then computes
every layer. Both act only on the installing thread's forwards.

    replay = LayerReplay(blocks, returns_tuple=False, keep=engine_hook_ids)
    with replay.below(first=5, output=corrupted_block_4_rows):
        logits = model(input_ids=ids, ...).logits

:class:`RaggedLayers` goes further: rows of different first layers share a forward."""

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


def replayable(blocks: Sequence[nn.Module]) -> bool:
    """Whether :class:`LayerReplay` may replay ``blocks``: every forward or pre-forward hook on
    them is the package's (it can be silenced) or transformers' output capturing (inert in our
    forwards). Reads the hook tables, writes nothing."""
    return all(is_ours(hook) or getattr(hook, "__module__", None) == _CAPTURING
               for block in blocks
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

    @contextlib.contextmanager
    def below(self, first: int, output: torch.Tensor | None) -> Iterator[None]:
        """Blocks ``< first`` replayed; block ``first - 1`` returns ``output``. The package's
        hooks on them other than ``keep`` do nothing in this thread's forwards meanwhile
        (other threads' forwards still run them); the caller has checked :func:`replayable`."""
        ours, blocks = thread_gate(), self.blocks[:first]

        def stand_in(index: int, own):
            def forward(*args, **kwargs):
                if not ours():  # another thread's forward: the block's own
                    return own(*args, **kwargs)
                value = output if index == first - 1 and output is not None else (
                    args[0] if args else kwargs["hidden_states"])
                return (value,) if self.returns_tuple else value
            return forward

        with _forwards(blocks, stand_in), silenced(blocks, self.keep), only(blocks, ("run",)):
            yield


class RaggedLayers:
    """Every row starts at its own layer: block ``j`` computes only the rows whose first layer
    is ``<= j``, and rows join the batch when they start.

    Rows are sorted by first layer, so block ``j`` computes the first ``counts[j]`` (slicing its
    batched inputs) and appends ``stored(j, counts[j], counts[j + 1])``, the stored outputs of
    the rows starting at ``j + 1``; ``counts`` ends with the chunk's size. A block whose rows are
    all stored does not run. Blocks may mix computed and stored rows, so this is used only when no
    other hook sits on a block's output (it would apply twice to stored rows). The KV cache given
    block ``j`` must hold ``counts[j]`` rows.

        with ragged.installed():
            ragged.counts = [0, 4, 10]  # two blocks, a chunk of 10 rows
            ragged.stored = lambda layer, k, end: outputs[layer][k:end]
            logits = model(input_ids=ids, ...).logits"""

    def __init__(self, blocks: Sequence[nn.Module], returns_tuple: bool) -> None:
        self.blocks = list(blocks)
        self.returns_tuple = returns_tuple
        self.counts: list[int] = []
        self.stored = None  # (layer, k, end) -> the stored outputs of the batch's rows k..end-1

    @contextlib.contextmanager
    def installed(self) -> Iterator[RaggedLayers]:
        with _forwards(self.blocks, self._wrapped):
            yield self

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


@contextlib.contextmanager
def _forwards(blocks: Sequence[nn.Module], wrap) -> Iterator[None]:
    """Each block's ``forward`` is ``wrap(index, forward)`` inside; after, the one it had
    (an instance's own, e.g. accelerate's wrapper with a ``device_map``, or the class's)."""
    saved = []
    try:
        for index, block in enumerate(blocks):
            saved.append((block, block.__dict__.get("forward")))
            block.forward = wrap(index, block.forward)
        yield
    finally:
        for block, own_forward in saved:
            if own_forward is None:
                del block.forward  # the class's forward again
            else:
                block.forward = own_forward


def _first_rows(value, n: int, k: int):
    """``value``'s first ``k`` batch rows when it is batched over the chunk's ``n`` rows (a
    tensor of two or more dimensions whose first is ``n``, or a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value[:k] if value.dim() >= 2 and value.shape[0] == n else value
    if isinstance(value, tuple):
        return tuple(_first_rows(item, n, k) for item in value)
    return value
