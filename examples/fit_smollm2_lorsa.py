"""Fit Lorsas (attention features, llamascopium's layout) to a few of SmolLM2-135M's attention
layers on this machine, check them, and save them outside the repository.

    python examples/fit_smollm2_lorsa.py --layers 2 5 8 --top-k 32 --steps 200   # ~15 min CPU
    SMOKE=1 python examples/fit_smollm2_lorsa.py                                  # tiny, 1 min

The fit is ``fit-lorsa``'s (:func:`pyvene_causaltrace.lorsa_fitting.fit_lorsa_set`, which calls
:func:`~pyvene_causaltrace.transcoders.lorsa_fit.fit_lorsa`): the model's own text (the first
transcoder's starts, sampled), cut to 64 tokens, a tenth as many more texts held out. Each Lorsa
starts from its layer's attention (transcoders/lorsa_fit.py: QK = the model's heads, 2 x head_dim
rank-1 OV heads per QK head, exact before TopK), TopK keeps ``--top-k`` OV heads per position, and
Adam trains the OV side. Reported beside the fit's held-out FVU: the FVU on the first 40 facts of
tests/data/facts.json, and the spliced model's P(answer) on four facts with and without the error
term. Saves ``~/.cache/pyvene_causaltrace/lorsas/smollm2-135m-lorsa-k<k>`` (one ``L<layer>``
directory per layer, each llamascopium's config.json + sae_weights.safetensors + lm_config.json,
and fit.json) and ``examples/results/smollm2_lorsa_fit.json``. The same from the command line:
``pyvene-causaltrace fit-lorsa --layers 2,5,8 --top-k 32 --steps 200``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from pyvene_causaltrace import load_model
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.interventions.lorsa_splice import lorsa_splice_representations
from pyvene_causaltrace.lorsa_fitting import LorsaFitSettings, fit_lorsa_set, lorsa_dir
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.transcoders.lorsa import load_lorsa, lorsa_fvu

ROOT = Path(__file__).resolve().parents[1]
FACTS = [("The Eiffel Tower is in the city of", " Paris"),
         ("The mother tongue of Danielle Darrieux is", " French"),
         ("Miles Davis plays the", " trumpet"), ("The capital of Japan is", " Tokyo")]


def answer_probs(model, tokenizer, lorsa) -> list[dict]:
    bound, out = bind(model), []
    for prompt, answer in FACTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        target = tokenizer(answer)["input_ids"][0]
        row = {"prompt": prompt}
        with torch.no_grad():
            row["clean"] = float(model(input_ids=ids).logits[0, -1].softmax(-1)[target])
            for name, error in (("spliced_with_error", True), ("spliced", False)):
                with intervened(bound, lorsa_splice_representations(model, lorsa,
                                                                    add_error=error)) as m:
                    row[name] = float(m(input_ids=ids).logits[0, -1].softmax(-1)[target])
        out.append(row)
    return out


def main() -> None:
    smoke = os.environ.get("SMOKE") == "1"
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[5] if smoke else [2, 5, 8])
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10 if smoke else 200)
    parser.add_argument("--texts", type=int, default=16 if smoke else 256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    settings = LorsaFitSettings(layers=tuple(args.layers), top_k=args.top_k, steps=args.steps,
                                texts=args.texts, batch=args.batch, length=64)
    out = lorsa_dir(settings)
    if smoke:
        out = out.with_name(out.name + "-smoke")
    fitted = fit_lorsa_set(settings, out=out, model=model, tokenizer=tokenizer)
    print(fitted.summary())
    facts = json.loads((ROOT / "tests" / "data" / "facts.json").read_text())
    held_out = [f"{f['prompt']}{f['attribute']}" for f in facts[:8 if smoke else 40]]
    again = load_lorsa(out)
    report = {**fitted.record, "path": str(out), "smoke": smoke,
              "fvu_facts": lorsa_fvu(model, tokenizer, again, held_out),
              "facts": answer_probs(model, tokenizer, again)}
    print(json.dumps(report, indent=2))
    if not smoke:
        (ROOT / "examples" / "results" / "smollm2_lorsa_fit.json").write_text(
            json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
