"""How much memory this process may use: the one rule every size check reads (a fit, a
bootstrap, a steering run's generation)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the machine's memory needs no torch
    import torch


def device_bytes(device: torch.device | None = None) -> int:
    """Bytes this process may use on ``device``: a GPU's memory, else (a CPU, or None) the
    machine's or its control group's limit, whichever is less."""
    if device is not None and device.type == "cuda":
        import torch  # a GPU in use: torch is loaded already

        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"),
                  Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdecimal():
            total = min(total, int(text))
    return total
