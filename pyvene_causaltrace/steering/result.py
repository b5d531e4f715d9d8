"""What :func:`~.run.intervene_features` measured: :class:`FeatureInterventionResult`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FeatureIntervention", "FeatureInterventionResult"]

#: One feature intervention: ``(layer, position, feature, value)``; ``position`` an int (a
#: prompt position, negative counts from the end) or ``"all"``.
FeatureIntervention = tuple[int, int | str, int, float]
#: Interventions a summary lists before it only counts them.
SHOWN = 6


@dataclass
class FeatureInterventionResult:
    """What :func:`~.run.intervene_features` measured.

    ``logits`` / ``clean_logits``: ``[vocab]`` float32 at the last prompt position, with the
    interventions and of the plain model. ``generated_ids`` / ``clean_generated_ids``: the
    greedy continuations (empty without ``max_new_tokens``). ``top``: the ``top_k`` tokens of
    each run (``run, rank, token_id, token, logit, prob``). ``spec``: the JSON spec whose
    ``run_spec`` reproduces the intervened logits (None when the transcoder was not read from
    files: a spec names it by path)."""

    prompt: str
    tokens: list[str]
    interventions: list[tuple[int, int | str, int, float]]
    hold_errors: bool
    freeze_attention: bool
    logits: torch.Tensor
    clean_logits: torch.Tensor
    top: list[dict[str, Any]]
    generated_ids: list[int] = field(default_factory=list)
    generated_text: str = ""
    clean_generated_ids: list[int] = field(default_factory=list)
    clean_generated_text: str = ""
    spec: dict[str, Any] | None = None
    model: str = ""
    transcoder: str | None = None

    @property
    def max_abs_logit_diff(self) -> float:
        """``max |logits - clean_logits|`` at the last prompt position."""
        return float((self.logits.double() - self.clean_logits.double()).abs().max())

    def to_dataframe(self):
        """The top tokens, long form: ``run`` (``clean`` | ``intervened``), ``rank``,
        ``token_id``, ``token``, ``logit``, ``prob``."""
        import pandas as pd  # pandas loads only when a table is asked for

        return pd.DataFrame(self.top, columns=["run", "rank", "token_id", "token", "logit",
                                               "prob"])

    def to_dict(self) -> dict[str, Any]:
        """Everything but the full logit vectors, as JSON-ready data."""
        return {"prompt": self.prompt, "tokens": self.tokens, "model": self.model,
                "transcoder": self.transcoder,
                "interventions": [list(item) for item in self.interventions],
                "hold_errors": self.hold_errors, "freeze_attention": self.freeze_attention,
                "max_abs_logit_diff": self.max_abs_logit_diff, "top": self.top,
                "generated_ids": self.generated_ids, "generated_text": self.generated_text,
                "clean_generated_ids": self.clean_generated_ids,
                "clean_generated_text": self.clean_generated_text, "spec": self.spec}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """A short plain-text report: the interventions, the top tokens side by side, the
        continuations."""
        shown = ", ".join(f"L{layer} pos {pos} f{feature} = {value:g}"
                          for layer, pos, feature, value in self.interventions[:SHOWN])
        if len(self.interventions) > SHOWN:
            shown += f", ... ({len(self.interventions)} in all)"
        lines = [f"prompt: {self.prompt!r} ({len(self.tokens)} tokens)", f"set: {shown}",
                 f"errors {'held at the clean run' if self.hold_errors else 'live'}, attention "
                 f"{'held at the clean patterns' if self.freeze_attention else 'live'}; "
                 f"max |logit change| {self.max_abs_logit_diff:.4g}",
                 f"{'rank':>4}  {'clean':<24}{'p':>8}   {'intervened':<24}{'p':>8}"]
        clean = [row for row in self.top if row["run"] == "clean"]
        steered = [row for row in self.top if row["run"] == "intervened"]
        for a, b in zip(clean, steered, strict=True):
            lines.append(f"{a['rank']:>4}  {a['token']!r:<24}{a['prob']:>8.4f}   "
                         f"{b['token']!r:<24}{b['prob']:>8.4f}")
        if self.generated_ids or self.clean_generated_ids:
            lines.append(f"clean:      {self.clean_generated_text!r}")
            lines.append(f"intervened: {self.generated_text!r}")
        return "\n".join(lines)
