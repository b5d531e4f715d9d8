"""Attribution on the real SmolLM2-135M: the local replacement model is the model, the target
closes, batched rows equal the per-node loop, and a per-layer set fitted briefly closes too.
(That a graph's top features matter more than random ones is checked on a fitted tiny model:
test_clt_model.)"""

from __future__ import annotations

import pytest
import torch
from _support.models import PROMPT
from clt_fixtures import random_clt_tensors, write_clt

from pyvene_causaltrace.attribution import attribute, make_target, run_local_replacement
from pyvene_causaltrace.attribution.edges import (
    feature_rows,
    feature_rows_loop,
    feature_targets,
    target_row,
)
from pyvene_causaltrace.transcoders import load_from_disk


def _fixture_clt(tmp_path):
    """A CLT of SmolLM2's shape (30 x 64 features) with ~200 active features on the Eiffel
    prompt (SmolLM2's residual has a few massive dimensions: the encoder is scaled down)."""
    tensors = random_clt_tensors(30, 576, 64, threshold=0.6, seed=3)
    tensors["W_enc"] *= 0.02
    return load_from_disk(str(write_clt(tmp_path / "clt", tensors, model_name="smollm2-135m")))


@pytest.mark.numerics
def test_smollm2_graph_closes_and_batches_exactly(smollm2, tmp_path):
    model, tokenizer = smollm2
    clt = _fixture_clt(tmp_path)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        clean = model(input_ids=ids).logits
    target = make_target(clean, tokenizer, " Paris", kind="demeaned", k=10)
    run = run_local_replacement(model, clt, ids)
    assert run.logits.shape[1] == 1  # the last position's: every logit target reads it
    assert (run.logits.detach() - clean[:, -1:]).abs().max() < 1e-4
    assert run.n_features > 100
    _, _, closure = target_row(run, target)
    assert closure.relative < 1e-4, closure
    _, _, unfrozen = target_row(run_local_replacement(model, clt, ids, freeze=False), target)
    assert unfrozen.relative > 0.01  # frozen ~1e-7 of the scale; unfrozen 0.16: the edges miss
    index = torch.arange(0, run.n_features, max(1, run.n_features // 16))
    batched, batched_constants = feature_rows(run, index)
    looped, _ = feature_rows_loop(run, index)
    assert torch.allclose(batched, looped, atol=5e-5, rtol=1e-4)
    values = feature_targets(run, index).detach().double()
    residual = (batched.double().sum(1) + batched_constants.double() - values).abs().max()
    assert residual < 1e-4 * values.abs().max()


@pytest.mark.numerics
def test_smollm2_budgeted_graph_closes_and_reads_like_the_dense_reference(smollm2, tmp_path):
    """A feature-node budget on the real model: every computed row closes with the unexplored
    features as leaves, rows equal the per-node loop's, and the sparse reading equals the dense
    one."""
    from dense_reading import edge_mask, node_influence, prune, square

    model, tokenizer = smollm2
    clt = _fixture_clt(tmp_path)
    graph = attribute(model, tokenizer, clt, PROMPT, " Paris", max_feature_nodes=40)
    assert graph.n_explored == 40 < graph.n_features
    residual = graph.closures().abs()
    assert (residual <= 1e-4 * graph.rows.targets.abs().clamp(min=1e-3)).all(), residual.max()
    assert graph.decomposition()["unexplored"] != 0.0
    run = run_local_replacement(model, clt, tokenizer(PROMPT, return_tensors="pt")["input_ids"],
                                from_position=graph.from_position)  # SmolLM2 adds no BOS: 0
    explored = graph.explored.nonzero().squeeze(-1)
    looped, _ = feature_rows_loop(run, explored)
    rows = graph.rows.dense(graph.rows.row_of_node(graph.layout.n_nodes)[explored])
    assert torch.allclose(rows, looped, atol=5e-5, rtol=1e-4)
    dense = square(graph).double()
    assert torch.allclose(graph.influence(), node_influence(dense, graph.layout), atol=1e-6)
    reference = prune(dense, graph.layout)
    assert torch.equal(graph.prune().node_mask, reference.node_mask)
    assert torch.equal(edge_mask(graph.prune()), reference.edge_mask)


@pytest.mark.numerics
def test_shipped_attribution_spec_runs_from_the_cli(smollm2, tmp_path, capsys):
    """The shipped spec, with a fixture CLT of SmolLM2's shape in place of the fitted one."""
    from _support.data import SPEC_DIR

    from pyvene_causaltrace.cli import main

    clt_dir = _fixture_clt(tmp_path).source
    out = tmp_path / "graph"
    assert main(["attribute", "--spec", str(SPEC_DIR / "attribution_graph.json"), "--clt",
                 str(clt_dir), "--out", str(out)]) == 0
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert summary["settings"]["answer"] == " Paris"
    assert summary["closure"]["relative"] < 1e-4
    assert summary["feature_closure"] < 1e-4
    assert set(summary["ablation"]["top"]) == {"5", "10", "20"}
    # the spliced model with the clean error fixed is the model until something is ablated
    ablation = summary["ablation"]
    assert abs(ablation["spliced_prob"] - ablation["clean_prob"]) < 1e-4
    assert ablation["top"]["20"] != ablation["spliced_prob"]
    assert main(["run", str(SPEC_DIR / "attribution_graph.json")]) == 2
    assert "attribute --spec" in capsys.readouterr().err


@pytest.mark.numerics
def test_smollm2_with_a_fitted_per_layer_skip_set(smollm2):
    """A per-layer set with a skip path, fitted briefly to the real model's MLPs: the splice with
    its error is the model, and a budgeted graph closes (the skip path's edges included)."""
    from pyvene_causaltrace.interventions.clt_splice import clt_splice_representations
    from pyvene_causaltrace.pyvene_boundary.intervenable import intervenable_model_class
    from pyvene_causaltrace.transcoders.checks import check_pairing
    from pyvene_causaltrace.transcoders.fit import fit_clt

    model, tokenizer = smollm2
    texts = [PROMPT + " Paris", "Trento is located in the country of Italy",
             "Danish pastry was created in the country of Denmark",
             "Miles Davis plays the trumpet", "The Space Needle is in the city of Seattle",
             "Toko Yasuda plays the guitar", "Paris is the capital of France"] * 3
    tc, stats = fit_clt(model, tokenizer, texts, d_transcoder=64, steps=60, kind="per_layer",
                        skip=True)
    assert stats.train_fvu < 1 and tc.cfg.skip
    assert check_pairing(model, tokenizer, tc, texts[:7]).fvu < 1
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        clean = model(input_ids=ids).logits
        spliced = intervenable_model_class()(
            clt_splice_representations(model, tc, add_error=True), model)(
            base={"input_ids": ids})[1].logits
    assert (spliced - clean).abs().max() < 1e-4
    graph = attribute(model, tokenizer, tc, PROMPT, " Paris", max_feature_nodes=150)
    assert graph.n_features > 150 and graph.n_explored == 150
    assert graph.closure.relative < 1e-4, graph.closure
    assert graph.feature_closure() < 1e-4
