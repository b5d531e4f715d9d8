"""The per-head trace (``Tracer.trace_heads``): every head of a layer restored at once is the
attention trace's one-layer restore; one head at a time is a batch-1 loop with a plain pre-hook
on the output projection; a head whose projection columns are zero changes nothing."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.errors import InputError
from pyvene_causaltrace.interventions.noise import noise_recipe
from pyvene_causaltrace.tracing import HeadTraceResult, Tracer
from pyvene_causaltrace.tracing.engine import KINDS
from pyvene_causaltrace.tracing.head_restore import HeadRestorer

ANSWER = " the"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def world(request, tokenizer):
    """A tiny model (Llama with grouped-query attention, GPT-2 with its Conv1D ``c_proj``)
    whose parts matter, and a tracer with 3 seeds."""
    model = make_tiny_model(request.param, init=0.2)
    return request.param, model, Tracer(model, tokenizer, PROMPT, SUBJECT, answer=ANSWER,
                                        seeds=3)


def _loop_probs(model, tracer, layer: int, head: int, position: int) -> np.ndarray:
    """P(answer) per seed, one forward each: the noise recipe added to the embeddings at the
    subject, and a plain forward-pre hook on layer ``layer``'s output projection swapping in
    the clean run's slice of head ``head`` at ``position``."""
    bound = bind(model)
    proj, embed = bound.module("attn_out", layer), bound.module("embed")
    ids = tracer.prompt.input_ids
    width = bound.head_dim
    box = {}
    handle = proj.register_forward_pre_hook(lambda _m, args: box.setdefault("z", args[0].clone()))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    clean = box["z"][0, position, head * width:(head + 1) * width]

    def swap(_module, args):
        z = args[0].clone()
        z[0, position, head * width:(head + 1) * width] = clean
        return (z, *args[1:])

    probs = []
    for seed in tracer.seeds:
        draw = noise_recipe(seed, len(tracer.noise_positions), bound.d_model, tracer.scale,
                            tracer.sigma)

        def noise(_module, _args, output, draw=draw):
            output = output.clone()
            output[0, tracer.noise_positions] += draw
            return output

        handles = [embed.register_forward_hook(noise), proj.register_forward_pre_hook(swap)]
        try:
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        probs.append(float(logits.double().softmax(-1)[tracer.answer_id]))
    return np.array(probs)


@pytest.mark.numerics
def test_every_head_at_once_is_the_attention_restore_of_one_layer(world):
    """Restoring all heads of a layer at a position equals the ``attn`` trace's restore of that
    layer's attention output there (window 1), at every layer and position."""
    _, _, tracer = world
    engine = tracer.engine
    restorer = HeadRestorer(engine)
    n_heads, seq = restorer.n_heads, engine.seq_len
    worst, effect, largest = 0.0, 0.0, 0.0
    for position in range(seq):
        at_position = [(layer, tuple(range(n_heads))) for layer in range(engine.n_layers)]
        heads = restorer.run(at_position, position)
        attn = engine.run(KINDS["attn"], [(layer, position) for layer in range(engine.n_layers)],
                          window=1, skip_unchanged=False)
        worst = max(worst, float((heads - attn).abs().max()))
        largest = max(largest, float(attn.max()))
        effect = max(effect, float((attn - engine.corrupt_probs[:, tracer.answer_id, None])
                                   .abs().max()))
    rounding = 1e-5 * largest  # float32 logits: a few ulps, relative to P
    assert worst <= rounding
    assert effect > 1000 * rounding  # the restores do something


@pytest.mark.numerics
def test_one_head_at_a_time_is_the_batch_1_loop(world):
    _, model, tracer = world
    result = tracer.trace_heads(progress=False)
    position = tracer.prompt.seq_len - 1
    assert result.position == position and result.layers == [0, 1, 2]
    assert result.restored_probs.shape == (3, 3, 4)
    scale = float(np.abs(result.indirect_effect).max())
    assert scale > 1e-5
    for i, layer in enumerate(result.layers):
        for head in range(result.n_heads):
            expected = _loop_probs(model, tracer, layer, head, position)
            assert np.allclose(result.restored_probs[:, i, head], expected, rtol=1e-5,
                               atol=1e-9), (layer, head)
    # control: the loop restoring a neighbouring head is told apart from the trace
    i, head = np.unravel_index(np.abs(result.grid()).argmax(), result.grid().shape)
    other = _loop_probs(model, tracer, result.layers[i], (head + 1) % result.n_heads, position)
    assert not np.allclose(result.restored_probs[:, i, head], other, rtol=1e-5, atol=1e-9)


