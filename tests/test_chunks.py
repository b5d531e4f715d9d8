"""The engine's chunk plan: a partition of the rows whose chunks start no later than any of their
rows, fit the memory budget, and cost no more than the obvious plans."""

from __future__ import annotations

import math

import pytest
import torch

from pyvene_causaltrace.tracing.chunks import ChunkCost, plan_chunks

L, T = 12, 9


def _rows(seed: int, n: int = 300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, T, (n,), generator=g), torch.randint(0, L + 1, (n,), generator=g)


def _cost(plan, cost):
    return sum(cost.of(c.rows.numel(), T - c.prefix, L - c.first_layer) for c in plan)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cost", [ChunkCost(0.0, 0.0), ChunkCost(40.0, 300.0),
                                  ChunkCost(1e9, 1e9)], ids=["free", "cpu-like", "huge"])
def test_a_plan_partitions_the_rows_and_starts_each_chunk_low_enough(seed, cost):
    positions, firsts = _rows(seed)
    limit = lambda prefix: 20 + 5 * prefix  # noqa: E731
    plan = plan_chunks(positions, firsts, n_layers=L, seq_len=T, max_rows=limit, cost=cost)
    rows = torch.cat([c.rows for c in plan])
    assert sorted(rows.tolist()) == list(range(positions.numel()))
    for chunk in plan:
        assert 0 < chunk.rows.numel() <= limit(chunk.prefix)
        assert int(positions[chunk.rows].min()) == chunk.prefix
        assert int(firsts[chunk.rows].min()) == chunk.first_layer
    again = plan_chunks(positions, firsts, n_layers=L, seq_len=T, max_rows=limit, cost=cost)
    assert [c.rows.tolist() for c in again] == [c.rows.tolist() for c in plan]


@pytest.mark.parametrize("seed", range(5))
def test_free_forwards_give_homogeneous_chunks_and_costly_ones_few(seed):
    positions, firsts = _rows(seed)
    unlimited = lambda prefix: 10**6  # noqa: E731
    fine = plan_chunks(positions, firsts, n_layers=L, seq_len=T, max_rows=unlimited,
                       cost=ChunkCost(0.0, 0.0))
    groups = {(int(p), int(c)) for p, c in zip(positions, firsts, strict=True)}
    assert len(fine) == len(groups)
    for chunk in fine:
        assert len({(int(positions[r]), int(firsts[r])) for r in chunk.rows}) == 1
    coarse = plan_chunks(positions, firsts, n_layers=L, seq_len=T, max_rows=unlimited,
                         cost=ChunkCost(1e9, 1e9))
    assert len(coarse) == 1


@pytest.mark.parametrize("seed", range(5))
def test_the_plan_costs_no_more_than_the_obvious_plans(seed):
    """Against one forward per (position, first layer) group and one forward per position."""
    positions, firsts = _rows(seed)
    cost = ChunkCost(40.0, 300.0)
    plan = plan_chunks(positions, firsts, n_layers=L, seq_len=T, max_rows=lambda p: 10**6,
                       cost=cost)
    per_group = sum(cost.of(int(((positions == p) & (firsts == c)).sum()), T - p, L - c)
                    for p in range(T) for c in range(L + 1)
                    if bool(((positions == p) & (firsts == c)).any()))
    per_position = sum(cost.of(int((positions == p).sum()), T - p,
                               L - int(firsts[positions == p].min()))
                       for p in range(T) if bool((positions == p).any()))
    assert _cost(plan, cost) <= min(per_group, per_position) + 1e-6


def test_switches_and_budget():
    positions, firsts = _rows(0)
    plan = plan_chunks(positions, firsts, n_layers=L, seq_len=T, max_rows=lambda p: 7,
                       cost=ChunkCost(1e9, 1e9), reuse_prefix=False, replay_layers=False)
    assert {(c.prefix, c.first_layer) for c in plan} == {(0, 0)}
    assert len(plan) == math.ceil(positions.numel() / 7)
    assert plan_chunks([], [], n_layers=L, seq_len=T, max_rows=lambda p: 1,
                       cost=ChunkCost(1.0, 1.0)) == []
    with pytest.raises(ValueError, match="one entry per row"):
        plan_chunks([1, 2], [1], n_layers=L, seq_len=T, max_rows=lambda p: 1,
                    cost=ChunkCost(1.0, 1.0))
