"""``fit``: the first transcoder for a model, saved where the docs' blocks load it from."""

from __future__ import annotations

from ..fitting import QUALITIES, SETTING_NAMES, FitSettings, fit_transcoder
from ..models import load_model
from .common import resolve_device


def fit_command(args) -> int:
    device = resolve_device(args.device)
    # the flags build the settings, over --quality's preset: as keywords, --model would land
    # on fit_transcoder's ``model`` (a loaded module)
    given = {name: getattr(args, name) for name in SETTING_NAMES
             if getattr(args, name, None) is not None}
    settings = FitSettings(**{**QUALITIES[args.quality], **given})
    settings.check()  # a refused setting before a model loads on the device
    # fit_transcoder loads its model on the CPU; on another device it is loaded here first
    model, tokenizer = (None, None) if device == "cpu" else load_model(settings.model,
                                                                       device=device)
    report = fit_transcoder(settings, out=args.out, refit=args.refit,
                            progress=not args.no_progress, model=model, tokenizer=tokenizer)
    print(report.summary())
    return 0