@pytest.mark.numerics
def test_a_head_that_writes_nothing_changes_nothing(world, tokenizer):
    """Zero the projection columns that read one head: restoring that head is the corrupted
    run (the same forwards' unrestored row) up to float32 rounding of the logits — rows at
    other places of a batch round differently, 1e-12 here — though the head mattered before."""
    arch, model, tracer = world
    before = tracer.trace_heads(progress=False)
    i, head = np.unravel_index(np.abs(before.grid()).argmax(), before.grid().shape)
    layer = before.layers[i]
    assert abs(before.grid()[i, head]) > 1e-5
    silent = copy.deepcopy(model)
    proj = bind(silent).module("attn_out", layer)
    width = bind(silent).head_dim
    with torch.no_grad():
        columns = slice(head * width, (head + 1) * width)
        if arch == "gpt2":  # Conv1D: weight [in, out]
            proj.weight[columns] = 0
        else:
            proj.weight[:, columns] = 0
    other = Tracer(silent, tokenizer, PROMPT, SUBJECT, answer=ANSWER, seeds=3)
    probs = HeadRestorer(other.engine, [layer]).run([(layer, (head,)), (layer, ())])
    rounding = 1e-6 * float(probs.max())  # a few float32 ulps of the logits, in P
    assert float((probs[:, 0] - probs[:, 1]).abs().max()) <= rounding
    after = other.trace_heads(layer, progress=False)
    assert np.abs(after.indirect_effect[:, 0, head]).max() <= rounding
    assert np.abs(before.indirect_effect[:, i, head]).max() > 100 * rounding
    assert np.abs(after.indirect_effect[:, 0]).max() > 1e-5  # the other heads still act


@pytest.mark.numerics
def test_restoring_from_the_corrupted_run_changes_nothing(world):
    _, _, tracer = world
    restorer = HeadRestorer(tracer.engine)
    cells = [(layer, (head,)) for layer in restorer.layers for head in range(restorer.n_heads)]
    probs = restorer.run(cells, donor="corrupted")
    assert torch.allclose(probs, torch.as_tensor(tracer.corrupt_probs)[:, None], rtol=1e-6,
                          atol=0)


def test_result_tables_json_and_plot(world, tmp_path):
    _, _, tracer = world
    result = tracer.trace_heads([2, 0], position=3, progress=False)
    assert result.layers == [2, 0] and result.position == 3
    frame = result.to_dataframe()
    assert list(frame.columns) == ["seed", "layer", "head", "position", "prob", "effect",
                                   "recovery"]
    assert len(frame) == 3 * 2 * 4
    means = frame.groupby(["layer", "head"])["effect"].mean()
    assert means[(0, 1)] == pytest.approx(result.grid()[1, 1])
    again = HeadTraceResult.from_json(result.to_json())
    assert json.loads(again.to_json()) == json.loads(result.to_json())
    assert np.array_equal(again.restored_probs, result.restored_probs)
    assert "layer" in result.summary()
    result.plot(tmp_path / "heads.png")
    assert (tmp_path / "heads.png").stat().st_size > 5_000
    with pytest.raises(InputError, match="value"):
        result.grid("logit")


def test_bad_requests_are_refused(world):
    _, _, tracer = world
    with pytest.raises(InputError, match="layers"):
        tracer.trace_heads([3], progress=False)
    with pytest.raises(InputError, match="layers"):
        tracer.trace_heads([], progress=False)
    with pytest.raises(InputError, match="position"):
        tracer.trace_heads(0, position=tracer.prompt.seq_len, progress=False)
    with pytest.raises(InputError, match="progress"):
        tracer.trace_heads(0, progress="yes")
    restorer = HeadRestorer(tracer.engine, [1])
    with pytest.raises(InputError, match="not among"):
        restorer.run([(0, (1,))])
    with pytest.raises(InputError, match="heads"):
        restorer.run([(1, (4,))])
    with pytest.raises(InputError, match="donor"):
        restorer.run([(1, (0,))], donor="other")


@pytest.mark.numerics
def test_small_chunks_give_the_same_trace(world, tokenizer):
    """A memory budget of a few rows per forward splits the rows into many chunks."""
    _, model, tracer = world
    small = Tracer(model, tokenizer, PROMPT, SUBJECT, answer=ANSWER, seeds=3,
                   memory_budget_mb=0.2)
    assert small.engine.rows_per_chunk(0) < 12
    a, b = tracer.trace_heads(progress=False), small.trace_heads(progress=False)
    assert np.allclose(a.restored_probs, b.restored_probs, rtol=1e-5, atol=0)
