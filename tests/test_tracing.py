"""Causal tracing on tiny models: the batched engine against the batch-1 loop for every kind,
controls, results, noise sweep, roles and bad requests."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _support.data import SPEC_DIR
from _support.hooks import installed
from _support.models import PROMPT, SUBJECT, make_tiny_model
from reference import reference_kind_cell

from pyvene_causaltrace.models import get_adapter, get_module
from pyvene_causaltrace.prompts import SubjectNotFoundError
from pyvene_causaltrace.specs import SpecError, load_spec
from pyvene_causaltrace.tracing.chunks import ChunkCost
from pyvene_causaltrace.tracing.engine import KINDS, RESIDUAL_WINDOW, TraceEngine
from pyvene_causaltrace.tracing.head import ReusedHead
from pyvene_causaltrace.tracing.metrics import token_probs
from pyvene_causaltrace.tracing.noise_scale import NoiseScaleSweep
from pyvene_causaltrace.tracing.results import TraceResult
from pyvene_causaltrace.tracing.roles import token_role
from pyvene_causaltrace.tracing.tracer import Tracer, trace, tracer_from_spec

N_LAYERS, SEQ, SCALE, SIGMA, ANSWER = 4, 7, 3.0, 0.5, 11
NOISED, SEEDS = [1, 2, 3], [0, 5]


def _ids():
    return torch.randint(1, 400, (1, SEQ), generator=torch.Generator().manual_seed(0))


# chunk plans: "fine" runs every (position, first layer) group alone, so each row starts exactly
# at its restored layer; "coarse" mixes everything the memory budget allows, so most rows
# recompute corrupted layers and positions above their chunk's start
PLANS = {"fine": ChunkCost(0.0, 0.0), "coarse": ChunkCost(1e9, 1e9)}


def _engine_against_loop(arch, plan, dtype, rel, **options):
    model = make_tiny_model(arch, n_layers=N_LAYERS).to(dtype)
    ids = _ids()
    engine = TraceEngine(model, ids, NOISED, SEEDS, SCALE, SIGMA, ANSWER,
                         memory_budget_mb=0.1, **options)  # 3-4 rows a chunk
    engine.cost = PLANS[plan]
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    worst = 0.0
    for name, kind in {**KINDS, "residual-window": RESIDUAL_WINDOW}.items():
        got = engine.run(kind, cells, window=3)
        for s, seed in enumerate(SEEDS):
            for c, (layer, pos) in enumerate(cells):
                expected = reference_kind_cell(model, engine, kind, seed, layer, pos, 3)
                assert got[s, c].item() == pytest.approx(expected, rel=rel, abs=1e-12), (
                    name, seed, layer, pos)
                worst = max(worst, abs(got[s, c].item() - expected) / expected)
    # the kinds differ, so the comparison above was not trivially true
    residual = engine.run(KINDS["residual"], cells)
    severed = engine.run(KINDS["severed-mlp"], cells)
    assert (residual - severed).abs().max() > 1e-6
    assert (residual.max(1).values - residual.min(1).values).min() > 1e-6
    return worst


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("plan", ["fine", "coarse"])
@pytest.mark.numerics
def test_engine_equals_batch_one_loop_for_every_kind(arch, plan):
    """Rows starting at their restored layer and position (fine) or below it (coarse), across
    chunk boundaries, at the first and last layer and position, float32: to 1e-6."""
    _engine_against_loop(arch, plan, torch.float32, rel=1e-6)


@pytest.mark.parametrize("options", [dict(reuse_prefix=False), dict(replay_layers=False),
                                     dict(reuse_prefix=False, replay_layers=False)],
                         ids=["no-prefix", "no-replay", "neither"])
@pytest.mark.numerics
def test_engine_without_its_shortcuts(options):
    _engine_against_loop("llama", "fine", torch.float32, rel=1e-6, **options)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.numerics
def test_engine_equals_batch_one_loop_in_float64(arch):
    """In float64 only rounding separates the two paths (Qwen's RMSNorm computes in float32)."""
    worst = _engine_against_loop(arch, "fine", torch.float64, rel=1e-6)
    assert worst < (1e-13 if arch == "gpt2" else 1e-7)


def _counting(block) -> list[int]:
    """Count the rows each forward of ``block`` computes (an instance ``forward``: replay
    swaps it and puts it back, and it is no hook)."""
    computed: list[int] = []
    own = block.forward

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        computed.append(hidden.shape[0])
        return own(*args, **kwargs)

    block.forward = forward
    return computed


@pytest.mark.numerics
def test_a_users_hook_on_a_block_applies_once_and_every_layer_computes():
    """A hook of the user's on a block's output shaped the corrupted run's stored output; the
    engine cannot silence a hook that is not its own without rewriting torch's hook tables,
    so with one on a block no row replays a block: each computes every layer, and the hook
    applies once."""
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    shift = torch.randn(32, generator=torch.Generator().manual_seed(1))
    block = get_module(model, get_adapter(model).module_path("block", 1))
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    plain = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER).run(
        KINDS["residual"], cells)
    handle = block.register_forward_hook(lambda _m, _a, output: output + shift)
    try:
        engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER)
        engine.cost = PLANS["fine"]  # rows restoring layers 2, 3 would replay block 1
        first, last = _counting(model.model.layers[0]), _counting(model.model.layers[-1])
        for kind in (KINDS["residual"], KINDS["mlp"]):
            first.clear(), last.clear()
            got = engine.run(kind, cells, window=3)
            assert sum(first) == sum(last) > 0  # no block replayed: every row computes all
            for c, (layer, pos) in enumerate(cells):
                expected = reference_kind_cell(model, engine, kind, SEEDS[0], layer, pos, 3)
                assert got[0, c].item() == pytest.approx(expected, rel=1e-6), (kind, layer, pos)
        shifted = engine.run(KINDS["residual"], cells)
    finally:
        handle.remove()
        del model.model.layers[0].forward, model.model.layers[-1].forward
    assert ((shifted - plain).abs() / plain).max() > 0.05  # the hook matters


