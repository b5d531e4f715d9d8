"""The engine's chunk plan: a partition of the rows whose chunks start no later than any of their
rows, fit the memory budget, and cost no more than the obvious plans."""

from __future__ import annotations

import math

import pytest
import torch
from _support.chunks_reference import cost_of, plan_chunks_reference

from pyvene_causaltrace.tracing.chunks import ChunkCost, plan_chunks

L, T = 12, 9


def _rows(seed: int, n: int = 300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, T, (n,), generator=g), torch.randint(0, L + 1, (n,), generator=g)


def _cost(plan, cost):
    return sum(cost_of(cost, c.rows.numel(), T - c.prefix, L - c.first_layer) for c in plan)


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
    per_group = sum(cost_of(cost, int(((positions == p) & (firsts == c)).sum()), T - p, L - c)
                    for p in range(T) for c in range(L + 1)
                    if bool(((positions == p) & (firsts == c)).any()))
    per_position = sum(cost_of(cost, int((positions == p).sum()), T - p,
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


def _random_case(seed: int):
    """A trace-like input: a random subset of (seed, layer, position) cells, each row starting
    at its layer + 1 (residual) or at its window's start (mlp/attn), or rows drawn at random;
    a random budget, cost model and switches."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    n_layers, seq_len = int(torch.randint(1, 17, (1,), generator=g)), int(
        torch.randint(1, 25, (1,), generator=g))
    seeds = int(torch.randint(1, 7, (1,), generator=g))
    shape = pick(["residual", "window", "random"])
    if shape == "random":
        n = int(torch.randint(1, 400, (1,), generator=g))
        positions = torch.randint(0, seq_len, (n,), generator=g)
        firsts = torch.randint(0, n_layers + 1, (n,), generator=g)
    else:
        keep = torch.rand(n_layers, seq_len, generator=g) < pick([1.0, 0.7, 0.2])
        layer, position = keep.nonzero().unbind(1)
        positions = position.repeat_interleave(seeds)
        start = (layer - 5).clamp(min=0) if shape == "window" else layer + 1
        firsts = start.repeat_interleave(seeds)
        if positions.numel() == 0:
            positions, firsts = torch.tensor([0]), torch.tensor([0])
    if pick([False, False, True]):  # sparse positions: np.unique rather than counting
        positions, seq_len = positions * 10**5, (seq_len - 1) * 10**5 + 1
    base, slope = int(torch.randint(1, 60, (1,), generator=g)), pick([0, 1, 7])
    max_rows = pick([lambda p: 10**6, lambda p: base + slope * p, lambda p: 0])
    params = (3_540_096, 61_568)[seed % 2]  # a SmolLM2-135M layer, a tiny Llama's
    cost = pick([ChunkCost.estimate("cpu", 4 * params, 2 * params, 4 * 49152 * 576),
                 ChunkCost.estimate("cuda", 2 * params, 2 * params, 2 * 512 * 64),
                 ChunkCost(0.0, 0.0), ChunkCost(40.0, 300.0), ChunkCost(1.0, 2.0),
                 ChunkCost(float(torch.rand(1, generator=g)) * 50, 1e9)])
    return positions, firsts, dict(n_layers=n_layers, seq_len=seq_len, max_rows=max_rows,
                                   cost=cost, reuse_prefix=pick([True, True, False]),
                                   replay_layers=pick([True, True, False]))


def _total(plan, settings):
    """A plan's estimated cost, each chunk from its own prefix and first layer."""
    return sum(cost_of(settings["cost"], c.rows.numel(), settings["seq_len"] - c.prefix,
                       settings["n_layers"] - c.first_layer) for c in plan)


@pytest.mark.parametrize("block", range(6))
def test_the_fast_plan_is_the_reference_plan(block):
    """On fresh random inputs the vectorised planner returns the reference's chunks (ties and
    all: the same floats decide them), which partition the rows within the budget."""
    for seed in range(block * 50, block * 50 + 50):
        positions, firsts, settings = _random_case(seed)
        plan = plan_chunks(positions, firsts, **settings)
        reference = plan_chunks_reference(positions, firsts, **settings)
        p = positions if settings["reuse_prefix"] else torch.zeros_like(positions)
        f = firsts if settings["replay_layers"] else torch.zeros_like(firsts)
        rows = torch.cat([c.rows for c in plan])
        assert sorted(rows.tolist()) == list(range(positions.numel()))
        for chunk in plan:
            assert 0 < chunk.rows.numel() <= max(1, settings["max_rows"](chunk.prefix))
            assert (int(p[chunk.rows].min()), int(f[chunk.rows].min())) == (
                chunk.prefix, chunk.first_layer)
        assert _total(plan, settings) == pytest.approx(_total(reference, settings), rel=1e-9,
                                                       abs=1e-9)
        assert [(c.prefix, c.first_layer, c.rows.tolist()) for c in plan] == [
            (c.prefix, c.first_layer, c.rows.tolist()) for c in reference], seed


def test_plans_in_turn_and_in_threads_do_not_share_scratch():
    """The planner's tables come from a per-thread buffer kept between calls: a plan is the same
    made alone, after a larger one, or in two threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [_random_case(seed) for seed in (3, 11, 17, 29)]

    def key(case):
        positions, firsts, settings = case
        return [(c.prefix, c.first_layer, c.rows.tolist())
                for c in plan_chunks(positions, firsts, **settings)]

    alone = [key(case) for case in cases]
    assert [key(case) for case in reversed(cases)] == alone[::-1]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            assert list(pool.map(key, cases)) == alone
