"""The ranks of a ``torch.distributed`` run, as our methods see them: who we are, the
collectives they need, and one clear error when a rank disagrees, dies or hangs.

    ranks = current()                    # None: one process (or alone())
    total = ranks.all_reduce(partial)    # sum over ranks, the same on every rank
    ranks.agree("model", fingerprint)    # DistributedError naming the ranks that differ

Every collective goes through :func:`collective`, which turns a backend failure (a peer gone,
the group's timeout) into one :class:`~.errors.DistributedError` naming this rank and the step.
The launcher's variables are checked by :func:`environment` before anything waits on them."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import DistributedError, InputError
from .hooking import in_context

#: A collective waits at most this long for the other ranks (``init`` sets it on the group it
#: makes; a user's own group keeps its own): a hung rank fails the others within it.
TIMEOUT_S = 120.0

#: Joining: how long a rank waits to reach rank 0's TCP store (``MASTER_ADDR:MASTER_PORT``) before
#: it fails, named, instead of hanging.
RENDEZVOUS_TIMEOUT_S = 60.0
#: The most ranks ``WORLD_SIZE`` may say (a bound for the check, far past any run here).
MAX_WORLD = 65536

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
        out = tensor.detach().to(_wire(), copy=True).contiguous()
        reduce = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                  "max": dist.ReduceOp.MAX}[op]
        with collective(self, what):
            dist.all_reduce(out, op=reduce)
        return out.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor, what: str = "a gather over ranks"
                   ) -> list[torch.Tensor]:
        """Every rank's ``tensor``, in rank order; first dimensions may differ between ranks
        (the rest must agree)."""
        wire = _wire()
        with collective(self, what):
            sizes = [torch.zeros(1, dtype=torch.long, device=wire) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([tensor.shape[0]], dtype=torch.long,
                                                device=wire))
            longest = max(int(s) for s in sizes)
            padded = tensor.new_zeros((longest, *tensor.shape[1:]), device=wire)
            padded[:tensor.shape[0]] = tensor
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded)
        return [part[:int(size)].to(tensor.device) for part, size in zip(parts, sizes,
                                                                           strict=True)]

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


def topk_over_ranks(ranks: Ranks, source: torch.Tensor, ids: torch.Tensor, k: int,
                    what: str) -> torch.Tensor:
    """Bool ``[N, M]``: which of this rank's columns of ``source [N, M]`` (global ids ``ids
    [M]``, increasing) are among the ``k`` largest of every rank's, row by row: each rank sends
    its ``k`` best (value, id) and all pick the same ``k``, ties to the lower global id (a
    sharded transcoder's top-k, a sharded Lorsa's TopK over OV heads)."""
    n_rows, width = source.shape
    best = source.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
    mine = min(k, width)
    candidates = torch.stack([best.values[:, :mine].double(),
                              ids[best.indices[:, :mine]].double()], -1)  # [N, k, 2]
    # float64 holds every value of the compute dtypes and ids below 2**53 exactly
    gathered = torch.cat(ranks.all_gather(candidates.transpose(0, 1), what))  # [R*k, N, 2]
    values, global_ids = gathered.transpose(0, 1).unbind(-1)  # [N, R*k]
    by_id = global_ids.argsort(dim=-1)
    values, global_ids = values.gather(-1, by_id), global_ids.gather(-1, by_id)
    top = values.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = global_ids.gather(-1, top).long()  # [N, k] global ids, every rank the same
    column = torch.searchsorted(ids, chosen).clamp(max=width - 1)
    column = torch.where(ids[column] == chosen, column, width)  # others' -> a spare column
    keep = torch.zeros(n_rows, width + 1, dtype=torch.bool, device=source.device)
    return keep.scatter_(-1, column, True)[:, :width]


def _wire() -> torch.device:
    """Where the group's collectives take their tensors: NCCL's on this rank's GPU (it has no
    CPU collectives), gloo's on the CPU (a rank's CUDA tensors are copied there and back:
    gloo's CUDA support stops at broadcast and all_reduce, torch's backend table)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _short(value: object) -> str:
    """``value``'s repr, cut to 80 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def current() -> Ranks | None:
    """This process's :class:`Ranks`, or None: no initialised group, one rank, or inside
    :func:`alone`."""
    if _ALONE.get() or not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return None if world == 1 else Ranks(dist.get_rank(), world)


def alone() -> contextlib.AbstractContextManager:
    """Inside the block this thread's methods run as one process (no collectives), whatever
    the process group: each rank on its own work (its own prompts)."""
    return in_context(_ALONE, True)


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


@dataclass(frozen=True)
class Launch:
    """The launcher's environment, checked (:func:`environment`): this process is ``rank`` of
    ``world``, ``local_rank`` on its machine; rank 0 serves the store at ``master_addr``:
    ``master_port``."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int


