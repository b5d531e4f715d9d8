"""``fit``: the first transcoder for a model, saved where the docs' blocks load it from."""

from __future__ import annotations

from ..fitting import SETTING_NAMES, fit_transcoder


def fit_command(args) -> int:
    changes = {name: getattr(args, name) for name in SETTING_NAMES
               if getattr(args, name, None) is not None}
    report = fit_transcoder(out=args.out, refit=args.refit, progress=not args.no_progress,
                            **changes)
    print(report.summary())
    return 0
