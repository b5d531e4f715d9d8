"""``fit``: the first transcoder for a model, saved where the docs' blocks load it from."""

from __future__ import annotations

from ..fitting import SETTING_NAMES, FitSettings, fit_transcoder


def fit_command(args) -> int:
    # the flags build the settings: as keywords, --model would land on fit_transcoder's
    # ``model`` (a loaded module)
    settings = FitSettings(**{name: getattr(args, name) for name in SETTING_NAMES
                              if getattr(args, name, None) is not None})
    report = fit_transcoder(settings, out=args.out, refit=args.refit,
                            progress=not args.no_progress)
    print(report.summary())
    return 0
