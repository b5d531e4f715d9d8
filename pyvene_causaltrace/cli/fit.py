"""``fit``: the first transcoder for a model, saved where the docs' blocks load it from."""

from __future__ import annotations

from ..fitting import QUALITIES, SETTING_NAMES, FitSettings, fit_transcoder


def fit_command(args) -> int:
    # the flags build the settings, over --quality's preset: as keywords, --model would land
    # on fit_transcoder's ``model`` (a loaded module)
    given = {name: getattr(args, name) for name in SETTING_NAMES
             if getattr(args, name, None) is not None}
    settings = FitSettings(**{**QUALITIES[args.quality], **given})
    report = fit_transcoder(settings, out=args.out, refit=args.refit,
                            progress=not args.no_progress)
    print(report.summary())
    return 0
