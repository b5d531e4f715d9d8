"""Fit a small transcoder to SmolLM2-135M's MLPs on this machine — cross-layer (CLT) or a
per-layer set (PLT, optionally with a skip path) — save it outside the repository, run the pairing
check and the replacement anchor on held-out facts, and the attribution graphs of four facts.

    python examples/fit_smollm2_clt.py --features 256 --steps 400                 # CLT, ~16 min
    python examples/fit_smollm2_clt.py --kind per_layer --features 256 --steps 400
    python examples/fit_smollm2_clt.py --kind per_layer --skip --features 256 --steps 400

Saves to ``~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-<clt|plt|skip-plt>-<features>``
(mntss layout for a CLT, circuit-tracer's for a set; the names ``pyvene-causaltrace fit`` gives,
without its ``fit.json``, so that command refuses to take one for its own) and writes
``examples/results/smollm2_<clt|plt|skip_plt>_fit.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from smollm2_traces import FACTS

from pyvene_causaltrace import load_model
from pyvene_causaltrace.attribution import attribute
from pyvene_causaltrace.fitting import FitSettings, transcoder_dir
from pyvene_causaltrace.transcoders import load_transcoder
from pyvene_causaltrace.transcoders.checks import check_pairing, replacement_anchor
from pyvene_causaltrace.transcoders.fit import fit_clt

KNOWN = Path(__file__).resolve().parents[2] / "shared" / "data" / "known_1000.json"


def four_facts(model, tokenizer, transcoder) -> dict:
    """Closure, error share and scores of the four facts' attribution graphs."""
    out = {}
    for name, prompt, _, answer in FACTS:
        start = time.perf_counter()
        graph = attribute(model, tokenizer, transcoder, prompt, answer)
        parts, scores = graph.decomposition(), graph.scores()
        out[name] = {"active_features": graph.n_features,
                     "closure_relative": graph.closure.relative,
                     "feature_closure": graph.feature_closure(),
                     "errors_over_target": parts["error_share"],
                     "replacement": scores["replacement"],
                     "completeness": scores["completeness"],
                     "seconds": time.perf_counter() - start}
        print(f"{name}: {out[name]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--features", type=int, default=256, help="features per layer")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kind", choices=("cross_layer", "per_layer"), default="cross_layer")
    parser.add_argument("--skip", action="store_true", help="a per-layer set with W_skip")
    parser.add_argument("--train-facts", type=int, default=1000)
    parser.add_argument("--data", type=Path, default=KNOWN)
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    facts = json.loads(args.data.read_text())
    texts = [f"{f['prompt']} {f['attribute']}" for f in facts]
    train, held_out = texts[:args.train_facts], texts[-100:]
    tc, stats = fit_clt(model, tokenizer, train, d_transcoder=args.features, steps=args.steps,
                        kind=args.kind, skip=args.skip, model_name="smollm2-135m",
                        progress=True)
    tag = {"cross_layer": "clt", "per_layer": "plt"}[args.kind]
    tag = "skip_plt" if args.skip else tag
    out = transcoder_dir(FitSettings(kind=tag, features=args.features))
    tc.save_model(str(out))
    tc = load_transcoder(out)
    pairing = check_pairing(model, tokenizer, tc, held_out)
    anchor = replacement_anchor(model, tokenizer, tc, held_out,
                                prompt="The Eiffel Tower is in the city of", answer=" Paris")
    print(f"fit: {stats}")
    print(pairing.verdict())
    print(anchor.summary())
    graphs = four_facts(model, tokenizer, tc)
    flags = (f" --kind {args.kind}" if args.kind != "cross_layer" else "") \
        + (" --skip" if args.skip else "")
    record = {"command": f"python examples/fit_smollm2_clt.py{flags} --features "
                         f"{args.features} --steps {args.steps}",
              "saved_to": str(out), "features_per_layer": args.features, "kind": args.kind,
              "skip": args.skip, "fit": stats.__dict__, "pairing": pairing.to_dict(),
              "anchor": anchor.to_dict(), "four_facts": graphs}
    path = Path(__file__).parent / "results" / f"smollm2_{tag}_fit.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
