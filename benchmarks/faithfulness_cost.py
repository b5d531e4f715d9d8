"""What a faithfulness curve costs on SmolLM2-135M with the first transcoder (the per-layer
skip set of 256 TopK-16 features that ``examples/first_graph.py`` fits and saves): forwards per
curve and seconds, for the node and the edge ranking, counterfactual patching, MIB's ten sizes,
``--draws`` random rankings, ``--batch`` circuits per forward. The graph is built first (not
timed here); each curve is run twice and the second timed (the first warms the caches).

    OMP_NUM_THREADS=2 python benchmarks/faithfulness_cost.py
    SMOKE=1 python benchmarks/faithfulness_cost.py      # a tiny random model and CLT instead
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from pyvene_causaltrace import attribute, load_model, load_transcoder
from pyvene_causaltrace.attribution.faithfulness import faithfulness

PROMPT, ANSWER = "The Eiffel Tower is in the city of", " Paris"
COUNTERFACTUAL = "The Colosseum is in the city of"
TRANSCODER = "~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16"


def _smoke():
    """A tiny random Llama, a random CLT and the tests' tokenizer (tests/_support)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from _support.models import make_tiny_model, make_tokenizer  # the tests' fixtures
    from clt_fixtures import random_clt_tensors, write_clt  # the tests' fixtures

    from pyvene_causaltrace.transcoders import load_from_disk  # with the fixtures above

    folder = Path(tempfile.mkdtemp())
    clt = load_from_disk(str(write_clt(folder / "clt", random_clt_tensors(3, 32, 48,
                                                                          threshold=0.1))))
    return make_tiny_model("llama"), make_tokenizer(), clt, "The Space Needle is in the city of"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--levels", default="nodes,edges")
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    if os.environ.get("SMOKE"):
        model, tokenizer, clt, counterfactual = _smoke()
        answer = None
    else:
        model, tokenizer = load_model("smollm2-135m")
        clt = load_transcoder(os.path.expanduser(TRANSCODER))
        counterfactual, answer = COUNTERFACTUAL, ANSWER
    start = time.perf_counter()
    graph = attribute(model, tokenizer, clt, PROMPT, answer)
    print(f"{graph!r} ({time.perf_counter() - start:.1f} s)")
    foil = None if answer is not None else 5
    rows = []
    for level in args.levels.split(","):
        for _ in range(2):
            curve = faithfulness(model, tokenizer, clt, graph, counterfactual, foil=foil,
                                 level=level, draws=args.draws, batch_size=args.batch)
        rows.append({"level": level, "batch": args.batch, "items": curve.n_items,
                     "circuits": 1 + (1 + args.draws) * len(curve.counts),
                     "forwards": curve.forwards,
                     "seconds": round(curve.seconds, 2), "cpr": round(curve.cpr, 4),
                     "cmd": round(curve.cmd, 4), "nodes_kept": curve.nodes_kept,
                     "random_cpr": [round(c, 4) for c in curve.random_cpr],
                     "f": [round(v, 4) for v in curve.f], "foil": curve.foil})
        print(json.dumps(rows[-1]))
    if args.record is not None:
        args.record.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
