"""``steer``: set transcoder features to values, compare the top tokens with the clean run's,
and generate with the features held (:func:`~pyvene_causaltrace.steering.intervene_features`).

    pyvene-causaltrace steer --clt DIR --set 20:-1:1234=10 --set 21:all:77=0 --max-new-tokens 10
    pyvene-causaltrace steer --spec intervention_specs/feature_steering.json --out out/
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ..atomic import write_text
from ..defaults import BOS
from ..errors import InputError, NonFiniteError
from ..finite import positive_number
from ..models import OFFLINE_DEFAULT, load_model
from ..specs import load_spec
from ..steering import intervene_features
from ..transcoders import load_transcoder
from .common import EIFFEL, out_dir

_SET = re.compile(r"^(-?\d+):(-?\d+|all):(-?\d+)=(.+)$")
_SET_FORM = "LAYER:POS:FEATURE=VALUE (POS an integer or 'all'), e.g. 20:-1:1234=10"
#: float32's largest finite value (torch.finfo(torch.float32).max, without importing torch).
FLOAT32_MAX = 3.4028234663852886e38


def parse_set(text: str) -> tuple[int, int | str, int, float]:
    """One ``--set`` flag as ``(layer, position, feature, value)``."""
    match = _SET.match(text.strip())
    if match is None:
        raise InputError(f"--set {text!r}: expected {_SET_FORM}")
    layer, position, feature, value = match.groups()
    try:
        number = float(value)
    except ValueError:
        raise InputError(f"--set {text!r}: the value {value!r} is not a number") from None
    if not math.isfinite(number):
        raise NonFiniteError(f"--set {text!r}: the value must be finite")
    if abs(number) > FLOAT32_MAX:  # the models steer loads compute in float32
        raise NonFiniteError(f"--set {text!r}: the value does not fit float32 (largest "
                             f"{FLOAT32_MAX:.4g}): it would be inf in the run")
    return int(layer), position if position == "all" else int(position), int(feature), number


def spec_settings(path: Path) -> dict[str, Any]:
    """What a steering spec says: prompt, model, transcoder, interventions, error and attention
    settings. It holds one ``clt_splice`` over every layer from position 0 or 1 (``bos``
    ``"never"`` or ``"always"``: the spec, not the tokenizer, says where the splice starts) with
    ``error`` ``"clean"`` or ``"live"``, ``feature_ablate`` entries with ``value``, and
    optionally ``frozen_attention`` with ``pattern: "clean"`` over every layer; anything else is
    refused."""
    spec = load_spec(path)
    if spec.trace is not None or spec.attribution is not None:
        raise InputError(f"{path} is a trace or attribution spec, not a steering spec")
    splice = next((item for item in spec.interventions if item.type == "clt_splice"), None)
    if splice is None:
        raise InputError(f"{path}: a steering spec holds a clt_splice entry")
    if splice.get("error") not in ("clean", "live"):
        raise InputError(f"{path}: steering needs the clt_splice entry's \"error\": \"clean\" "
                         "(held at the clean run's) or \"live\"")
    if splice.get("layers", "all") != "all" or splice.get("from_position", 1) not in (0, 1):
        raise InputError(f"{path}: steer splices every layer from position 0 or 1; run a "
                         "partial splice with `run`")
    items: list[tuple[int, int | str, int, float]] = []
    freeze = False
    for index, item in enumerate(spec.interventions):
        where = f"{path}: interventions[{index}]"
        if item.type == "feature_ablate":
            value, features = item.get("value"), item.get("features")
            if value is None or features == "all":
                raise InputError(f"{where} scales features; steer sets values (give \"value\" "
                                 "and a list of features), or run the spec with `run`")
            values = value if isinstance(value, list) else [value] * len(features)
            for position in item.get("positions") or ["all"]:
                items += [(item.get("clt_layer"), position, f, v)
                          for f, v in zip(features, values, strict=True)]
        elif item.type == "frozen_attention" and item.get("layers", "all") == "all":
            freeze = True
        elif item.type != "clt_splice":
            raise InputError(f"{where}: steer runs clt_splice, feature_ablate and "
                             f"frozen_attention over every layer, not {item.type}; run the "
                             "spec with `run`")
    return {"prompt": spec.prompt, "model": spec.model, "clt": splice.get("clt"),
            "items": items, "hold_errors": splice.get("error") == "clean", "freeze": freeze,
            "bos": "always" if splice.get("from_position", 1) else "never"}


def steer_settings(args) -> dict[str, Any]:
    """The run's settings from ``--spec`` or the flags, checked before anything loads."""
    if args.spec is not None:  # the flags the spec gives are refused (.flags)
        settings = spec_settings(args.spec)
    else:
        if not args.set:
            raise InputError(f"steer needs --set {_SET_FORM} (repeatable), or --spec FILE")
        settings = {"prompt": EIFFEL["prompt"] if args.prompt is None else args.prompt,
                    "model": None, "clt": None, "items": [parse_set(t) for t in args.set],
                    "hold_errors": not args.no_hold_errors, "freeze": args.freeze_attention,
                    "bos": args.bos or BOS}
    for key in ("model", "clt"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if settings["clt"] is None:
        raise InputError("steer needs a transcoder: --clt DIR, or a spec with a clt_splice")
    if not settings["prompt"]:
        raise InputError("--prompt is empty")
    if args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.top_k < 1:
        raise InputError(f"--top-k must be >= 1, got {args.top_k}")
    if args.memory_mb is not None:
        positive_number(args.memory_mb, "--memory-mb")
    settings["clt"] = str(Path(settings["clt"]).expanduser())
    return settings


def steer_command(args) -> int:
    out_dir(args.out)
    s = steer_settings(args)
    transcoder = load_transcoder(s["clt"], format=args.format)
    model, tokenizer = load_model(s["model"] or OFFLINE_DEFAULT)
    result = intervene_features(model, tokenizer, transcoder, s["prompt"], s["items"],
                                max_new_tokens=args.max_new_tokens,
                                hold_errors=s["hold_errors"], freeze_attention=s["freeze"],
                                top_k=args.top_k, memory_mb=args.memory_mb,
                                progress=False if args.no_progress else None, bos=s["bos"])
    print(result.summary())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(result.to_json(), args.out / "steering.json")
        written = ["steering.json"]
        if result.spec is not None:
            write_text(json.dumps(result.spec, indent=2) + "\n", args.out / "spec.json")
            written.append("spec.json")
        print(f"wrote {', '.join(str(args.out / name) for name in written)}")
    return 0
