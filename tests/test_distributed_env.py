"""The launcher's environment is read through one check (``distributed.environment``): a variable
missing, not an integer or out of range is an InputError naming it, its value and what is
allowed, and the commands check it before anything else. Joining waits a stated bound: a port in
use, or a port whose holder never answers, fails as a DistributedError within it. No process
group is started here."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pyvene_causaltrace import distributed
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import DistributedError, InputError

GOOD = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500"}
VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**changes) -> dict:
    """GOOD with ``changes`` (None removes a variable)."""
    env = {**GOOD, **changes}
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("env,named", [
    (_env(WORLD_SIZE="two"), "WORLD_SIZE='two'"),
    (_env(WORLD_SIZE="0"), "WORLD_SIZE='0'"),
    (_env(WORLD_SIZE="-2"), "WORLD_SIZE='-2'"),
    (_env(WORLD_SIZE="2.0"), "WORLD_SIZE='2.0'"),
    (_env(RANK=None), "RANK is not set"),
    (_env(RANK="5"), "RANK='5'.*0..1"),  # hung past 200 s
    (_env(RANK="first"), "RANK='first'"),
    (_env(LOCAL_RANK="-1"), "LOCAL_RANK='-1'"),
    (_env(MASTER_ADDR=None), "MASTER_ADDR=None"),
    (_env(MASTER_ADDR=" "), "MASTER_ADDR=' '"),
    (_env(MASTER_PORT=None), "MASTER_PORT is not set"),
    (_env(MASTER_PORT="http"), "MASTER_PORT='http'"),
    (_env(MASTER_PORT="70000"), "MASTER_PORT='70000'.*1..65535"),
    (_env(MASTER_PORT="9" * 5000), "MASTER_PORT="),  # past int()'s digit limit
    ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "1", "RANK": "3"}, "RANK='3'.*0..0"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_wrong_variable_is_named_with_its_value(env, named):
    with pytest.raises(InputError, match=named):
        distributed.environment(env)


def test_the_environment_read_when_it_is_right():
    assert distributed.environment({}) is None
    assert distributed.environment({"WORLD_SIZE": "1"}) is None
    assert distributed.environment({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert distributed.environment(GOOD) == distributed.Launch(1, 2, 1, "127.0.0.1", 29500)
    assert distributed.environment(_env(LOCAL_RANK=None)).local_rank == 0


@pytest.mark.parametrize("command", [["attribute", "--clt", "{tmp}/absent", "--out", "{tmp}/g"],
                                     ["dataset", "--data", "{tmp}/absent.json", "--out",
                                      "{tmp}/d"]])
def test_the_commands_check_it_first(command, tmp_path, monkeypatch, capsys):
    """Before flags, files or models: the error names RANK, not the absent file."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    assert main([part.format(tmp=tmp_path) for part in command]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: RANK='5'") and "absent" not in err, err


def _env_for(port: int, rank: int, monkeypatch) -> None:
    for name, value in _env(RANK=str(rank), LOCAL_RANK=str(rank),
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)


def test_a_port_in_use_fails_at_once_and_a_silent_one_within_the_bound(monkeypatch):
    """Rank 0 cannot serve a port another program holds; rank 1 on that port (it accepts and
    never answers: torch's store would wait forever) fails within the rendezvous bound."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        _env_for(port, 0, monkeypatch)
        start = time.perf_counter()
        with pytest.raises(DistributedError, match=f"rank 0 .*127.0.0.1:{port}.*in use"):
            distributed.init(rendezvous_s=1)
        assert time.perf_counter() - start < 5
        _env_for(port, 1, monkeypatch)
        start = time.perf_counter()
        with pytest.raises(DistributedError, match=f"rank 1 of 2 .*127.0.0.1:{port} within 1 s"):
            distributed.init(rendezvous_s=1)
        assert time.perf_counter() - start < 10
    finally:
        holder.close()


def test_collectives_take_their_tensors_on_the_backends_device(monkeypatch):
    """NCCL has no CPU collectives and gloo's CUDA ones stop at broadcast and all_reduce: every
    collective hands torch its tensors on ``distributed._wire()`` (the rank's GPU under NCCL,
    the CPU under gloo) and returns them on the caller's device. torch's collectives are
    replaced by recorders here: no process group, no GPU."""
    seen = []

    def all_reduce(tensor, op=None):
        seen.append(("all_reduce", tensor.device))
        tensor.mul_(2)

    def all_gather(parts, tensor):
        seen.append(("all_gather", tensor.device, *(p.device for p in parts)))
        for part in parts:
            part.copy_(tensor)

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed.dist, "all_gather", all_gather)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "gloo")
    ranks = distributed.Ranks(0, 2)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(ranks.all_reduce(x), torch.tensor([2.0, 4.0]))
    assert torch.equal(x, torch.tensor([1.0, 2.0])), "the caller's tensor was summed in place"
    gathered = ranks.all_gather(torch.arange(6.0).reshape(3, 2))
    assert [g.shape for g in gathered] == [(3, 2), (3, 2)]
    assert all(d == torch.device("cpu") for entry in seen for d in entry[1:])

    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert distributed._wire() == torch.device("cuda", 1)
