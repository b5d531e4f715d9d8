"""Result objects of tracing runs: plain data with tables and JSON, no I/O inside."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import checked
from ..errors import InputError
from .plots import plot_head_trace, plot_trace
from .roles import token_role


@functools.cache
def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on, for the record (read once a process:
    the metadata lookup costs milliseconds, a tiny model's whole trace only tens)."""
    return {name: _version(name) for name in ("pyvene-causaltrace", "pyvene", "torch",
                                              "transformers")}


def finite_or_none(value):
    """``value`` with every NaN and infinity (in dicts, lists and tuples: those as lists) as
    ``None``, for strict JSON, which has neither."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


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
        import pandas as pd  # pandas loads only when a table is asked for

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


@dataclass(frozen=True, eq=False)
class _Effects:
    """The prompt's fields every trace result opens with, and what a restore's probabilities
    mean, for results holding ``clean_prob``, ``corrupt_probs [seed]`` and ``restored_probs
    [seed, a, b]`` (cells ``a x b``)."""

    tokens: list[str]
    subject_range: tuple[int, int]
    noise_positions: list[int]
    answer: str
    answer_id: int

    @property
    def total_effect(self) -> np.ndarray:
        """``[seed]``: clean - corrupt."""
        return self.clean_prob - self.corrupt_probs

    @property
    def indirect_effect(self) -> np.ndarray:
        """``[seed, ...]`` (the cells: layer x position, or layer x head): restored - corrupt."""
        return self.restored_probs - self.corrupt_probs[:, None, None]

    @property
    def recovery(self) -> np.ndarray:
        """``[seed, ...]``: indirect effect / total effect, per seed."""
        return self.indirect_effect / self.total_effect[:, None, None]

    def _mean(self, value: str) -> np.ndarray:
        """Mean over seeds of ``"recovery"``, ``"prob"`` or ``"ie"``."""
        arrays = {"ie": self.indirect_effect, "recovery": self.recovery,
                  "prob": self.restored_probs}
        if value not in arrays:
            raise InputError(f"value must be one of {', '.join(arrays)}, got {value!r}")
        return arrays[value].mean(0)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())  # type: ignore[attr-defined]

    def _dict(self, **kind: Any) -> dict[str, Any]:
        """The fields both results write first and in this order, ``kind``'s among them."""
        return {"tokens": self.tokens, "subject_range": list(self.subject_range),
                "noise_positions": self.noise_positions, "answer": self.answer,
                "answer_id": self.answer_id, **kind, "scale": self.scale, "sigma": self.sigma,
                "sigma_method": self.sigma_method, "seeds": self.seeds,
                "clean_prob": self.clean_prob, "corrupt_probs": self.corrupt_probs.tolist(),
                "restored_probs": self.restored_probs.tolist()}


def _fields(text: str, derived: tuple[str, ...]) -> dict[str, Any]:
    """A result's fields from its JSON: the ``derived`` keys dropped, arrays as float64."""
    data = json.loads(text)
    for key in derived:
        data.pop(key)
    data["subject_range"] = tuple(data["subject_range"])
    for key in ("corrupt_probs", "restored_probs"):
        data[key] = np.asarray(data[key], dtype=np.float64)
    return data


