"""Fit a small cross-layer transcoder to SmolLM2-135M's MLPs on this machine, save it outside the
repository, and run the pairing check and the replacement anchor on held-out facts.

    python examples/fit_smollm2_clt.py --features 256 --steps 400     # ~15 min on 2 CPU cores

Saves to ``~/.cache/pyvene_causaltrace/clts/smollm2-135m-fitted-<features>`` (mntss layout) and
writes ``examples/results/smollm2_clt_fit.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pyvene_causaltrace import load_model
from pyvene_causaltrace.models import cache_dir
from pyvene_causaltrace.transcoders import load_from_disk
from pyvene_causaltrace.transcoders.checks import check_pairing, replacement_anchor
from pyvene_causaltrace.transcoders.fit import fit_clt

KNOWN = Path(__file__).resolve().parents[2] / "shared" / "data" / "known_1000.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--features", type=int, default=256, help="features per layer")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--train-facts", type=int, default=1000)
    parser.add_argument("--data", type=Path, default=KNOWN)
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    facts = json.loads(args.data.read_text())
    texts = [f"{f['prompt']} {f['attribute']}" for f in facts]
    train, held_out = texts[:args.train_facts], texts[-100:]
    clt, stats = fit_clt(model, tokenizer, train, d_transcoder=args.features, steps=args.steps,
                         model_name="smollm2-135m", progress=True)
    out = cache_dir() / "clts" / f"smollm2-135m-fitted-{args.features}"
    clt.save_model(str(out))
    clt = load_from_disk(out)
    pairing = check_pairing(clt, model, tokenizer, held_out)
    anchor = replacement_anchor(clt, model, tokenizer, held_out,
                                prompt="The Eiffel Tower is in the city of", answer=" Paris")
    print(f"fit: {stats}")
    print(pairing.verdict())
    print(anchor.summary())
    record = {"command": f"python examples/fit_smollm2_clt.py --features {args.features} "
                         f"--steps {args.steps}",
              "saved_to": str(out), "features_per_layer": args.features,
              "fit": stats.__dict__, "pairing": pairing.to_dict(), "anchor": anchor.to_dict()}
    path = Path(__file__).parent / "results" / "smollm2_clt_fit.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
