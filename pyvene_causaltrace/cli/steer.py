"""``steer``: set transcoder features to values, compare the top tokens with the clean run's,
and generate with the features held (:func:`~pyvene_causaltrace.steering.intervene_features`).

    pyvene-causaltrace steer --clt DIR --set 20:-1:1234=10 --set 21:all:77=0 --max-new-tokens 10
    pyvene-causaltrace steer --spec intervention_specs/feature_steering.json --out out/
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import write_text
from ..errors import InputError, NonFiniteError
from ..models import OFFLINE_DEFAULT, load_model
from ..specs import load_spec
from ..steering import SteeringSettings, intervene_features
from ..transcoders import load_transcoder
from .common import EIFFEL, out_dir, resolve_device, settings_of

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


#: The ``steer`` flags that are :class:`~..steering.settings.SteeringSettings`' fields (argparse
#: dest -> field; ``--no-hold-errors`` inverts it; a spec gives ``hold_errors``,
#: ``freeze_attention`` and ``bos`` itself).
STEERING_FLAGS = {"max_new_tokens": "max_new_tokens", "no_hold_errors": "hold_errors",
                  "freeze_attention": "freeze_attention", "top_k": "top_k",
                  "memory_mb": "memory_mb", "bos": "bos"}


@dataclass(frozen=True)
class SteerRequest:
    """What ``steer`` runs: the prompt, model, transcoder and interventions, and the
    :class:`~..steering.settings.SteeringSettings`, checked before anything loads."""

    prompt: str
    model: str | None
    transcoder: str
    items: list[tuple[int, int | str, int, float]]
    settings: SteeringSettings


def steer_request(args) -> SteerRequest:
    """The run's request from ``--spec`` or the flags, checked before anything loads."""
    if args.spec is not None:  # the flags the spec gives are refused (.flags)
        given = spec_settings(args.spec)
    else:
        if not args.set:
            raise InputError(f"steer needs --set {_SET_FORM} (repeatable), or --spec FILE")
        given = {"prompt": EIFFEL["prompt"] if args.prompt is None else args.prompt,
                 "model": None, "clt": None, "items": [parse_set(t) for t in args.set],
                 "hold_errors": not args.no_hold_errors, "freeze": args.freeze_attention,
                 **({} if args.bos is None else {"bos": args.bos})}
    model = args.model if args.model is not None else given["model"]
    clt = args.clt if args.clt is not None else given["clt"]
    if clt is None:
        raise InputError("steer needs a transcoder: --clt DIR, or a spec with a clt_splice")
    if not given["prompt"]:
        raise InputError("--prompt is empty")
    settings = settings_of(SteeringSettings, {
        "max_new_tokens": args.max_new_tokens, "top_k": args.top_k, "memory_mb": args.memory_mb,
        "hold_errors": given["hold_errors"], "freeze_attention": given["freeze"],
        **({"bos": given["bos"]} if "bos" in given else {})}, STEERING_FLAGS)
    return SteerRequest(given["prompt"], model, str(Path(clt).expanduser()), given["items"],
                        settings)


def steer_command(args) -> int:
    out_dir(args.out)
    device = resolve_device(args.device)
    request = steer_request(args)
    transcoder = load_transcoder(request.transcoder, format=args.format, device=device)
    model, tokenizer = load_model(request.model or OFFLINE_DEFAULT, device=device)
    result = intervene_features(model, tokenizer, transcoder, request.prompt, request.items,
                                settings=request.settings,
                                progress=False if args.no_progress else None)
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