@dataclass(frozen=True, eq=False)
class TraceResult(_Effects):
    """A causal trace of one prompt: restored P(answer) for every seed, layer and position.

    ``restored_probs[s, l, t]`` is P(answer) with seed ``s``'s noise on the subject and the
    kind's restoration at cell ``(l, t)`` (for window kinds, ``l`` is the window's centre).
    ``recovery = (restored - corrupt_s) / (clean - corrupt_s)`` per seed. Grids are
    ``[layer, position]``; per-seed arrays ``[seed, layer, position]``.
    """

    kind: str
    window: int | None
    scale: float
    sigma: float
    sigma_method: str
    seeds: list[int]
    clean_prob: float
    corrupt_probs: np.ndarray  # [seed]
    restored_probs: np.ndarray  # [seed, layer, position]
    spec: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=package_versions)

    # ---------------------------------------------------------------------- quantities
    @property
    def n_layers(self) -> int:
        return int(self.restored_probs.shape[1])

    @checked
    def grid(self, value: str = "recovery") -> np.ndarray:
        """Mean over seeds of ``"recovery"``, ``"prob"`` or ``"ie"``: ``[layer, position]``
        (effects: :class:`_Effects`)."""
        return self._mean(value)

    @property
    def roles(self) -> list[str]:
        return [token_role(p, self.subject_range, len(self.tokens))
                for p in range(len(self.tokens))]

    def subject_sites(self) -> dict[str, int]:
        """Positions of the subject's two token sites: ``subject_best``, the subject token
        whose mean recovery over seeds peaks highest, and ``subject_last``, the last subject
        token (ROME's "last subject token")."""
        start, stop = self.subject_range
        curves = self.grid()[:, start:stop]  # [layer, subject token]
        return {"subject_best": start + int(curves.max(axis=0).argmax()),
                "subject_last": stop - 1}

    def peaks(self) -> dict[str, dict[str, Any]]:
        """Per-seed peak layer and recovery of each site, the span of those layers, and the peak of
        the mean curve over seeds. Sites (docs/tracing.md): :meth:`subject_sites`, ``subject_mean``
        (averaged over the subject's tokens) and ``last`` (its last layer left out for residual
        kinds, where it reproduces any donor); token sites give their ``position`` and ``token``."""
        start, stop = self.subject_range
        last = self.recovery[:, :, -1]
        if self.kind in ("residual", "severed-mlp", "severed-attn"):
            last = last[:, :-1]  # the last block at the last token reproduces any donor
        sites = {site: (p, self.recovery[:, :, p]) for site, p in self.subject_sites().items()}
        sites.update(subject_mean=(None, self.recovery[:, :, start:stop].mean(-1)),
                     last=(len(self.tokens) - 1, last))
        out = {}
        for site, (position, curve) in sites.items():
            layers = curve.argmax(1)
            out[site] = ({} if position is None else
                         {"position": position, "token": self.tokens[position]})
            out[site].update({
                "peak_layer_per_seed": layers.tolist(),
                "peak_recovery_per_seed": curve.max(1).tolist(),
                "peak_layers_span": [int(layers.min()), int(layers.max())],
                "mean_curve_peak_layer": int(curve.mean(0).argmax()),
                "mean_curve_peak_recovery": float(curve.mean(0).max()),
            })
        return out

    def diagnose(self) -> list[str]:
        """Plain-words reasons a trace may be empty or untrustworthy (empty list: none)."""
        notes = []
        if self.clean_prob < 0.1:
            notes.append(f"clean confidence too low: the model gives {self.answer!r} only "
                         f"p={self.clean_prob:.3f}; trace a fact it knows")
        worst = int(self.corrupt_probs.argmax())
        if self.corrupt_probs[worst] > 0.5 * self.clean_prob:
            notes.append(f"total effect too small: seed {self.seeds[worst]} leaves "
                         f"p={self.corrupt_probs[worst]:.3f} of the clean {self.clean_prob:.3f}; "
                         "its recovery denominator is small; raise the noise scale")
        grid = self.grid()
        away = grid.copy()
        away[-1, -1] = -np.inf  # restoring the last token at the last block is the identity
        layer, position = np.unravel_index(int(away.argmax()), away.shape)
        if away[layer, position] < 0.2:
            notes.append("no site apart from the last-token/last-layer corner: elsewhere the "
                         f"best mean recovery is {away[layer, position]:.3f} "
                         f"(layer {layer}, token {self.tokens[position]!r})")
        if self.kind in ("residual", "mlp"):
            start, stop = self.subject_range
            subject = grid[:, start:stop]
            layer, offset = np.unravel_index(int(subject.argmax()), subject.shape)
            if subject[layer, offset] < 0.1:
                notes.append("no early site at the subject: its best mean recovery is "
                             f"{subject[layer, offset]:.3f} (layer {layer}, token "
                             f"{self.tokens[start + offset]!r})")
        return notes

    # ---------------------------------------------------------------------- exports
    def to_dataframe(self):
        """Long form: ``seed, layer, position, token, role, prob, recovery``."""
        import pandas as pd  # pandas loads only when a table is asked for

        s, layers, t = np.meshgrid(np.arange(len(self.seeds)), np.arange(self.n_layers),
                                   np.arange(len(self.tokens)), indexing="ij")
        roles = np.array(self.roles)
        return pd.DataFrame({
            "seed": np.array(self.seeds)[s.ravel()],
            "layer": layers.ravel(),
            "position": t.ravel(),
            "token": np.array(self.tokens, dtype=object)[t.ravel()],
            "role": roles[t.ravel()],
            "prob": self.restored_probs.ravel(),
            "recovery": self.recovery.ravel(),
        })

    def to_dict(self) -> dict[str, Any]:
        return {
            **self._dict(kind=self.kind, window=self.window),
            "recovery": self.recovery.tolist(),
            "mean_recovery": self.grid().tolist(),
            "total_effect": self.total_effect.tolist(),
            "peaks": self.peaks(), "diagnosis": self.diagnose(),
            "spec": self.spec, "versions": self.versions,
        }

    @classmethod
    def from_json(cls, text: str) -> TraceResult:
        return cls(**_fields(text, ("recovery", "mean_recovery", "total_effect", "peaks",
                                    "diagnosis")))

    @checked
    def table(self, value: str = "recovery", every: int = 1, *,
              layers_down: bool = False) -> str:
        """Tokens down, layers across (every ``every``-th), subject tokens marked ``*``;
        ``layers_down`` turns it so every layer fits a terminal, each site's peak layer marked."""
        grid = self.grid(value)
        start, stop = self.subject_range
        layers = range(0, self.n_layers, every)
        if layers_down:
            return self._layer_table(grid, layers)
        lines = [f"{'token':>14} " + "".join(f"{'L' + str(layer):>7}" for layer in layers)]
        for t, token in enumerate(self.tokens):
            label = ("*" if start <= t < stop else " ") + repr(token)
            lines.append(f"{label:>14} " + "".join(f"{grid[layer, t]:>7.3f}" for layer in layers))
        return "\n".join(lines)

    def _layer_table(self, grid: np.ndarray, layers: range) -> str:
        start, stop = self.subject_range
        labels = [("*" if start <= t < stop else "") + repr(token)[:11]
                  for t, token in enumerate(self.tokens)]
        widths = [max(7, len(label) + 1) for label in labels]
        names = {"subject_best": "best subject token", "subject_last": "last subject token",
                 "subject_mean": "subject mean", "last": "last token"}
        marks: dict[int, list[str]] = {}
        for site, p in self.peaks().items():
            marks.setdefault(p["mean_curve_peak_layer"], []).append(names[site])
        lines = [f"{'layer':>5} " + "".join(f"{label:>{w}}" for label, w in
                                            zip(labels, widths, strict=True))]
        for layer in layers:
            row = f"{'L' + str(layer):>5} " + "".join(
                f"{grid[layer, t]:>{w}.3f}" for t, w in enumerate(widths))
            if layer in marks:
                row += "  <- peak: " + ", ".join(marks[layer])
            lines.append(row)
        return "\n".join(lines)

    def summary(self) -> str:
        peaks = self.peaks()
        window = f", window {self.window}" if self.window else ""
        lines = [
            f"{self.kind} trace{window}: answer {self.answer!r}, clean P = {self.clean_prob:.4f}",
            f"noise {self.scale:g} x sigma_{self.sigma_method} {self.sigma:.4f}; corrupted P per "
            "seed: " + " ".join(f"{p:.4f}" for p in self.corrupt_probs),
        ]
        start, stop = self.subject_range
        n = stop - start
        names = {"subject_best": "subject site, best token", "subject_last":
                 "subject site, last token", "last": "last-token site"}
        for site, p in peaks.items():
            name = (f"subject site, mean over its {n} token{'s' * (n > 1)}"
                    if site == "subject_mean"
                    else f"{names[site]} {p['token']!r} (position {p['position']})")
            lines.append(
                f"{name}: mean-curve peak {p['mean_curve_peak_recovery']:.3f} at layer "
                f"{p['mean_curve_peak_layer']}; per-seed peak layers {p['peak_layer_per_seed']}")
        lines += [f"note: {note}" for note in self.diagnose()]
        return "\n".join(lines)

    @checked
    def plot(self, path: str | Path | None = None, value: str = "prob", ax=None):
        """ROME-style heatmap; see :func:`pyvene_causaltrace.tracing.plots.plot_trace`."""
        return plot_trace(self, path=path, value=value, ax=ax)


