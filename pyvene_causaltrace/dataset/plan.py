"""A dataset run's sizes, checked before anything large is allocated.

    check_boot_fits(n_boot=1000, n_facts=200, n_values=7 * 30)   # MemoryCapError if it cannot

A seed count is checked as a count (``seeds=100000000`` is refused without building its list)."""

from __future__ import annotations

import math

from ..errors import MemoryCapError
from ..memory import device_bytes


def bootstrap_bytes(n_boot: int, n_facts: int, n_values: int) -> int:
    """Bytes a percentile bootstrap of ``n_values`` means over ``n_facts`` holds at once:
    resample weights and draws, the resampled means and the quantiles' working copies."""
    return 8 * n_boot * (2 * n_facts + 4 * n_values)


def check_boot_fits(n_boot: int, n_facts: int, n_values: int) -> None:
    """Refuse, before allocating, a bootstrap that cannot fit this machine's memory."""
    need, have = bootstrap_bytes(n_boot, n_facts, n_values), device_bytes()
    if need > have:
        most = max(1, have // max(1, bootstrap_bytes(1, n_facts, n_values)))
        raise MemoryCapError(
            f"n_boot (--boot) {n_boot}: the bootstrap over {n_facts} fact(s) would hold "
            f"{_size(need)}, more than this machine's {_size(have)}; use at most {most} "
            "resamples (1000 is the usual)")


def _size(n_bytes: float) -> str:
    power = min(4, int(math.log(max(n_bytes, 1), 1024)))
    return f"{n_bytes / 1024 ** power:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[power]}"
