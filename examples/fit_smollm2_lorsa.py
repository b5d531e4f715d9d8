"""Fit Lorsas (attention features, llamascopium's layout) to a few of SmolLM2-135M's attention
layers on this machine, check them, and save them outside the repository.

    python examples/fit_smollm2_lorsa.py --layers 2 5 8 --top-k 32 --steps 200   # ~15 min CPU
    python examples/fit_smollm2_lorsa.py --layers 23 --texts 192 --steps 300     # lorsa.md
    SMOKE=1 python examples/fit_smollm2_lorsa.py                                  # tiny, 1 min

Text: the model's own (fit_text.generate_ids' starts, sampled), cut to 64 tokens; held out:
the first 40 facts of tests/data/facts.json. Each Lorsa starts from its layer's attention
(transcoders/lorsa_fit.py: QK = the model's heads, 2 x head_dim rank-1 OV heads per QK head,
exact before TopK), TopK keeps ``--top-k`` OV heads per position, and Adam trains the OV side.
Reported: held-out FVU of each layer's attention output at the start (TopK applied to the
exact split) and after training, and the spliced model's P(answer) on four facts with and
without the error term. Saves ``~/.cache/pyvene_causaltrace/lorsas/smollm2-135m-lorsa-k<k>``
(one ``L<layer>`` directory per layer, each llamascopium's config.json +
sae_weights.safetensors + lm_config.json) and ``examples/results/smollm2_lorsa_fit.json``; layers
other than 2 5 8 get their own names (``...-k<k>-L23``, ``smollm2_lorsa_fit_L23.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pyvene_causaltrace import load_model
from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.fit_text import generate_ids
from pyvene_causaltrace.interventions.lorsa_splice import lorsa_splice_representations
from pyvene_causaltrace.models import cache_dir
from pyvene_causaltrace.runtime import intervened
from pyvene_causaltrace.transcoders.lorsa import load_lorsa, lorsa_fvu, save_lorsa
from pyvene_causaltrace.transcoders.lorsa_fit import fit_lorsa

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
    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m")
    start = time.perf_counter()
    ids, _, _ = generate_ids(bind(model), tokenizer, args.texts, 64, seed=0)
    texts = [tokenizer.decode(one, skip_special_tokens=True) for one in ids]
    generated = time.perf_counter() - start
    facts = json.loads((ROOT / "tests" / "data" / "facts.json").read_text())
    held_out = [f"{f['prompt']}{f['attribute']}" for f in facts[:8 if smoke else 40]]
    lorsa, report = fit_lorsa(model, tokenizer, texts, layers=args.layers, held_out=held_out,
                              top_k=args.top_k, steps=args.steps, batch=args.batch, length=64)
    fitted = time.perf_counter() - start - generated
    tag = "" if sorted(args.layers) == [2, 5, 8] else "-L" + "-".join(map(str, args.layers))
    smoke_tag = "-smoke" if smoke else ""
    out = cache_dir() / "lorsas" / f"smollm2-135m-lorsa-k{args.top_k}{tag}{smoke_tag}"
    for layer, one in lorsa.layers.items():
        save_lorsa(one, out / f"L{layer}", model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    again = load_lorsa(out)
    report.update({"path": str(out), "layers": args.layers, "texts": args.texts,
                   "seconds_generating": round(generated, 1), "seconds_fitting": round(fitted, 1),
                   "fvu_reloaded": lorsa_fvu(model, tokenizer, again, held_out),
                   "facts": answer_probs(model, tokenizer, again), "smoke": smoke})
    print(json.dumps(report, indent=2))
    if not smoke:
        record = ROOT / "examples" / "results" / f"smollm2_lorsa_fit{tag.replace('-', '_')}.json"
        record.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
