"""Our hooks act only on the forwards we run (issue 37, case 1).

Thread A runs one of our measurements on a tiny model while thread B, the user's own code, calls
``model(input_ids=ids)`` on the same model object in a loop. B starts before A and stops after
it, so the two overlap for A's whole run. Every one of B's logits must be exactly the bare
model's (``torch.equal``) — none of our hooks, replaced forwards or switched config settings may
reach it — and A's result must be bit-equal to the same call run alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _support.models import PROMPT, SUBJECT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace import Tracer, attribute, intervene_features
from pyvene_causaltrace.hooking import thread_view
from pyvene_causaltrace.transcoders import load_transcoder

L, D, F = 3, 32, 48
MAX_USER_FORWARDS = 5000  # B's bound, should A hang


@pytest.fixture
def one_thread():
    """One intra-op torch thread: A and B interleave at the Python level, as users' threads do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _with_user_forwards(model, ids, measure):
    """Run ``measure()`` (thread A, this one) while another thread loops bare forwards on
    ``model``: twice, and again until 20 of B's forwards overlapped (at most 8 runs). Returns
    (A's results, B's logits, how many of B's forwards ran during A's runs)."""
    seen: list[torch.Tensor] = []
    errors: list[BaseException] = []
    running, done = threading.Event(), threading.Event()

    def user():
        while not done.is_set() and len(seen) + len(errors) < MAX_USER_FORWARDS:
            try:
                seen.append(model(input_ids=ids).logits.detach())
            except BaseException as error:  # noqa: BLE001 -- every failure is a finding
                errors.append(error)
            running.set()

    thread = threading.Thread(target=user, daemon=True)
    thread.start()
    assert running.wait(30), "the user's thread never ran a forward"
    before = len(seen) + len(errors)
    results = []
    try:
        while len(results) < 2 or (len(seen) + len(errors) - before < 20 and len(results) < 8):
            results.append(measure())
    finally:
        during = len(seen) + len(errors) - before
        done.set()
        thread.join(60)
    assert not thread.is_alive()
    assert not errors, (f"{len(errors)} of the user's {len(seen) + len(errors)} forwards "
                        f"raised, e.g. {errors[0]!r}")
    return results, seen, during


def _assert_bare(seen, bare, during):
    assert during >= 3, f"only {during} of the user's forwards overlapped our run"
    wrong = [(out - bare).abs().max().item() for out in seen if not torch.equal(out, bare)]
    assert not wrong, (f"{len(wrong)} of the user's {len(seen)} forwards were not the bare "
                       f"model's logits (max |diff| {max(wrong):.3g})")


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    model = make_tiny_model("llama", init=0.2, n_layers=L)
    tensors = random_clt_tensors(L, D, F, threshold=0.1)
    clt = load_transcoder(str(write_clt(tmp_path_factory.mktemp("threads") / "clt", tensors)))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        bare = model(input_ids=ids).logits
    return model, tokenizer, clt, ids, bare


def test_a_trace_leaves_other_threads_forwards_bare(world, one_thread):
    model, tokenizer, _, ids, bare = world

    def trace():
        tracer = Tracer(model, tokenizer, PROMPT, SUBJECT, answer=" the", seeds=3, scale=3.0)
        return tracer.trace("residual")

    alone = trace()
    results, seen, during = _with_user_forwards(model, ids, trace)
    _assert_bare(seen, bare, during)
    for result in results:
        assert torch.equal(torch.as_tensor(result.restored_probs),
                           torch.as_tensor(alone.restored_probs))
        assert result.clean_prob == alone.clean_prob
        assert torch.equal(torch.as_tensor(result.corrupt_probs),
                           torch.as_tensor(alone.corrupt_probs))


def test_an_attribution_leaves_other_threads_forwards_bare(world, one_thread):
    model, tokenizer, clt, ids, bare = world

    def graph():
        return attribute(model, tokenizer, clt, PROMPT, batch_size=16)

    alone = graph()
    results, seen, during = _with_user_forwards(model, ids, graph)
    _assert_bare(seen, bare, during)
    theirs = alone.rows.state()
    for result in results:
        assert torch.equal(result.activation, alone.activation)
        ours = result.rows.state()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours)


@pytest.mark.parametrize("freeze_attention", [False, True])
def test_steering_leaves_other_threads_forwards_bare(world, one_thread, freeze_attention):
    """With ``freeze_attention`` the run reads eager attention patterns and holds them: the
    attention implementation it switches to is the measuring thread's alone."""
    model, tokenizer, clt, ids, bare = world

    def steer():
        return intervene_features(model, tokenizer, clt, PROMPT, [(1, -1, 3, 5.0)],
                                  max_new_tokens=3, freeze_attention=freeze_attention)

    alone = steer()
    results, seen, during = _with_user_forwards(model, ids, steer)
    _assert_bare(seen, bare, during)
    for result in results:
        assert torch.equal(result.logits, alone.logits)
        assert torch.equal(result.clean_logits, alone.clean_logits)
        assert result.generated_ids == alone.generated_ids


def test_a_thread_view_is_the_measuring_threads_alone():
    """``thread_view``: the settings we switch on a shared object (a model's config) read as
    switched in the thread that switched them and as they are everywhere else; nested views
    stack, and the object's own class and values are back afterwards."""
    model = make_tiny_model("llama", n_layers=1)
    config = model.config
    kind, original = type(config), config._attn_implementation
    other: list = []

    def read():
        other.append((config._attn_implementation, config.vocab_size))

    with thread_view(config, _attn_implementation_internal="eager"):
        with thread_view(config, vocab_size=7):
            assert (config._attn_implementation, config.vocab_size) == ("eager", 7)
            thread = threading.Thread(target=read)
            thread.start()
            thread.join()
        assert (config._attn_implementation, config.vocab_size) == ("eager", 420)
    assert other == [(original, 420)]
    assert type(config) is kind and config._attn_implementation == original
