"""``pyvene-causaltrace``: the command line. Parses arguments, calls the library, writes files.

    pyvene-causaltrace trace                     # Eiffel Tower prompt on the bundled SmolLM2
    pyvene-causaltrace run intervention_specs/residual_trace.json --out out/
    pyvene-causaltrace validate intervention_specs/*.json
    pyvene-causaltrace interventions
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EIFFEL = {
    "prompt": "The Eiffel Tower is in the city of",
    "subject": "The Eiffel Tower",
    "answer": " Paris",
}
_KIND_COMPONENT = {"residual": "block_output", "mlp": "mlp_output", "attn": "attn_output"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyvene-causaltrace", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    trace = commands.add_parser(
        "trace", help="noise the subject, restore one layer at a time, print recovery per layer")
    trace.add_argument("--model", default="smollm2-135m")
    trace.add_argument("--prompt", default=EIFFEL["prompt"])
    trace.add_argument("--subject", default=EIFFEL["subject"])
    trace.add_argument("--answer", default=None,
                       help="target string (first token); default ' Paris' for the default "
                            "prompt, else the clean argmax")
    trace.add_argument("--kind", choices=sorted(_KIND_COMPONENT), default="residual")
    trace.add_argument("--positions", default="last_subject,last",
                       help="comma-separated position names or indices, each traced separately")
    trace.add_argument("--seeds", type=int, default=5)
    trace.add_argument("--scale", type=float, default=3.0)
    trace.add_argument("--out", type=Path, default=None, help="write trace.json here")

    run = commands.add_parser("run", help="run a JSON spec and print its probabilities")
    run.add_argument("spec", type=Path)
    run.add_argument("--model", default=None, help="overrides the spec's model")
    run.add_argument("--out", type=Path, default=None, help="write result.json here")

    validate = commands.add_parser("validate", help="check JSON specs against the schema")
    validate.add_argument("specs", type=Path, nargs="+")

    commands.add_parser("interventions", help="list the registered intervention types")
    return parser


def _position(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def _trace(args) -> int:
    import torch
    from tqdm import tqdm

    from .models import load_model
    from .tracing.run import run_spec

    model, tokenizer = load_model(args.model)
    answer = args.answer
    if answer is None and args.prompt == EIFFEL["prompt"]:
        answer = EIFFEL["answer"]
    n_layers = model.config.num_hidden_layers
    positions = [_position(p) for p in args.positions.split(",")]
    base = {"schema_version": 1, "prompt": args.prompt, "subject": args.subject,
            **({"answer": answer} if answer else {})}
    noise = {"type": "noise_add", "seeds": args.seeds, "scale": args.scale}
    rows = []
    with torch.no_grad():
        for layer in tqdm(range(n_layers), desc=f"{args.kind} trace", unit="layer"):
            cells = []
            for position in positions:
                spec = dict(base, interventions=[noise, {
                    "type": "clean_restore", "component": _KIND_COMPONENT[args.kind],
                    "layers": layer, "positions": position}])
                result = run_spec(spec, model, tokenizer)
                cells.append(sum(result.recovery) / len(result.recovery))
            rows.append(cells)
    print(f"tokens: {result.tokens}   subject tokens {result.subject_range}")
    print(f"answer {result.answer!r}: clean P = {result.clean_prob:.4f}; corrupted P per seed = "
          + " ".join(f"{p:.4f}" for p in result.corrupt_probs)
          + f"  (noise {args.scale} x sigma {result.sigma:.4f})")
    print("mean recovery over seeds when one layer's output is restored at:")
    print(f"{'layer':>5} " + " ".join(f"{str(p):>14}" for p in positions))
    for layer, cells in enumerate(rows):
        print(f"{layer:>5} " + " ".join(f"{c:>14.3f}" for c in cells))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "trace.json").write_text(json.dumps({
            "tokens": result.tokens, "subject_range": result.subject_range,
            "answer": result.answer, "clean_prob": result.clean_prob,
            "corrupt_probs": result.corrupt_probs, "kind": args.kind, "scale": args.scale,
            "sigma": result.sigma, "seeds": result.seeds, "positions": positions,
            "mean_recovery": rows, "versions": result.versions,
        }, indent=2))
        print(f"wrote {args.out / 'trace.json'}")
    return 0


def _run(args) -> int:
    from .models import OFFLINE_DEFAULT, load_model
    from .specs import load_spec
    from .tracing.run import run_spec

    spec = load_spec(args.spec)
    model, tokenizer = load_model(args.model or spec.model or OFFLINE_DEFAULT)
    result = run_spec(spec, model, tokenizer)
    print(result.summary())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(result.to_json())
        print(f"wrote {args.out / 'result.json'}")
    return 0


def _validate(args) -> int:
    from .specs import SpecError, load_spec

    failed = 0
    for path in args.specs:
        try:
            load_spec(path)
            print(f"ok      {path}")
        except SpecError as error:
            failed += 1
            print(f"invalid {path}: {error}")
    return 1 if failed else 0


def _interventions(args) -> int:
    from .interventions import RESERVED, get_intervention, list_interventions

    for name in list_interventions():
        cls = get_intervention(name)
        print(f"{name:<18} {cls.__module__}.{cls.__qualname__}")
    for name, why in RESERVED.items():
        print(f"{name:<18} (reserved: {why})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"trace": _trace, "run": _run, "validate": _validate,
               "interventions": _interventions}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
