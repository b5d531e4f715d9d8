"""Obviously-correct reference paths for the equivalence tests: plain PyTorch hooks, one row at a
time, no pyvene."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pyvene_causaltrace.models import get_module


def recipe_noise(seed: int, n: int, hidden: int, scale: float, sigma: float) -> torch.Tensor:
    """DESIGN.md's noise recipe, written out independently of the package."""
    return torch.randn((n, hidden), generator=torch.Generator("cpu").manual_seed(seed),
                       dtype=torch.float32) * scale * sigma


@contextmanager
def edit_output(model, module_path: str, edit):
    """Replace ``module_path``'s output (first element of a tuple) by ``edit(output)``."""
    module = get_module(model, module_path)

    def hook(_module, _args, output):
        if isinstance(output, tuple):
            return (edit(output[0]),) + output[1:]
        return edit(output)

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def set_positions(states: torch.Tensor, positions: list[int]):
    """An ``edit`` that overwrites ``positions`` with ``states`` (batch 1)."""
    def edit(output):
        output = output.clone()
        output[:, positions] = states[:, positions].to(output.dtype)
        return output
    return edit


def add_at(delta: torch.Tensor, positions: list[int]):
    def edit(output):
        output = output.clone()
        output[:, positions] += delta.to(output.dtype)
        return output
    return edit
