"""The cases of issue 51 that the one argument check at the boundary (arguments.py) closes, each
as it was reported: every one returned a wrong result or a raw traceback on 906c686.

The fuzz test (tests/test_arguments_fuzz.py) covers every public callable by its signature;
these are the reported cases by name, on real objects, so that a reader sees each one refused
with the argument named — and, for the silent ones, the run they used to return."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _support.models import PROMPT, make_tiny_model
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import (
    attention_annotations,
    attribute,
    head_loadings,
    qk_attribution,
)
from pyvene_causaltrace.cli import main
from pyvene_causaltrace.errors import CausalTraceError, InputError
from pyvene_causaltrace.tracing import Tracer
from pyvene_causaltrace.transcoders import load_from_disk

TWICE = "Paris is the capital of France and Paris is"  # the subject occurs twice


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """A tiny Llama (3 layers, 4 heads), a CLT and the graph of PROMPT."""
    model = make_tiny_model("llama", init=0.2, n_layers=3)
    tensors = random_clt_tensors(3, 32, 48, threshold=0.1)
    clt = load_from_disk(str(write_clt(tmp_path_factory.mktemp("clt"), tensors)))
    return model, tokenizer, clt, attribute(model, tokenizer, clt, PROMPT)


def _refused(call, *names: str) -> InputError:
    with pytest.raises(InputError) as raised:
        call()
    for name in names:
        assert name in str(raised.value), raised.value
    return raised.value


# ------------------------------------------------------------- case 1: occurrence=-1

@pytest.mark.parametrize("occurrence", [-1, -2])
def test_a_negative_occurrence_is_refused_not_the_wrong_tokens_noised(world, occurrence):
    """On 906c686 occurrence=-1 noised ('Paris',)'s neighbour tokens and returned a trace."""
    model, tokenizer, _, _ = world
    _refused(lambda: Tracer(model, tokenizer, TWICE, "Paris", occurrence=occurrence),
             "occurrence")
    second = Tracer(model, tokenizer, TWICE, "Paris", occurrence=1, seeds=1, scale=3.0)
    first = Tracer(model, tokenizer, TWICE, "Paris", occurrence=0, seeds=1, scale=3.0)
    assert second.prompt.subject_range > first.prompt.subject_range  # the control: 1 is later
    assert second.prompt.tokens[slice(*second.prompt.subject_range)] == (
        first.prompt.tokens[slice(*first.prompt.subject_range)])


# ------------------------------------------------------------- case 2: heads arguments

@pytest.mark.parametrize("layers", ["12", [1.7], [True], [-0.5], True, [np.float64(1.0)], [9],
                                    [-1], []])
def test_head_loadings_refuses_layers_that_are_not_layers(world, layers):
    """'12' was layers [1, 2]; [1.7], [True], [-0.5] and True were layers 1, 1, 0 and 1."""
    model, _, clt, graph = world
    _refused(lambda: head_loadings(model, clt, graph, layers=layers), "layers")


@pytest.mark.parametrize("target", [-0.9, 1.5, True, "3", 10 ** 9, -1])
def test_head_loadings_refuses_a_target_that_is_not_a_node(world, target):
    """-0.9, 1.5, True and '3' were nodes 0, 1, 1 and 3."""
    model, _, clt, graph = world
    _refused(lambda: head_loadings(model, clt, graph, target=target), "target")


def test_head_loadings_takes_numpy_indices_as_the_same_ints(world):
    model, _, clt, graph = world
    a = head_loadings(model, clt, graph, layers=[np.int64(1)])
    b = head_loadings(model, clt, graph, layers=[1])
    assert a.layers == [1] and torch.equal(a.parts, b.parts)