@pytest.mark.numerics
def test_the_packages_hook_on_a_replayed_block_is_silenced_and_applies_once():
    """A hook the package put on a block's output (a pv.IntervenableModel's intervention that
    our runs apply) shaped the corrupted run's stored output: a row that replays that block
    is right (the hook is silenced there, not applied twice), and it does replay it."""
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    shift = torch.randn(32, generator=torch.Generator().manual_seed(1))
    block = get_module(model, get_adapter(model).module_path("block", 1))
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    plain = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER).run(
        KINDS["residual"], cells)
    computed, last = _counting(block), _counting(model.model.layers[-1])
    try:
        with installed([(block, "forward", lambda _m, _a, output: output + shift)]):
            engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER)
            engine.cost = PLANS["fine"]  # rows restoring layers 2, 3 replay block 1
            for kind in (KINDS["residual"], KINDS["mlp"]):
                computed.clear(), last.clear()
                got = engine.run(kind, cells, window=3)
                assert 0 < sum(computed) < sum(last)  # block 1 was replayed for some rows
                for c, (layer, pos) in enumerate(cells):
                    expected = reference_kind_cell(model, engine, kind, SEEDS[0], layer, pos, 3)
                    assert got[0, c].item() == pytest.approx(expected, rel=1e-6), (
                        kind, layer, pos)
            shifted = engine.run(KINDS["residual"], cells)
    finally:
        del block.forward, model.model.layers[-1].forward
    assert ((shifted - plain).abs() / plain).max() > 0.05  # the hook matters


