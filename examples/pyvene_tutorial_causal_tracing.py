"""pyvene's own causal-tracing tutorial, with our types swapped in, and the same run as a spec.

pyvene's tutorial (tutorials/advanced_tutorials/Causal_Tracing.ipynb) writes a
``NoiseIntervention`` by hand, builds an ``IntervenableConfig`` from ``RepresentationConfig``
entries and ``intervention_types``, and calls the ``IntervenableModel`` with ``sources`` and
``unit_locations``. Here the setup and the calls are the tutorial's, on the bundled SmolLM2 (which
splits "The Space Needle is in downtown" exactly as GPT-2 does, subject at positions 0-3); only
the types differ: ``NoiseAdd.configured(...)`` for its noise (seeded, ROME's 3 sigma) and
``CleanRestore`` for ``VanillaIntervention`` — pyvene builds both from the class, and their
positions come from ``unit_locations``. Each cell is then run again from a JSON spec with
``run_spec``; the two agree to the last bit.

    python examples/pyvene_tutorial_causal_tracing.py            # MLP and attention grids
    python examples/pyvene_tutorial_causal_tracing.py --spec-out cell.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pyvene_causaltrace import load_model, run_spec
from pyvene_causaltrace.interventions.noise import NoiseAdd, rome_sigma
from pyvene_causaltrace.interventions.restore import CleanRestore
from pyvene_causaltrace.pyvene_boundary.intervenable import preserve_hooks
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

pv = import_pyvene()
PROMPT, SUBJECT, ANSWER = "The Space Needle is in downtown", "The Space Needle", " Seattle"
SEED, SCALE, WINDOW = 1, 3.0, 10
STREAM_TO_SUBLAYER = {"mlp_output": "mlp", "attention_output": "attn"}


def corrupted_config(noise: type):
    """The tutorial's ``corrupted_config``: noise on block 0's input."""
    return pv.IntervenableConfig(representations=[pv.RepresentationConfig(0, "block_input")],
                                 intervention_types=noise)


def restore_corrupted_with_interval_config(noise: type, layer: int, stream: str, window: int,
                                           num_layers: int):
    """The tutorial's config: the noise, then ``stream`` restored over a window of layers."""
    start = max(0, layer - window // 2)
    end = min(num_layers, layer - (-window // 2))
    return pv.IntervenableConfig(
        representations=[pv.RepresentationConfig(0, "block_input")]
        + [pv.RepresentationConfig(i, stream) for i in range(start, end)],
        intervention_types=[noise] + [CleanRestore] * (end - start))


def tutorial_cell(model, tokenizer, noise: type, stream: str, layer: int, pos: int) -> float:
    """P(answer) with the subject noised and ``stream`` restored around ``layer`` at ``pos``,
    made the tutorial's way."""
    base = tokenizer(PROMPT, return_tensors="pt")
    config = restore_corrupted_with_interval_config(noise, layer, stream, WINDOW,
                                                    model.config.num_hidden_layers)
    n_restores = len(config.representations) - 1
    intervenable = pv.IntervenableModel(config, model)
    with preserve_hooks(intervenable), torch.no_grad():
        _, out = intervenable(
            dict(base), [None] + [dict(base)] * n_restores,
            {"sources->base": ([None] + [[[pos]]] * n_restores,
                               [[[0, 1, 2, 3]]] + [[[pos]]] * n_restores)})
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"][0]
    return float(out.logits[0, -1].double().softmax(-1)[answer])


def cell_spec(stream: str, layer: int, pos: int) -> dict:
    """The same cell as a JSON spec."""
    return {"schema_version": 1, "model": "smollm2-135m", "prompt": PROMPT, "subject": SUBJECT,
            "answer": ANSWER, "interventions": [
                {"type": "noise_add", "positions": "subject", "seeds": [SEED], "scale": SCALE,
                 "sigma": "rome"},
                {"type": "window_restore", "sublayer": STREAM_TO_SUBLAYER[stream],
                 "center": layer, "window": WINDOW, "positions": [pos]}]}


def noise_type(model, tokenizer) -> type:
    """Our noise, configured as the tutorial's NoiseIntervention is: pyvene builds it from the
    class. Its positions come from the call's unit_locations."""
    return NoiseAdd.configured(seeds=[SEED], scale=SCALE,
                               sigma=rome_sigma(model, tokenizer, [SUBJECT]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec-out", type=Path, help="write the (mlp, layer 10, pos 3) spec")
    parser.add_argument("--layers", type=int, default=None, help="first N layers only")
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    noise = noise_type(model, tokenizer)
    n_layers = args.layers or model.config.num_hidden_layers
    n_pos = len(tokenizer(PROMPT)["input_ids"])
    for stream in STREAM_TO_SUBLAYER:
        print(f"{stream}: P({ANSWER!r}) restoring a window of {WINDOW} layers")
        for layer in range(n_layers):
            probs = [tutorial_cell(model, tokenizer, noise, stream, layer, pos)
                     for pos in range(n_pos)]
            print(f"  layer {layer:2d} " + " ".join(f"{p:.3f}" for p in probs))
    spec = cell_spec("mlp_output", 10, 3)
    ours = run_spec(spec, model, tokenizer).intervened_probs[0]
    theirs = tutorial_cell(model, tokenizer, noise, "mlp_output", 10, 3)
    print(f"mlp, layer 10, pos 3: tutorial setup {theirs:.6f}, JSON spec {ours:.6f}")
    if args.spec_out:
        args.spec_out.write_text(json.dumps(spec, indent=2) + "\n")


if __name__ == "__main__":
    main()