@pytest.mark.parametrize("kwargs, name", [
    ({"layer": True}, "layer"), ({"key_pos": True}, "key_pos"), ({"head": 1.0}, "head"),
    ({"head": 4}, "head"), ({"query_pos": "0"}, "query_pos"), ({"layer": np.float32(0)}, "layer"),
    ({"memory_mb": True}, "memory_mb"), ({"memory_mb": math.nan}, "memory_mb"),
    ({"memory_mb": math.inf}, "memory_mb"), ({"memory_mb": "64"}, "memory_mb"),
])
def test_qk_attribution_refuses_bools_floats_and_strings(world, kwargs, name):
    """layer=True / key_pos=True ran on layer 1 / key 1; memory_mb=True was 1 MB."""
    model, _, clt, graph = world
    arguments = {"layer": 1, "head": 0, "query_pos": -1, "key_pos": 0, **kwargs}
    _refused(lambda: qk_attribution(model, clt, graph, **arguments), name)


def test_head_loadings_refuses_a_dict_graph_and_no_transcoder(world):
    model, _, clt, graph = world
    _refused(lambda: head_loadings(model, clt, {"nodes": []}), "graph")
    _refused(lambda: head_loadings(model, None, graph), "transcoder")


def test_a_graph_of_another_model_is_refused(world):
    """Another model of the same shapes whose changed weights the prompt never reads (a token
    row of the embedding that PROMPT does not use) gives the same features and rows, so the
    replay check passed; the graph now carries the weights' fingerprint."""
    model, _, clt, graph = world
    other = make_tiny_model("llama", init=0.2, n_layers=3)
    unused = sorted(set(range(other.config.vocab_size)) - set(graph.input_ids))[-1]
    with torch.no_grad():
        other.get_input_embeddings().weight[unused] += 1.0
    _refused(lambda: head_loadings(other, clt, graph), "another model")
    assert head_loadings(model, clt, graph).layers == [0, 1, 2]  # the control


@pytest.mark.parametrize("kwargs, name", [
    ({"max_qk": -1}, "max_qk"), ({"max_edges": 1.5}, "max_edges"),
    ({"memory_mb": math.nan}, "memory_mb"), ({"node_threshold": 2.0}, "node_threshold"),
])
def test_attention_annotations_refuses_bad_sizes(world, kwargs, name):
    model, _, clt, graph = world
    _refused(lambda: attention_annotations(model, clt, graph, **kwargs), name)


# --------------------------------------------------- case 5 and raw tracebacks: texts

@pytest.mark.parametrize("prompt", ["   ", "\t\n", "The \udcff Tower", 5, b"The"])
def test_prompts_that_are_not_text_are_refused(world, prompt):
    model, tokenizer, clt, _ = world
    _refused(lambda: attribute(model, tokenizer, clt, prompt), "prompt")
    _refused(lambda: Tracer(model, tokenizer, prompt, "The"), "prompt")


@pytest.mark.parametrize("subject", ["  ", "\udcff"])
def test_subjects_that_are_not_text_are_refused(world, subject):
    model, tokenizer, _, _ = world
    _refused(lambda: Tracer(model, tokenizer, PROMPT, subject), "subject")


@pytest.mark.parametrize("answer", [5, " \udcff", "  "])
def test_answers_that_are_not_text_are_refused(world, answer):
    model, tokenizer, clt, _ = world
    _refused(lambda: attribute(model, tokenizer, clt, PROMPT, answer), "answer")


@pytest.mark.parametrize("flag", ["--prompt", "--answer", "--subject"])
def test_undecodable_bytes_on_the_command_line_are_one_error_line(flag, capsys):
    """Python hands undecodable argv bytes on as lone surrogates; the tokenizer then raised a
    raw TypeError."""
    value = b"The \xff Tower".decode("utf-8", "surrogateescape")
    code = main(["trace", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and flag in lines[0] and "UTF-8" in lines[0], err


def test_every_refusal_is_the_package_error_family(world):
    """The family a caller catches: InputError is a CausalTraceError and a ValueError."""
    model, _, clt, graph = world
    with pytest.raises(CausalTraceError):
        head_loadings(model, clt, graph, layers="12")
    with pytest.raises(ValueError):
        head_loadings(model, clt, graph, layers="12")
