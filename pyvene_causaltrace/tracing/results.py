"""Result objects of tracing runs: plain data with tables and JSON, no I/O inside."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on, for the record."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("pyvene-causaltrace", "pyvene", "torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "unknown"
    return out


@dataclass(frozen=True)
class SpecRunResult:
    """One spec's run: P(answer) clean, with noise only, and intervened — one row per seed.

    ``recovery[r] = (intervened[r] - corrupt[r]) / (clean - corrupt[r])`` (NaN without noise).
    """

    spec: dict[str, Any]
    tokens: list[str]
    subject_range: tuple[int, int] | None
    answer: str
    answer_id: int
    seeds: list[int] | None
    sigma: float | None
    scale: float | None
    clean_prob: float
    corrupt_probs: list[float]
    intervened_probs: list[float]
    recovery: list[float]
    components: list[str]
    versions: dict[str, str] = field(default_factory=package_versions)

    def to_dataframe(self):
        """Long form: one row per seed."""
        import pandas as pd

        seeds = self.seeds if self.seeds is not None else [None]
        return pd.DataFrame({
            "seed": seeds,
            "clean_prob": self.clean_prob,
            "corrupt_prob": self.corrupt_probs,
            "prob": self.intervened_probs,
            "recovery": self.recovery,
        })

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> SpecRunResult:
        data = json.loads(text)
        if data["subject_range"] is not None:
            data["subject_range"] = tuple(data["subject_range"])
        return cls(**data)

    def summary(self) -> str:
        """A short plain-text table."""
        lines = [
            f"prompt tokens: {self.tokens}",
            f"subject tokens: {self.subject_range}   answer: {self.answer!r}   "
            f"clean P = {self.clean_prob:.4f}",
        ]
        if self.sigma is not None:
            lines.append(f"noise: scale {self.scale} x sigma {self.sigma:.4f}")
        lines.append(f"{'seed':>6} {'corrupt P':>10} {'intervened P':>13} {'recovery':>9}")
        seeds = self.seeds if self.seeds is not None else ["-"]
        for seed, c, p, r in zip(seeds, self.corrupt_probs, self.intervened_probs, self.recovery,
                              strict=True):
            lines.append(f"{seed!s:>6} {c:>10.4f} {p:>13.4f} {r:>9.3f}")
        return "\n".join(lines)
