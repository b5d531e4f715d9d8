"""Our registered types next to pyvene's own, in one ``IntervenableModel``.

It is ours (a ``pv.IntervenableModel`` subclass): ``noise_add`` and ``clean_restore`` with their
own positions need it, and pyvene's own class refuses them.

The Eiffel Tower prompt on SmolLM2 with its subject noised (one row per seed). At layer 23 of the
last token we then either restore the clean state (``clean_restore``) or transplant the state of
"The Colosseum is in the city of" (pyvene's ``VanillaIntervention``), and read P(" Paris") and
P(" Rome").

    python examples/compose_with_pyvene.py
"""

from __future__ import annotations

import torch

from pyvene_causaltrace import IntervenableModel, load_model
from pyvene_causaltrace.capture import capture
from pyvene_causaltrace.interventions.noise import NoiseAdd
from pyvene_causaltrace.interventions.restore import CleanRestore
from pyvene_causaltrace.prompts import tokenize_prompt
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene
from pyvene_causaltrace.tracing.noise_scale import rome_sigma

pv = import_pyvene()
LAYER, SEEDS = 23, [0, 1, 2, 3, 4]


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    prompt = tokenize_prompt(tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower")
    source = tokenizer("The Colosseum is in the city of", return_tensors="pt")["input_ids"]
    assert source.shape == prompt.input_ids.shape, "the transplant needs equal lengths"
    paris, rome = (tokenizer(w, add_special_tokens=False)["input_ids"][0]
                   for w in (" Paris", " Rome"))
    last = prompt.seq_len - 1
    block = f"model.layers[{LAYER}].output"
    base = {"input_ids": prompt.input_ids.repeat(len(SEEDS), 1)}
    noise = NoiseAdd(seeds=SEEDS, positions=list(range(*prompt.subject_range)), scale=3.0,
                     sigma=rome_sigma(model, tokenizer, [prompt.subject]))
    embed = {"component": "model.embed_tokens.output", "intervention": noise}
    clean = capture(model, {"input_ids": prompt.input_ids}, [block])[block]

    def probs(pv_model, **kwargs):
        with torch.no_grad():
            logits = pv_model(base=base, **kwargs)[1].logits[:, -1].softmax(-1)
        return logits[:, paris].mean().item(), logits[:, rome].mean().item()

    rows = {
        "noise only": probs(IntervenableModel([embed], model)),
        f"noise + clean_restore L{LAYER}": probs(IntervenableModel([embed, {
            "component": block,
            "intervention": CleanRestore(positions=[last], states=clean)}], model)),
        f"noise + Colosseum state L{LAYER} (pyvene Vanilla)": probs(
            IntervenableModel([embed, {"layer": LAYER, "component": "block_output",
                                       "intervention_type": pv.VanillaIntervention}], model),
            sources=[None, {"input_ids": source.repeat(len(SEEDS), 1)}],
            unit_locations={"sources->base": ([None, [[last]] * len(SEEDS)],
                                              [None, [[last]] * len(SEEDS)])}),
    }
    print(f"{'run':<48} {'P(Paris)':>9} {'P(Rome)':>9}")
    for name, (p_paris, p_rome) in rows.items():
        print(f"{name:<48} {p_paris:>9.4f} {p_rome:>9.4f}")


if __name__ == "__main__":
    main()