@pytest.mark.parametrize("kind", ["residual", "mlp", "severed-mlp", "attn"])
@pytest.mark.numerics
def test_unchanged_rows_need_no_forward(kind):
    """Rows before the first noised position and rows confined to the last layer off the last
    position take the reference runs' P (and a restored last block output at the last position
    the clean P) without a forward; they equal the computed rows to 1e-6."""
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    computed = []
    embed = get_module(model, get_adapter(model).module_path("embed"))
    handle = embed.register_forward_hook(lambda _m, _a, out: computed.append(out.shape[0]))
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    try:
        runs = {}
        for skip in (False, True):
            engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER,
                                 skip_unchanged=skip)
            computed.clear()
            runs[skip] = engine.run(KINDS[kind], cells, window=1)
            runs[skip, "rows"] = sum(computed)
    finally:
        handle.remove()
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-6, atol=1e-12)
    before = N_LAYERS * min(NOISED)  # cells before the first noised position, every layer
    last_layer = SEQ - 1 - min(NOISED)  # last layer, noised or later positions but the last
    clean_end = 1 if KINDS[kind].restore == "block" else 0
    skipped = (before + last_layer + clean_end) * len(SEEDS)
    assert runs[False, "rows"] == len(cells) * len(SEEDS)
    assert runs[True, "rows"] == len(cells) * len(SEEDS) - skipped
    # donor "corrupted" is a control of the machinery: nothing is skipped there
    engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER)
    donor = engine.run(KINDS[kind], cells, window=1, donor="corrupted")
    torch.testing.assert_close(donor, engine.corrupt_probs[:, ANSWER][:, None].expand_as(donor),
                               rtol=1e-6, atol=1e-12)


@pytest.mark.numerics
def test_last_mlp_runs_at_the_last_position_unless_someone_hooks_its_block():
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    mlp = get_module(model, get_adapter(model).module_path("mlp", N_LAYERS - 1))
    block = get_module(model, get_adapter(model).module_path("block", N_LAYERS - 1))
    seen: list[int] = []
    plain_forward = mlp.forward
    mlp.forward = lambda x: (seen.append(x.shape[1]), plain_forward(x))[1]
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER)
    seen.clear()
    fast = engine.run(KINDS["residual"], cells)
    assert seen and set(seen) == {1}
    read: list[torch.Tensor] = []  # a user's hook reading every position of the last block
    handle = block.register_forward_hook(lambda _m, _a, out: read.append(
        (out[0] if isinstance(out, tuple) else out).detach().clone()))
    try:
        seen.clear()
        hooked = engine.run(KINDS["residual"], cells)
    finally:
        handle.remove()
    assert max(seen) > 1  # left off: the hook sees real values at every position
    torch.testing.assert_close(hooked, fast, rtol=1e-6, atol=1e-12)
    for c, (layer, pos) in enumerate(cells[:: 5]):
        expected = reference_kind_cell(model, engine, KINDS["residual"], SEEDS[0], layer, pos, 1)
        assert fast[0, 5 * c].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kind", ["residual", "mlp"])
@pytest.mark.numerics
def test_rows_start_at_their_own_layer_inside_a_chunk(kind):
    """One chunk holds rows of every first layer; block j computes only those starting at or
    below it (the others take the corrupted run's stored output), and the rows are right."""
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    adapter = get_adapter(model)
    engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER,
                         skip_unchanged=False)
    engine.cost = PLANS["coarse"]
    computed = dict.fromkeys(range(N_LAYERS), 0)
    carried = dict.fromkeys(range(N_LAYERS), 0)  # rows reaching block j: those started by then
    handles = [get_module(model, adapter.module_path("mlp", j)).register_forward_hook(
        lambda _m, _a, out, j=j: computed.__setitem__(j, computed[j] + out.shape[0]))
        for j in range(N_LAYERS)]
    handles += [get_module(model, adapter.module_path("block", j)).register_forward_pre_hook(
        lambda _m, args, kwargs, j=j: carried.__setitem__(
            j, carried[j] + (args[0] if args else kwargs["hidden_states"]).shape[0]),
        with_kwargs=True) for j in range(N_LAYERS)]
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    try:
        got = engine.run(KINDS[kind], cells, window=1)
    finally:
        for handle in handles:
            handle.remove()
    shift = 1 if kind == "residual" else 0  # a restored block output is replayed
    expected = {j: sum(1 for layer, _ in cells if layer + shift <= j) * len(SEEDS)
                for j in range(N_LAYERS)}
    assert computed == expected
    assert carried[0] == len(cells) * len(SEEDS)  # the embeddings: every row
    assert all(carried[j] == expected[j] for j in range(1, N_LAYERS))
    for c, (layer, pos) in enumerate(cells[::3]):
        want = reference_kind_cell(model, engine, KINDS[kind], SEEDS[1], layer, pos, 1)
        assert got[1, 3 * c].item() == pytest.approx(want, rel=1e-6)


