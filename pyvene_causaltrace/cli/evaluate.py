"""``evaluate``: a saved graph's faithfulness curve (MIB's f(k), CPR, CMD) or, with
``--budget``, its feature-budget curve; and the part of ``attribute --faithfulness`` that reads
the flags and writes the files."""

from __future__ import annotations

from pathlib import Path

from ..atomic import replacing
from ..attribution.budget_curve import BudgetCurve, budget_curve
from ..attribution.faithfulness import FaithfulnessCurve, faithfulness
from ..attribution.graph import AttributionGraph
from ..attribution.settings import FaithfulnessSettings
from ..errors import InputError
from ..models import OFFLINE_DEFAULT, load_model
from ..transcoders import load_transcoder
from .common import out_dir, resolve_device, settings_of

#: The flags that are FaithfulnessSettings' fields, ``{argparse dest: field}``.
FAITHFULNESS_FLAGS = {"sizes": "sizes", "level": "level", "rank_by": "rank_by",
                      "ablation": "ablation", "errors": "errors", "metric": "metric",
                      "draws": "draws", "seed": "seed", "circuits_per_forward": "batch_size"}


def faithfulness_settings(args) -> FaithfulnessSettings:
    """The settings of the flags, checked (a refusal names the flag)."""
    try:
        sizes = tuple(float(s) for s in str(args.sizes).split(","))
    except ValueError:
        raise InputError(f"--sizes: give percentages separated by commas, got "
                         f"{args.sizes!r}") from None
    values = {field: getattr(args, dest) for dest, field in FAITHFULNESS_FLAGS.items()}
    values["sizes"] = sizes
    flags = FAITHFULNESS_FLAGS
    if getattr(args, "budgets", None) is not None:  # evaluate's, not attribute's
        try:
            values["budgets"] = tuple(int(k) for k in str(args.budgets).split(","))
        except ValueError:
            raise InputError(f"--budgets: give whole numbers of features separated by "
                             f"commas, got {args.budgets!r}") from None
        flags = {**flags, "budgets": "budgets"}
    return settings_of(FaithfulnessSettings, values, flags)


def reference_prompts(path: Path | None) -> list[str] | None:
    """``--reference``: one prompt per non-blank line."""
    if path is None:
        return None
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise InputError(f"--reference {path} holds no prompt")
    return lines


def run_faithfulness(args, settings: FaithfulnessSettings, model, tokenizer, transcoder,
                     graph: AttributionGraph, out: Path | None) -> FaithfulnessCurve:
    """The curve, printed and (with ``out``) written as faithfulness.json/.csv/.png."""
    curve = faithfulness(model, tokenizer, transcoder, graph, args.counterfactual,
                         reference=reference_prompts(args.reference), foil=args.foil,
                         settings=settings)
    print(curve.to_dataframe().to_string(index=False))
    low, high = min(curve.random_cpr), max(curve.random_cpr)
    print(f"CPR {curve.cpr:.4f} (random {low:.4f}..{high:.4f}), CMD {curve.cmd:.4f}; "
          f"{curve.forwards} forwards, {curve.seconds:.1f} s")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        curve.to_json(out / "faithfulness.json")
        with replacing(out / "faithfulness.csv") as tmp:
            curve.to_dataframe().to_csv(tmp, index=False)
        with replacing(out / "faithfulness.png") as tmp:
            curve.plot(tmp)
    return curve


def run_budget_curve(args, settings: FaithfulnessSettings, model, tokenizer, transcoder,
                     graph: AttributionGraph, out: Path | None) -> BudgetCurve:
    """The feature-budget curve, printed and (with ``out``) written as
    budget_curve.json/.csv/.png."""
    curve = budget_curve(model, tokenizer, transcoder, graph, args.counterfactual,
                         reference=reference_prompts(args.reference), settings=settings)
    print(curve.to_dataframe().to_string(index=False))
    print(f"{curve.n_active} active features ({curve.n_graph} graph nodes ranked first); "
          f"P(answer) {curve.prob_full:.4f} in the model, {curve.prob_empty:.4f} with none "
          f"live; {curve.forwards} forwards, {curve.seconds:.1f} s")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        curve.to_json(out / "budget_curve.json")
        with replacing(out / "budget_curve.csv") as tmp:
            curve.to_dataframe().to_csv(tmp, index=False)
        with replacing(out / "budget_curve.png") as tmp:
            curve.plot(tmp)
    return curve


def evaluate_command(args) -> int:
    settings = faithfulness_settings(args)  # refused before anything loads
    out = out_dir(args.out)
    device = resolve_device(args.device)
    graph = AttributionGraph.load(args.graph)
    if graph.lorsa_layers:  # before anything loads (the API refuses it too, later)
        curve = "budget curve" if args.budget else "faithfulness curve"
        raise InputError(f"{args.graph}: the graph has Lorsa nodes (attribute --lorsa); the "
                         f"{curve} ablates transcoder features in the model spliced with the "
                         "transcoder alone and does not splice Lorsa yet")
    transcoder = load_transcoder(args.clt, format=args.format, device=device)
    model, tokenizer = load_model(args.model or OFFLINE_DEFAULT, device=device)
    run = run_budget_curve if args.budget else run_faithfulness
    run(args, settings, model, tokenizer, transcoder, graph, out)
    return 0