def _integer(env: Mapping[str, str], name: str, low: int, high: int, what: str) -> int:
    """``env[name]`` as an integer in ``low..high``, else an InputError saying which."""
    value = env.get(name)
    if value is None:
        raise InputError(f"{name} is not set: a distributed run needs {what}, an integer in "
                         f"{low}..{high} (torchrun sets it)")
    digits = value.strip()
    number = int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 19 else None
    if number is None or not low <= number <= high:
        raise InputError(f"{name}={value!r}: {what} must be an integer in {low}..{high}")
    return number


def environment(env: Mapping[str, str] | None = None) -> Launch | None:
    """The distributed environment (``os.environ`` unless ``env``), checked before anything
    reads or waits on it: None for one process (no ``WORLD_SIZE``, or 1); else a
    :class:`Launch`. A variable missing, not an integer or out of range is an
    :class:`~.errors.InputError` naming it, its value and what is allowed."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        stray = next((name for name in ("RANK", "LOCAL_RANK") if name in env), None)
        if stray is not None:
            raise InputError(f"{stray}={env[stray]!r} is set but WORLD_SIZE is not: set both "
                             "(torchrun does), or neither for one process")
        return None
    world = _integer(env, "WORLD_SIZE", 1, MAX_WORLD, "the number of ranks")
    if world == 1:
        if "RANK" in env:
            _integer(env, "RANK", 0, 0, "this process's rank (WORLD_SIZE=1)")
        return None
    rank = _integer(env, "RANK", 0, world - 1, f"this process's rank (WORLD_SIZE={world})")
    local = _integer(env, "LOCAL_RANK", 0, world - 1, "this process's rank on its machine") \
        if "LOCAL_RANK" in env else 0
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise InputError(f"MASTER_ADDR={env.get('MASTER_ADDR')!r}: a distributed run needs the "
                         "host of rank 0 (e.g. 127.0.0.1; torchrun sets it)")
    port = _integer(env, "MASTER_PORT", 1, 65535, "the port of rank 0's store")
    return Launch(rank, world, local, addr, port)


def _store(launch: Launch, timeout_s: float):
    """The rendezvous TCP store (rank 0 serves it), or a :class:`DistributedError` naming
    ``MASTER_ADDR:MASTER_PORT``: the port in use, or no store reached within ``timeout_s``."""
    where = f"MASTER_ADDR:MASTER_PORT={launch.master_addr}:{launch.master_port}"
    box: dict = {}
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun serves it

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(  # as torch's env:// rendezvous makes it
                launch.master_addr, launch.master_port, launch.world,
                is_master=launch.rank == 0 and not agent, timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False, multi_tenant=not agent)
        except (RuntimeError, OSError, ValueError) as error:
            box["error"] = error

    # the store's own timeout does not cover a port held by something that accepts and never
    # answers (torch 2.13 waits forever there): a thread bounds it
    thread = threading.Thread(target=connect, name="pvct-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s + 2)
    if thread.is_alive():
        box["error"] = TimeoutError("connected, but no store answered")
    if "store" in box:
        return box["store"]
    reason = (str(box["error"]).strip().splitlines() or ["no answer"])[0][:200]
    if launch.rank == 0:
        raise DistributedError(
            f"rank 0 could not serve the rendezvous store on {where} ({reason}): the port is in "
            "use (another run?) or the address is not this machine's; pick a free MASTER_PORT")
    raise DistributedError(
        f"rank {launch.rank} of {launch.world} reached no rendezvous store on {where} within "
        f"{timeout_s:g} s ({reason}): rank 0 did not start, failed (its port in use?) or the "
        "port is another program's")


def init(timeout_s: float = TIMEOUT_S, rendezvous_s: float = RENDEZVOUS_TIMEOUT_S,
         backend: str | None = None) -> Ranks | None:
    """Join the launcher's process group (``backend``: gloo on CPU, NCCL on a GPU rank)
    unless one exists; returns :func:`current`, or None without a launcher's environment
    (checked first, :func:`environment`). Rank 0's store is awaited at most ``rendezvous_s``,
    every rank and each collective at most ``timeout_s``: a :class:`DistributedError`, never a
    hang."""
    launch = environment()
    if not dist.is_initialized():
        if launch is None:
            return None
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            gpus = torch.cuda.device_count()
            if launch.local_rank >= gpus:
                raise InputError(f"LOCAL_RANK={launch.local_rank}: this machine has {gpus} "
                                 f"GPUs, so it must be in 0..{gpus - 1} (NCCL takes one rank "
                                 "per GPU; ranks sharing a GPU need backend='gloo')")
            torch.cuda.set_device(launch.local_rank)
        store = _store(launch, rendezvous_s)
        store.set_timeout(timedelta(seconds=timeout_s))
        try:  # the prefix torch's own rendezvous gives the group's keys in a shared store
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                                    rank=launch.rank,
                                    world_size=launch.world, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise DistributedError(
                f"rank {launch.rank} of {launch.world}: not every rank joined within "
                f"{timeout_s:g} s ({reason}); check that WORLD_SIZE ranks were started with the "
                "same MASTER_ADDR:MASTER_PORT") from None
    return current()


def finish() -> None:
    """Leave the process group if one is initialised (after a last barrier)."""
    if dist.is_initialized():
        dist.destroy_process_group()