@dataclass(frozen=True, eq=False)
class HeadTraceResult(_Effects):
    """A per-head trace of one prompt (:meth:`~.tracer.Tracer.trace_heads`).

    ``restored_probs[s, i, h]`` is P(answer) with seed ``s``'s noise on the subject and head
    ``h`` of layer ``layers[i]`` restored at ``position``; ``indirect_effect = restored -
    corrupt_s``, ``recovery`` divides it by ``clean - corrupt_s``. Per-seed arrays are ``[seed,
    layer, head]``, grids ``[layer, head]``."""

    layers: list[int]
    position: int
    scale: float
    sigma: float
    sigma_method: str
    seeds: list[int]
    clean_prob: float
    corrupt_probs: np.ndarray  # [seed]
    restored_probs: np.ndarray  # [seed, layer, head]
    versions: dict[str, str] = field(default_factory=package_versions)

    @property
    def n_heads(self) -> int:
        return int(self.restored_probs.shape[2])

    @checked
    def grid(self, value: str = "ie") -> np.ndarray:
        """Mean over seeds of ``"ie"`` (indirect effect), ``"recovery"`` or ``"prob"``:
        ``[layer, head]`` (effects: :class:`_Effects`)."""
        return self._mean(value)

    @checked
    def top_heads(self, n: int = 5) -> list[tuple[int, int, float]]:
        """The ``n`` (layer, head, mean indirect effect) of largest mean indirect effect."""
        grid = self.grid("ie")
        order = np.argsort(-grid.ravel(), kind="stable")[:n]
        return [(self.layers[int(i) // self.n_heads], int(i) % self.n_heads,
                 float(grid.ravel()[i])) for i in order]

    # ---------------------------------------------------------------------- exports
    def to_dataframe(self):
        """Long form: ``seed, layer, head, position, prob, effect, recovery`` (``effect``: the
        indirect effect; its mean over seeds per (layer, head) is :meth:`grid`)."""
        import pandas as pd  # pandas loads only when a table is asked for

        s, i, h = np.meshgrid(np.arange(len(self.seeds)), np.arange(len(self.layers)),
                              np.arange(self.n_heads), indexing="ij")
        return pd.DataFrame({
            "seed": np.array(self.seeds)[s.ravel()],
            "layer": np.array(self.layers)[i.ravel()],
            "head": h.ravel(),
            "position": self.position,
            "prob": self.restored_probs.ravel(),
            "effect": self.indirect_effect.ravel(),
            "recovery": self.recovery.ravel(),
        })

    def to_dict(self) -> dict[str, Any]:
        return {
            **self._dict(kind="heads", layers=self.layers, position=self.position,
                         n_heads=self.n_heads),
            "indirect_effect": self.indirect_effect.tolist(),
            "mean_indirect_effect": self.grid("ie").tolist(),
            "versions": self.versions,
        }

    @classmethod
    def from_json(cls, text: str) -> HeadTraceResult:
        return cls(**_fields(text, ("kind", "n_heads", "indirect_effect",
                                    "mean_indirect_effect")))

    @checked
    def summary(self, n: int = 5) -> str:
        lines = [f"per-head trace at position {self.position} {self.tokens[self.position]!r}: "
                 f"answer {self.answer!r}, clean P = {self.clean_prob:.4f}, corrupted P (mean of "
                 f"{len(self.seeds)} seeds) = {float(self.corrupt_probs.mean()):.4f}"]
        lines += [f"  layer {layer} head {head}: mean indirect effect {effect:+.4f}"
                  for layer, head, effect in self.top_heads(n)]
        return "\n".join(lines)

    @checked
    def plot(self, path: str | Path | None = None, value: str = "ie", ax=None):
        """Heat map, layers down and heads across; see
        :func:`pyvene_causaltrace.tracing.plots.plot_head_trace`."""
        return plot_head_trace(self, path=path, value=value, ax=ax)
