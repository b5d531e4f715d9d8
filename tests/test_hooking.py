"""``installed``: the hooks of a block are on the model inside it and gone after it, however it
ends; hooks registered by anyone else stay."""

from __future__ import annotations

import pytest
import torch
from _support.hooks import installed
from torch import nn


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _hooks(model: nn.Module) -> dict[int, list[int]]:
    return {index: [*module._forward_hooks, *module._forward_pre_hooks]
            for index, module in enumerate(model.modules())}


def _count(model: nn.Module) -> int:
    return sum(len(ids) for ids in _hooks(model).values())


def _recording(model: nn.Module, seen: list[str]):
    return [
        (model[0], "forward", lambda m, args, out: seen.append("forward")),
        (model[0], "forward_pre", lambda m, args: seen.append("pre")),
        (model[2], "forward_with_kwargs", lambda m, args, kwargs, out: seen.append("kw")),
        (model[2], "forward_pre_with_kwargs", lambda m, args, kwargs: seen.append("pre-kw")),
    ]


def test_hooks_run_inside_the_block_and_are_gone_after_it():
    model = _model()
    seen: list[str] = []
    with installed(_recording(model, seen)) as handles:
        assert len(handles) == 4 and _count(model) == 4
        model(torch.ones(1, 4))
    assert seen == ["pre", "forward", "pre-kw", "kw"]
    assert _count(model) == 0
    model(torch.ones(1, 4))
    assert len(seen) == 4


def test_a_returned_value_replaces_the_output():
    model = _model()
    x = torch.ones(1, 4)
    with installed([(model[2], "forward", lambda m, args, out: out * 0)]):
        assert (model(x) == 0).all()
    assert not (model(x) == 0).all()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_hooks_are_removed_when_a_hooked_forward_raises(error):
    """An exception or Ctrl-C raised inside the forward (by a hook) leaves no hook."""
    model = _model()

    def boom(*_):
        raise error("stop")

    with pytest.raises(error), installed([(model[0], "forward", lambda *_: None),
                                          (model[2], "forward_pre", boom)]):
        model(torch.ones(1, 4))
    assert _count(model) == 0


def test_hooks_are_removed_when_the_block_raises():
    model = _model()
    with pytest.raises(ValueError, match="after"), \
            installed([(model[0], "forward", lambda *_: None)]):
        raise ValueError("after the hooks went on")
    assert _count(model) == 0


def test_the_users_hooks_before_and_inside_stay():
    model = _model()
    seen: list[str] = []
    before = model[0].register_forward_hook(lambda *_: seen.append("user-before"))
    with installed([(model[0], "forward", lambda *_: seen.append("ours"))]):
        inside = model[2].register_forward_pre_hook(lambda *_: seen.append("user-inside"))
    assert _count(model) == 2
    model(torch.ones(1, 4))
    assert seen == ["user-before", "user-inside"]
    before.remove()
    inside.remove()


def test_an_unknown_kind_registers_nothing():
    model = _model()
    with pytest.raises(ValueError, match="unknown hook kind 'backward'"), \
            installed([(model[0], "forward", lambda *_: None), (model[2], "backward", print)]):
        pass  # pragma: no cover
    assert _count(model) == 0


def test_nested_blocks_remove_only_their_own():
    model = _model()
    with installed([(model[0], "forward", lambda *_: None)]):
        with installed([(model[0], "forward", lambda *_: None)]):
            assert _count(model) == 2
        assert _count(model) == 1
    assert _count(model) == 0
