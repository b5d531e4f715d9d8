"""The numbers every shipped spec (and the README's pyvene example) gives on SmolLM2.

``python -m tests.golden.numbers`` writes them to ``spec_numbers.json``; ``test_golden`` checks that
the code still gives them. Settings that make a spec slow are cut the same way each time: a trace
spec runs with one seed, and a spec naming the fitted CLT gets a fixed random fixture CLT (the
fitted one is not in a fresh clone) — its ``feature_ablate`` entries then name that CLT's
features 0, 1, ... in their order (it has 8 per layer). Regenerate only when a change of numbers
is intended.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

SPECS = Path(__file__).resolve().parents[2] / "intervention_specs"
GOLDEN = Path(__file__).with_name("spec_numbers.json")


def fixture_clt(root: Path, model) -> Path:
    """A small seeded random CLT shaped for ``model`` (8 features per layer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from clt_fixtures import random_clt_tensors, write_clt

    n_layers, d_model = model.config.num_hidden_layers, model.config.hidden_size
    tensors = random_clt_tensors(n_layers, d_model, 8, seed=0, threshold=0.05)
    return write_clt(root / "clt", tensors, model_name="smollm2-135m")


def fixture_lorsa(root: Path, model) -> Path:
    """A small seeded random Lorsa set shaped for ``model``, in llamascopium's layout: layers 3
    and 6, 9 QK heads of 64 dims, 72 OV heads (8 per QK head), TopK 8."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lorsa_fixtures import peer_config, peer_tensors, write_peer_lorsa

    d_model = model.config.hidden_size
    for layer in (3, 6):
        cfg = peer_config(layer=layer, d_model=d_model, n_qk=9, d_qk=64, expansion=72 / d_model,
                          top_k=8, rotary_adjacent_pairs=False, rotary_dim=64, n_ctx=256,
                          norm_activation="inference")
        write_peer_lorsa(root / "lorsa" / f"L{layer}", cfg, peer_tensors(cfg, seed=layer))
    return root / "lorsa"


def spec_numbers(path: Path, model, tokenizer, clt: Path, lorsa: Path | None = None) -> dict:
    from pyvene_causaltrace import attribute, run_spec
    from pyvene_causaltrace.tracing.tracer import tracer_from_spec

    data = json.loads(path.read_text())
    if "trace" in data:
        data = copy.deepcopy(data)
        data["interventions"][0]["seeds"] = 1
        tracer = tracer_from_spec(data, model, tokenizer)
        result = tracer.trace(data["trace"]["kind"], window=data["trace"].get("window", 10))
        return {"scale": float(result.scale), "sigma": float(result.sigma),
                "recovery": [float(v) for v in result.recovery.flatten()]}
    if "attribution" in data:
        block = data["attribution"]
        from pyvene_causaltrace.transcoders import load_transcoder

        graph = attribute(model, tokenizer, load_transcoder(str(clt)), data["prompt"],
                          data["answer"], target=block["target"], k=block["k"],
                          memory_mb=block["memory_mb"],
                          max_feature_nodes=block["max_feature_nodes"])
        closure = graph.closure
        parts = graph.decomposition()
        # steering nodes came later (issue 22): a plain model's graph has none
        if parts.pop("steering", 0.0) != 0.0:
            raise AssertionError("a plain model's graph has steering nodes")
        return {"closure": [closure.target, closure.edges, closure.constant],
                "n_features": int(graph.n_features),
                "decomposition": {k: float(v) for k, v in parts.items()}}
    for item in data["interventions"]:
        if item["type"] == "clt_splice":
            item["clt"] = str(clt)
        if item["type"] == "lorsa_splice":
            item["lorsa"] = str(lorsa)
        if item["type"] == "feature_ablate" and item["features"] != "all":
            item["features"] = list(range(len(item["features"])))
    result = run_spec(data, model, tokenizer)
    return {"clean": result.clean_prob, "corrupt": result.corrupt_probs,
            "intervened": result.intervened_probs, "components": result.components}


def readme_pyvene_example(model, tokenizer) -> list[float]:
    """The README's NoiseAdd + VanillaIntervention example, P(' Paris') per row, in our
    ``IntervenableModel`` (pyvene's own refuses a ``NoiseAdd`` with its own positions)."""
    from pyvene_causaltrace import IntervenableModel
    from pyvene_causaltrace.interventions.noise import NoiseAdd
    from pyvene_causaltrace.pyvene_boundary.intervenable import preserve_hooks
    from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

    pv = import_pyvene()
    inputs = tokenizer(["The Eiffel Tower is in the city of"] * 3, return_tensors="pt")
    source = tokenizer(["The Colosseum is in the city of"] * 3, return_tensors="pt")
    noise = NoiseAdd(seeds=[0, 1, 2], positions=[0, 1, 2, 3], scale=3.0, sigma=0.122)
    pv_model = IntervenableModel([
        {"component": "model.embed_tokens.output", "intervention": noise},
        {"layer": 20, "component": "block_output", "intervention_type": pv.VanillaIntervention},
    ], model)
    with preserve_hooks(pv_model):
        _, out = pv_model(base=dict(inputs), sources=[None, dict(source)],
                          unit_locations={"sources->base": ([None, [[8]] * 3],
                                                            [None, [[8]] * 3])})
    paris = tokenizer(" Paris")["input_ids"][0]
    return out.logits[:, -1].double().softmax(-1)[:, paris].tolist()


def all_numbers(model, tokenizer, root: Path) -> dict:
    clt, lorsa = fixture_clt(root, model), fixture_lorsa(root, model)
    out = {spec.name: spec_numbers(spec, model, tokenizer, clt, lorsa)
           for spec in sorted(SPECS.glob("*.json"))}
    out["README pyvene example"] = readme_pyvene_example(model, tokenizer)
    return out


if __name__ == "__main__":
    import tempfile

    from pyvene_causaltrace.models import load_model

    torch.set_grad_enabled(True)
    model, tokenizer = load_model("smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp:
        numbers = all_numbers(model, tokenizer, Path(tmp))
    GOLDEN.write_text(json.dumps(numbers, indent=1) + "\n")
    print({k: (v if not isinstance(v, dict) else list(v)) for k, v in numbers.items()})