def test_the_head_writes_into_one_buffer_with_the_same_values(monkeypatch):
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    head = get_module(model, get_adapter(model).module_path("unembed"))
    reused = ReusedHead(head)
    assert reused.applies()
    width = head.in_features
    x1, x2 = torch.randn(6, 2, width), torch.randn(4, 3, width)[:, -1:]
    with torch.no_grad(), reused.installed():
        first = head(x1).clone()
        second = head(x2)
        assert second.data_ptr() == reused.buffer.data_ptr()  # no fresh memory
        assert torch.equal(first, torch.nn.functional.linear(x1, head.weight))
        assert torch.equal(second, torch.nn.functional.linear(x2, head.weight))
    assert "forward" not in head.__dict__ and reused.buffer is None
    with reused.installed():  # gradients wanted: the module's own forward
        assert head(x1.requires_grad_()).requires_grad
    # the engine's rows are the same bit for bit with the head left alone (a hook on it)
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    engine = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER, skip_unchanged=False)
    calls: list[int] = []  # chunks whose logits went into the buffer
    into_buffer = ReusedHead._forward
    monkeypatch.setattr(ReusedHead, "_forward",
                        lambda self, hidden: (calls.append(1), into_buffer(self, hidden))[1])
    fast = engine.run(KINDS["residual"], cells)
    assert calls  # the engine used the buffer
    handle = head.register_forward_hook(lambda _m, _a, out: None)
    try:
        assert not ReusedHead(head).applies()
        calls.clear()
        plain = engine.run(KINDS["residual"], cells)
        assert not calls
    finally:
        handle.remove()
    assert torch.equal(fast, plain)
    biased = torch.nn.Linear(width, 10)
    assert not ReusedHead(biased).applies()


@pytest.mark.parametrize("shape", [(300, 49152), (7, 513), (3, 1 << 19)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.numerics
def test_token_probs_in_blocks_equal_one_softmax(shape, dtype):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype) * 4
    token = shape[1] // 3
    expected = logits.double().softmax(-1)[:, token]
    got = token_probs(logits, token)
    assert got.dtype == torch.float64 and got.shape == (shape[0],)
    assert torch.allclose(got, expected, rtol=1e-14, atol=0)


@pytest.mark.numerics
def test_chunking_does_not_change_results():
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    cells = [(layer, pos) for layer in range(N_LAYERS) for pos in range(SEQ)]
    small = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER, memory_budget_mb=0.01)
    large = TraceEngine(model, _ids(), NOISED, SEEDS, SCALE, SIGMA, ANSWER, memory_budget_mb=512)
    assert small.rows_per_chunk(0) < 4 < large.rows_per_chunk(0)
    for kind in ("residual", "mlp"):
        torch.testing.assert_close(small.run(KINDS[kind], cells), large.run(KINDS[kind], cells),
                                   rtol=1e-6, atol=1e-10)


@pytest.fixture(scope="module")
def tiny_tracer(tokenizer):
    model = make_tiny_model("qwen3", n_layers=N_LAYERS)
    return Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=3, scale=3.0)


