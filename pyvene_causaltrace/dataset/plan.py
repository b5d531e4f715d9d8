"""A dataset run's options, checked before the model loads, and its sizes, checked before
anything large is allocated.

    check_options(kinds=["residual"], seeds=3, scale=3.0, sigma="rome", window=10,
                  known="argmax", limit=None, memory_budget_mb=2048, n_boot=1000)
    check_boot_fits(n_boot=1000, n_facts=200, n_values=7 * 30)   # MemoryCapError if it cannot

A seed count is checked as a count: ``seeds=100000000`` is refused (here if it is not a
positive integer, by :func:`~pyvene_causaltrace.tracing.chunks.check_seeds_fit` against the
memory budget once the model is known) without building its list of seeds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import InputError, MemoryCapError
from ..finite import positive_number
from ..interventions.noise import SIGMA_METHODS, seed_list
from ..tracing.engine import get_kind

KNOWN_RULES = ("argmax", "none")


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return value


def seed_count(seeds: int | Sequence[int]) -> int:
    """How many seeds ``seeds`` names (a count is not expanded into a list)."""
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds <= 0:
            raise InputError(f"seeds must be a positive count or a non-empty list, got {seeds}")
        return seeds
    return len(seed_list(seeds))


def check_options(*, kinds: Sequence[str], seeds: int | Sequence[int], scale: float,
                  sigma: str | float, window: int, known: str, limit: int | None,
                  memory_budget_mb: float, n_boot: int) -> int:
    """Refuse an option no dataset run accepts, naming it; returns the number of seeds."""
    kinds = list(kinds)
    if not kinds:
        raise InputError("kinds: give at least one trace kind")
    for kind in kinds:
        get_kind(kind)
    if len(set(kinds)) != len(kinds):
        raise InputError(f"kinds repeat: {','.join(kinds)}")
    n_seeds = seed_count(seeds)
    positive_number(scale, "scale (a dataset run needs one fixed noise scale)")
    if isinstance(sigma, str):
        if sigma not in SIGMA_METHODS:
            raise InputError(f"sigma must be a number or one of {SIGMA_METHODS}, got {sigma!r}")
    else:
        positive_number(sigma, "sigma")
    _positive_int(window, "window")
    if known not in KNOWN_RULES:
        raise InputError(f"known must be one of {KNOWN_RULES}, got {known!r}")
    if limit is not None:
        _positive_int(limit, "limit")
    positive_number(memory_budget_mb, "memory_budget_mb (--budget-mb)")
    _positive_int(n_boot, "n_boot (--boot, bootstrap resamples)")
    return n_seeds


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its control group's limit."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"),
                  Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def bootstrap_bytes(n_boot: int, n_facts: int, n_values: int) -> int:
    """Bytes a percentile bootstrap of ``n_values`` means over ``n_facts`` holds at once:
    resample weights and draws, the resampled means and the quantiles' working copies."""
    return 8 * n_boot * (2 * n_facts + 4 * n_values)


def check_boot_fits(n_boot: int, n_facts: int, n_values: int) -> None:
    """Refuse, before allocating, a bootstrap that cannot fit this machine's memory."""
    need, have = bootstrap_bytes(n_boot, n_facts, n_values), machine_memory()
    if need > have:
        most = max(1, have // max(1, bootstrap_bytes(1, n_facts, n_values)))
        raise MemoryCapError(
            f"n_boot (--boot) {n_boot}: the bootstrap over {n_facts} fact(s) would hold "
            f"{_size(need)}, more than this machine's {_size(have)}; use at most {most} "
            "resamples (1000 is the usual)")


def _size(n_bytes: float) -> str:
    power = min(4, int(math.log(max(n_bytes, 1), 1024)))
    return f"{n_bytes / 1024 ** power:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[power]}"
