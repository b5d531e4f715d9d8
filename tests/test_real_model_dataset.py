"""Dataset runs on the real SmolLM2-135M: known facts from known_1000 and every built-in task."""

from __future__ import annotations

import json

import pytest
from _support.data import known_facts

from pyvene_causaltrace.dataset import TASKS, read_records, trace_dataset

pytestmark = pytest.mark.real_model


def _last_token_last_layer(result, kind="residual"):
    return result.aie[kind][result.roles.index("Last token")][-1]


@pytest.mark.numerics
def test_known_facts_screen_and_trace(smollm2, tmp_path):
    model, tokenizer = smollm2
    records, _ = read_records(known_facts())
    result = trace_dataset(model, tokenizer, records, out=tmp_path, limit=3,
                           kinds=["residual"], seeds=2, progress=False, n_boot=200)
    screen = [json.loads(line) for line in (tmp_path / "screen.jsonl").open()]
    kept = [line for line in screen if line["kept"]]
    assert len(kept) == 3 and result.screen["kept"] == 3
    for line in screen:  # the screen's verdict is the model's own argmax
        assert line["kept"] == (line["predicted"] == line["target"])
    effects = result.effects["residual"]
    assert effects["total_effect"] > 0.1 and effects["corrupt_prob"] < effects["clean_prob"]
    # restoring the last position's last layer gives the clean run back
    assert abs(_last_token_last_layer(result) - effects["total_effect"]) < 1e-5


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.numerics
def test_each_task_runs_on_smollm2(smollm2, tmp_path, name):
    model, tokenizer = smollm2
    task = TASKS[name]
    result = trace_dataset(model, tokenizer, task.records, out=tmp_path, limit=1,
                           kinds=["residual"], seeds=1, known=task.known, progress=False,
                           n_boot=50)
    effects = result.effects["residual"]
    assert effects["n_facts"] == 1
    assert effects["total_effect"] > 0  # corrupting the span costs the target probability
    assert abs(_last_token_last_layer(result) - effects["total_effect"]) < 1e-5