@pytest.mark.numerics
def test_controls_pass(tiny_tracer):
    report = tiny_tracer.controls(window=2)
    assert report.passed, report.summary()
    assert report.corrupted_donor_max_abs < 1e-6
    assert len(report.window_vs_single) >= 2
    assert "controls pass" in report.summary()


def test_controls_compute_every_row(tiny_tracer):
    """The controls check the machinery, so none of their rows takes a reference P."""
    model = tiny_tracer.model
    computed: list[int] = []
    embed = get_module(model, get_adapter(model).module_path("embed"))
    handle = embed.register_forward_hook(lambda _m, _a, out: computed.append(out.shape[0]))
    try:
        tiny_tracer.controls(window=2)
    finally:
        handle.remove()
    n_cells = N_LAYERS * tiny_tracer.prompt.seq_len
    centres = len({0, N_LAYERS // 3, (2 * N_LAYERS) // 3, N_LAYERS - 1})
    assert sum(computed) == (n_cells + 2 * centres) * len(tiny_tracer.seeds)


@pytest.mark.numerics
def test_trace_result_tables_json_plot(tiny_tracer, tmp_path):
    result = tiny_tracer.trace("mlp", window=2)
    n_tokens = len(result.tokens)
    assert result.restored_probs.shape == (3, N_LAYERS, n_tokens)
    assert result.window == 2 and result.kind == "mlp"
    frame = result.to_dataframe()
    assert list(frame.columns) == ["seed", "layer", "position", "token", "role", "prob",
                                   "recovery"]
    assert len(frame) == 3 * N_LAYERS * n_tokens
    row = frame[(frame.seed == 1) & (frame.layer == 2) & (frame.position == 4)].iloc[0]
    assert row.prob == result.restored_probs[1, 2, 4]
    assert row.recovery == pytest.approx(
        (row.prob - result.corrupt_probs[1]) / (result.clean_prob - result.corrupt_probs[1]))
    data = json.loads(result.to_json())
    for key in ("tokens", "subject_range", "answer", "clean_prob", "corrupt_probs", "kind",
                "window", "scale", "sigma", "seeds", "restored_probs", "recovery", "spec",
                "versions"):
        assert key in data
    assert np.array(data["recovery"]).shape == (3, N_LAYERS, n_tokens)
    again = TraceResult.from_json(result.to_json())
    np.testing.assert_array_equal(again.restored_probs, result.restored_probs)
    assert again.tokens == result.tokens and again.spec == result.spec
    result.plot(str(tmp_path / "mlp.png"))
    assert (tmp_path / "mlp.png").stat().st_size > 10_000
    peaks = result.peaks()
    for site in ("subject_best", "subject_last", "subject_mean", "last"):
        assert len(peaks[site]["peak_layer_per_seed"]) == 3
    assert "subject site" in result.summary()
    assert result.table().count("\n") == n_tokens


def test_diagnosis_of_an_empty_trace(tiny_tracer):
    notes = tiny_tracer.trace("residual").diagnose()
    assert any("clean confidence too low" in note for note in notes)  # random weights


def test_trace_spec_reproduces_the_trace(tiny_tracer):
    result = tiny_tracer.trace("attn", window=2)
    again = tracer_from_spec(result.spec, tiny_tracer.model, tiny_tracer.tokenizer).trace(
        "attn", window=2)
    np.testing.assert_array_equal(again.restored_probs, result.restored_probs)


@pytest.mark.parametrize("path", sorted(SPEC_DIR.glob("trace_*.json")), ids=lambda p: p.stem)
def test_shipped_trace_specs_run(path, tokenizer):
    data = json.loads(path.read_text())
    # random weights have no answer to collapse, so 'auto' would rightly refuse: fix the scale
    data["interventions"][0]["scale"] = 3.0
    spec = load_spec(data)
    model = make_tiny_model("gpt2", n_layers=3)
    tracer = tracer_from_spec(spec, model, tokenizer, memory_budget_mb=64)
    result = tracer.trace(spec.trace["kind"], window=spec.trace.get("window", 10))
    assert result.kind == spec.trace["kind"]
    assert result.restored_probs.shape[0] == len(tracer.seeds)


def test_noise_scale_choice_uses_the_worst_seed():
    sweep = NoiseScaleSweep([1.0, 3.0, 5.0], [0, 1], 0.8,
                            [[0.5, 0.6], [0.001, 0.3], [0.002, 0.004]], 0.01, 0.1, "rome")
    assert sweep.worst == [0.6, 0.3, 0.004]
    assert sweep.chosen == 5.0  # 3 sigma's mean is low but one seed keeps 0.3
    assert "worst seed 0.0040" in sweep.reason() and "3 sigma worst 0.3000" in sweep.reason()
    assert len(sweep.to_dataframe()) == 6
    none = NoiseScaleSweep([1.0], [0], 0.8, [[0.5]], 0.01, 0.1, "rome")
    assert none.chosen is None and "no scale" in none.reason()


def test_auto_scale_refuses_when_nothing_collapses(tokenizer):
    """A random model has no fact to destroy: P(argmax) ~ 1/vocab at every scale."""
    model = make_tiny_model("llama", n_layers=N_LAYERS)
    with pytest.raises(ValueError, match="scale='auto': no scale up to 50 sigma"):
        Tracer(model, tokenizer, PROMPT, SUBJECT, seeds=2, scale="auto", scales=(1.0, 2.0, 50.0))


@pytest.mark.parametrize("subject_range, seq_len, expected", [
    ((0, 3), 6, ["First subject token", "Middle subject tokens", "Last subject token",
                 "First subsequent token", "Further tokens", "Last token"]),
    ((2, 4), 7, ["Before subject", "Before subject", "First subject token",
                 "Last subject token", "First subsequent token", "Further tokens",
                 "Last token"]),
    ((1, 2), 4, ["Before subject", "Last subject token", "First subsequent token",
                 "Last token"]),
    ((0, 2), 3, ["First subject token", "Last subject token", "Last token"]),
])
def test_token_roles(subject_range, seq_len, expected):
    assert [token_role(p, subject_range, seq_len) for p in range(seq_len)] == expected


def test_bad_requests(tokenizer):
    model = make_tiny_model("llama", n_layers=2)
    with pytest.raises(SubjectNotFoundError, match="Louvre"):
        trace(model, tokenizer, PROMPT, "Louvre")
    with pytest.raises(ValueError, match="prompt='' .*not blank"):
        trace(model, tokenizer, "", SUBJECT)
    with pytest.raises(ValueError, match="seeds"):
        trace(model, tokenizer, PROMPT, SUBJECT, seeds=0)
    with pytest.raises(ValueError, match="window"):
        trace(model, tokenizer, PROMPT, SUBJECT, kind="mlp", window=0)
    with pytest.raises(ValueError, match="unknown trace kind 'mlps'.*severed-attn"):
        trace(model, tokenizer, PROMPT, SUBJECT, kind="mlps")
    with pytest.raises(ValueError, match="scale"):
        trace(model, tokenizer, PROMPT, SUBJECT, scale=-1.0)
    with pytest.raises(SpecError) as error:
        load_spec({"schema_version": 1, "prompt": PROMPT, "subject": SUBJECT,
                   "trace": {"kind": "residual"},
                   "interventions": [{"type": "noise_add", "seeds": 2},
                                     {"type": "clean_restore", "layers": 0, "positions": 0}]})
    assert error.value.path == "$.interventions"


def test_the_package_exports_the_trace_function():
    """``trace`` is the function even once the module holding ``Tracer`` is imported (a
    submodule of the same name used to shadow it)."""
    import pyvene_causaltrace.tracing as tracing
    from pyvene_causaltrace.tracing import Tracer as _  # noqa: F401

    assert callable(tracing.trace) and tracing.trace is trace
