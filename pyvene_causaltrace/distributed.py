"""The ranks of a ``torch.distributed`` run, as our methods see them: who we are, the
collectives they need, and one clear error when a rank disagrees, dies or hangs.

A method runs distributed when a process group is initialised with more than one rank (under
``torchrun``, or a user's own script) and the caller has not asked for a local run
(:func:`alone`: each rank then works on its own, e.g. its own prompts). Every collective goes
through :func:`collective`, which turns the backend's failure — a peer's socket closed (a rank
killed), the group's timeout (a rank hung) — into one :class:`~.errors.DistributedError` naming
this rank and the step, instead of a backend traceback or a hang.

    ranks = current()                    # None: one process (or alone())
    total = ranks.all_reduce(partial)    # sum over ranks, the same on every rank
    ranks.agree("model", fingerprint)    # DistributedError naming the ranks that differ
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import DistributedError

#: A collective waits at most this long for the other ranks (``init`` sets it on the group it
#: makes; a user's own group keeps its own): a hung rank fails the others within it.
TIMEOUT_S = 120.0

_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("pvct_alone", default=False)


@dataclass(frozen=True)
class Ranks:
    """This process's place in an initialised process group of ``world > 1`` ranks."""

    rank: int
    world: int

    @property
    def first(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, what: str = "a sum over ranks",
                   op: str = "sum") -> torch.Tensor:
        """``tensor`` summed (or ``op="min"``/``"max"``) over ranks: a new tensor, the same
        on every rank."""
        out = tensor.detach().clone().contiguous()
        reduce = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                  "max": dist.ReduceOp.MAX}[op]
        with collective(self, what):
            dist.all_reduce(out, op=reduce)
        return out

    def all_gather(self, tensor: torch.Tensor, what: str = "a gather over ranks"
                   ) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order; first dimensions may differ between ranks
        (the rest must agree)."""
        tensor = tensor.contiguous()
        with collective(self, what):
            sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([tensor.shape[0]], dtype=torch.long))
            longest = max(int(s) for s in sizes)
            padded = tensor.new_zeros((longest, *tensor.shape[1:]))
            padded[:tensor.shape[0]] = tensor
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded)
        return [part[:int(size)] for part, size in zip(parts, sizes, strict=True)]

    def broadcast_object(self, value: object, what: str = "a broadcast from rank 0") -> object:
        """Rank 0's ``value`` on every rank (pickled)."""
        box = [value if self.first else None]
        with collective(self, what):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, value: object, what: str = "a gather over ranks") -> list:
        """Every rank's ``value`` (pickled), in rank order, on every rank."""
        out: list = [None] * self.world
        with collective(self, what):
            dist.all_gather_object(out, value)
        return out

    def agree(self, what: str, value: object) -> None:
        """Raise :class:`DistributedError` unless every rank holds the same ``value`` (a
        fingerprint, a prompt, settings): a run whose ranks hold other models or transcoders
        would sum unrelated numbers."""
        values = self.gather_objects(value, f"comparing the ranks' {what}")
        if any(v != values[0] for v in values):
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise DistributedError(
                f"the ranks disagree on the {what}: ranks {differ} differ from rank 0 "
                f"({_short(values[0])} vs {_short(values[differ[0]])}); every rank must load the "
                "same model, transcoder, prompt and settings")

    def barrier(self, what: str = "waiting for every rank") -> None:
        with collective(self, what):
            dist.barrier()


def _short(value: object) -> str:
    """``value``'s repr, cut to 80 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def current() -> Ranks | None:
    """This process's :class:`Ranks`, or None: no initialised group, one rank, or inside
    :func:`alone`."""
    if _ALONE.get():
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return None if world == 1 else Ranks(dist.get_rank(), world)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside the block this thread's methods run as one process (no collectives), whatever
    the process group: each rank on its own work (its own prompts)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


@contextlib.contextmanager
def collective(ranks: Ranks, what: str) -> Iterator[None]:
    """Turn a failed collective into one :class:`DistributedError` naming the rank and step."""
    try:
        yield
    except DistributedError:
        raise
    except (RuntimeError, OSError, ConnectionError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DistributedError(
            f"rank {ranks.rank} of {ranks.world}: {what} failed — another rank died, hung past "
            f"the collective timeout or left early ({reason[:200]}); nothing was written as if "
            "complete: rerun with the same world size to resume from the checkpoint") from None


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (its environment says so)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init(timeout_s: float = TIMEOUT_S) -> Ranks | None:
    """Join ``torchrun``'s process group (gloo on CPU, NCCL when this rank has a GPU) with a
    collective timeout of ``timeout_s``, unless one is initialised already; returns
    :func:`current`. Without a ``torchrun`` environment it does nothing and returns None."""
    if not dist.is_initialized():
        if not launched():
            return None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return current()


def finish() -> None:
    """Leave the process group if one is initialised (after a last barrier)."""
    if dist.is_initialized():
        dist.destroy_process_group()
