"""Peak bytes of live tensors while a function runs, on any device torch's profiler sees
(the CPU's included, where torch keeps no allocator statistics), split by phase.

Every allocation and free of a tensor's memory is a profiler memory event; their running sum
from the start is the live bytes, its maximum the peak. A phase is a
:func:`torch.profiler.record_function` range whose name starts with ``pvct.``
(:func:`phase`; ``attribute()`` marks its forward, target rows, each batch of feature rows and
each ranking): per phase name, the live bytes when it began and the peak inside it, the most
over its repeats. Tensors alive before the call and freed inside it count negative.

    with metered() as report:
        graph = attribute(model, tokenizer, clt, prompt, answer)
    report.peak, report.phases["pvct.rows"].transient
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

#: Prefix of the profiler ranges :func:`metered` reports as phases.
PREFIX = "pvct."


def phase(name: str) -> record_function:
    """A profiler range :func:`metered` reports as phase ``pvct.<name>`` (a few microseconds
    when no profiler runs)."""
    return record_function(PREFIX + name)


@dataclass(frozen=True)
class Phase:
    """One phase's bytes (relative to the measurement's start), the most over its repeats:
    live when it began, the peak inside it, and ``transient``, the most it rose above its
    own start."""

    count: int
    start: int
    peak: int
    transient: int


@dataclass
class MemoryReport:
    """Filled when :func:`metered`'s block ends: ``peak`` and ``end`` (bytes above the start,
    every device together; ``by_device`` apart) and the ``phases``."""

    peak: int = 0
    end: int = 0
    by_device: dict[str, int] = field(default_factory=dict)
    phases: dict[str, Phase] = field(default_factory=dict)


@contextmanager
def metered(device: str | None = None) -> Iterator[MemoryReport]:
    """Measure the block's live tensor bytes (module docstring); ``device`` (``"cpu"``,
    ``"cuda"``) counts that device's alone, None every device's."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    report = MemoryReport()
    with profile(activities=activities, profile_memory=True) as prof:
        yield report
    memory, ranges = [], []
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if name == "[memory]":
            kind = str(event.device_type()).rsplit(".", 1)[-1].lower()
            if device is None or kind == device:
                memory.append((event.start_ns(), event.nbytes(), kind))
        elif name.startswith(PREFIX):
            ranges.append((event.start_ns(), event.start_ns() + event.duration_ns(), name))
    memory.sort(key=lambda m: m[0])
    times, live = [], []
    total, per_device = 0, {}
    for when, nbytes, kind in memory:
        total += nbytes
        per_device[kind] = per_device.get(kind, 0) + nbytes
        report.by_device[kind] = max(report.by_device.get(kind, 0), per_device[kind])
        times.append(when)
        live.append(total)
    report.peak, report.end = max(live, default=0), total
    report.phases = _phases(times, live, ranges)


def _phases(times: list[int], live: list[int], ranges: list[tuple[int, int, str]]
            ) -> dict[str, Phase]:
    """Per range name: its repeats, the live bytes at its start, its peak and its rise."""
    out: dict[str, Phase] = {}
    for begin, end, name in ranges:
        first, last = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        start, window = (live[first - 1] if first else 0), live[first:last]
        phase = Phase(1, start, max(window, default=start), max(0, max(window, default=0) - start))
        seen = out.get(name)
        if seen is not None:
            phase = Phase(seen.count + 1, max(phase.start, seen.start),
                          max(phase.peak, seen.peak), max(phase.transient, seen.transient))
        out[name] = phase
    return out
