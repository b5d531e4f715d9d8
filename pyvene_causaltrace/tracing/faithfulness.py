"""How far to trust a trace: do the cells it ranks highest carry the effect?

A *circuit* is the trace's top ``k`` cells, ranked by their mean indirect effect over seeds
(``result.grid("ie")``; ties by cell order, layer-major). For each seed's noise (the trace's own
draws: the engine's, made once) two runs per circuit:

- **sufficiency**: the noised run with only the circuit's cells restored together from the
  clean run; ``f(k) = (p(restored) - p(noised)) / (p(clean) - p(noised))``, the share of the
  total effect recovered;
- **necessity**: the clean run with only the circuit's cells set to that seed's noised-run
  states; ``lost(k) = (p(clean) - p(run)) / (p(clean) - p(noised))``, the share lost.

The curves divide the seeds' mean P by their mean total effect (a seed whose noise barely
moves P would blow its own ratio up); per-seed shares are kept beside. A cell restores what the
trace's row did: the residual's block output at (layer, position); for ``mlp``/``attn`` the
sublayer's outputs at the position over the window of layers centred on the layer (a circuit
restores the union of its cells' windows). Severed kinds are refused. The ranked cells are all
the trace's, or (``cells="subject"``) those at the noised positions only. ``k`` is
``int(size / 100 * cells)`` at each of ``sizes`` (MIB's rounding; CPR and CMD,
:func:`~..attribution.faithfulness.mib_areas`, integrate over these as fractions) and each of
``top`` (absolute counts, reported, not integrated). The same curves for ``draws`` random
rankings (seeded) are the floor. Rows (seed x circuit x mode) run ``rows_per_forward`` at a
time through the one applier (``runtime.intervened``): ``noise_add`` on the embeddings (the
seed's noise, or none) and one ``clean_restore`` per layer whose donor row is the clean run
or that seed's noised run."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..arguments import NonNegativeInt, checked
from ..atomic import write_text
from ..attribution.faithfulness import mib_areas
from ..errors import InputError, UndefinedCurveError
from ..interventions.noise import NoiseAdd
from ..interventions.restore import CleanRestore
from ..model_guard import measurement
from ..runtime import intervened
from .engine import TraceEngine, TraceKind, get_kind
from .metrics import token_probs
from .results import TraceResult
from .roles import token_role
from .settings import TraceFaithfulnessSettings

if TYPE_CHECKING:  # annotations only
    from .tracer import Tracer

__all__ = ["TraceFaithfulness", "TraceFaithfulnessSettings", "trace_faithfulness"]

#: The kinds a faithfulness curve reads: a severed trace's cells hold a sublayer everywhere.
FAITHFUL_KINDS = ("residual", "mlp", "attn")


@dataclass(frozen=True)
class TraceFaithfulness:
    """A trace's sufficiency and necessity curves (module docstring) at each point ``k`` (cells
    of ``n_cells``; ``in_area``: a ``sizes`` point, the ones CPR and CMD integrate), for the
    trace's ranking (``ranking``: cell indices ``layer * positions + position``, best first)
    and for ``draws`` random ones (``random_*``: ``[draw][point]``); per-seed values in
    ``*_per_seed`` (``[seed][point]``); ``n_cells``: the ranked cells. ``forwards`` and
    ``rows`` ran in ``seconds``."""

    kind: str
    window: int | None
    answer: str
    tokens: list[str]
    subject_range: tuple[int, int]
    settings: dict
    n_layers: int
    n_cells: int
    counts: list[int]
    in_area: list[bool]
    ranking: list[int]
    clean_prob: float
    corrupt_probs: list[float]
    sufficiency: list[float]
    necessity: list[float]
    sufficiency_per_seed: list[list[float]]
    necessity_per_seed: list[list[float]]
    random_sufficiency: list[list[float]]
    random_necessity: list[list[float]]
    cpr: float
    cmd: float
    necessity_cpr: float
    necessity_cmd: float
    random_cpr: list[float]
    random_cmd: list[float]
    random_necessity_cpr: list[float]
    random_necessity_cmd: list[float]
    forwards: int
    rows: int
    seconds: float = field(default=0.0, compare=False)

    @property
    def fractions(self) -> list[float]:
        """The area points' sizes as fractions (what CPR and CMD integrate over)."""
        return [round(s / 100, 12) for s in self.settings["sizes"]]

    def below_random(self) -> bool:
        """Whether the sufficiency CPR is below every random ranking's."""
        return self.cpr < min(self.random_cpr)

    @checked
    def top_roles(self, k: NonNegativeInt) -> dict[str, float]:
        """The share of the top ``k`` cells at each token role (:func:`~.roles.token_role`)."""
        n_pos = len(self.tokens)
        roles = [token_role(cell % n_pos, self.subject_range, n_pos)
                 for cell in self.ranking[:k]]
        return {role: roles.count(role) / max(k, 1) for role in dict.fromkeys(roles)}

    def summary(self) -> dict:
        """The scores: CPR and CMD of both curves, the random rankings' means."""
        return {"kind": self.kind, "cpr": self.cpr, "cmd": self.cmd,
                "necessity_cpr": self.necessity_cpr, "necessity_cmd": self.necessity_cmd,
                "random_cpr": float(np.mean(self.random_cpr)),
                "random_necessity_cpr": float(np.mean(self.random_necessity_cpr)),
                "n_cells": self.n_cells, "forwards": self.forwards, "seconds": self.seconds}

    def text(self) -> str:
        """A short plain-text table (what ``trace --faithfulness`` prints)."""
        frame = self.to_dataframe()
        lines = [f"{self.kind} trace faithfulness ({self.n_cells} cells, {len(self.corrupt_probs)}"
                 f" seeds, {len(self.random_cpr)} random rankings; {self.forwards} forwards, "
                 f"{self.rows} rows, {self.seconds:.1f} s)",
                 f"{'k':>5} {'% cells':>8} {'sufficiency':>12} {'random':>8} "
                 f"{'necessity':>10} {'random':>8}"]
        for row in frame.itertuples():
            lines.append(f"{row.k:>5} {row.size_pct:>8.2f} {row.sufficiency:>12.3f} "
                         f"{row.random_sufficiency_mean:>8.3f} {row.necessity:>10.3f} "
                         f"{row.random_necessity_mean:>8.3f}" + ("" if row.in_area else "  (top)"))
        lines.append(f"sufficiency CPR {self.cpr:.3f} CMD {self.cmd:.3f} (random CPR "
                     f"{min(self.random_cpr):.3f}..{max(self.random_cpr):.3f}); necessity "
                     f"area {self.necessity_cpr:.3f} (random {min(self.random_necessity_cpr):.3f}"
                     f"..{max(self.random_necessity_cpr):.3f})")
        return "\n".join(lines)

    def to_dataframe(self):
        """One row per point: ``k, size_pct, in_area, sufficiency, necessity`` and the random
        rankings' mean, min and max of each."""
        import pandas as pd  # pandas loads only when a table is asked for

        out = {"k": self.counts, "size_pct": [100 * k / self.n_cells for k in self.counts],
               "in_area": self.in_area, "sufficiency": self.sufficiency,
               "necessity": self.necessity}
        for name in ("sufficiency", "necessity"):
            rand = np.asarray(getattr(self, f"random_{name}"), dtype=np.float64)
            out.update({f"random_{name}_mean": rand.mean(0), f"random_{name}_min": rand.min(0),
                        f"random_{name}_max": rand.max(0)})
        return pd.DataFrame(out)

    def to_dict(self) -> dict:
        return asdict(self)

    @checked
    def to_json(self, path: str | Path | None = None) -> str:
        """The result as JSON text (written to ``path`` when given)."""
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False)
        if path is not None:
            write_text(text, path)
        return text

    @classmethod
    def from_json(cls, text: str) -> TraceFaithfulness:
        data = json.loads(text)
        data["subject_range"] = tuple(data["subject_range"])
        return cls(**data)

    @checked
    def plot(self, path: str | Path | None = None):
        """Sufficiency and necessity against the share of cells (log axis), each with the
        random rankings' band; saved to ``path`` when given. Returns the figure."""
        import matplotlib  # matplotlib loads only when a figure is drawn

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after the backend is chosen

        frame = self.to_dataframe().sort_values("k", kind="stable")
        frame = frame[frame.k > 0]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, name, area in ((axes[0], "sufficiency", self.cpr),
                               (axes[1], "necessity", self.necessity_cpr)):
            ax.fill_between(frame.size_pct, frame[f"random_{name}_min"],
                            frame[f"random_{name}_max"], alpha=0.25, color="gray",
                            label=f"random ({len(self.random_cpr)} draws)")
            ax.plot(frame.size_pct, frame[f"random_{name}_mean"], color="gray", lw=1)
            ax.plot(frame.size_pct, frame[name], marker="o",
                    label=f"trace's ranking (area {area:.3f})")
            ax.axhline(1.0, color="black", lw=0.5, ls="--")
            ax.set_xscale("log")
            ax.set_xlabel(f"top cells (% of {self.n_cells})")
            ax.set_title(f"{name}: share of the effect "
                         + ("recovered" if name == "sufficiency" else "lost"))
            ax.legend(loc="best", fontsize=8)
        axes[0].set_ylabel(f"{self.kind} trace, answer {self.answer!r}")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path)
        return fig


# ------------------------------------------------------------------------- circuits


def cell_masks(engine: TraceEngine, kind: TraceKind, window: int | None,
               circuits: torch.Tensor) -> torch.Tensor:
    """Bool ``[C, layers, positions]``: the sites (the kind's component at a layer and
    position) that circuits ``[C, cells]`` (cells layer-major) restore."""
    n_layers, n_pos = engine.n_layers, engine.seq_len
    spans = torch.zeros(n_layers, n_layers, dtype=torch.bool)  # cell's layer -> layers
    for layer in range(n_layers):
        spans[layer, engine.restore_layers(kind, layer, window or 1)] = True
    chosen = circuits.view(-1, n_layers, n_pos).double()  # [C, cell layer, position]
    return torch.einsum("clp,lm->cmp", chosen, spans.double()) > 0


def circuit_probs(engine: TraceEngine, kind: TraceKind, window: int | None,
                  circuits: torch.Tensor, *, rows_per_forward: int, shortcut: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """P(answer) ``[C, seeds]`` of each circuit (bool ``[C, cells]``) restored in each seed's
    noised run (sufficiency) and noised in the clean run (necessity); and the forwards run.
    Rows run ``rows_per_forward`` at a time through ``runtime.intervened``. With ``shortcut``, the
    rows whose P a forward would only round take the reference runs' (as the engine's
    ``skip_unchanged``): an empty circuit is the run itself, and a residual circuit holding
    the last block's output at the last position gives its donor's logits."""
    n_seeds = len(engine.seeds)
    masks = cell_masks(engine, kind, window, circuits)  # [C, L, P]
    n_circuits = len(circuits)
    # rows circuit-major, then seed, then mode (0: sufficiency, 1: necessity)
    circuit = torch.arange(n_circuits).repeat_interleave(2 * n_seeds)
    seed = torch.arange(n_seeds).repeat_interleave(2).repeat(n_circuits)
    mode = torch.arange(2).repeat(n_circuits * n_seeds)
    clean = engine.clean_probs[engine.answer_id]
    noised = engine.corrupt_probs[:, engine.answer_id][seed]
    out = torch.where(mode == 0, noised, clean)  # the value of a row with an empty circuit
    todo = torch.ones(len(mode), dtype=torch.bool)
    if shortcut:
        empty = ~masks.flatten(1).any(1)[circuit]
        donor_logits = (masks[:, -1, -1][circuit] if kind.restore == "block"
                        else torch.zeros_like(empty))
        out = torch.where(donor_logits, torch.where(mode == 0, clean, noised), out)
        todo = ~(empty | donor_logits)
    index = todo.nonzero().squeeze(1)
    forwards = 0
    if len(index):
        out[index], forwards = _forwards(engine, kind, masks[circuit[index]], seed[index],
                                         mode[index], rows_per_forward)
    probs = out.view(n_circuits, n_seeds, 2)
    return probs[..., 0], probs[..., 1], forwards


def _forwards(engine: TraceEngine, kind: TraceKind, masks: torch.Tensor, seed: torch.Tensor,
              mode: torch.Tensor, rows_per_forward: int) -> tuple[torch.Tensor, int]:
    """P(answer) of rows (``masks [rows, L, P]``, each row's seed index and mode) by batched
    forwards: ``noise_add`` on the embeddings and one ``clean_restore`` per layer."""
    bound = engine.bound
    # donor rows: 0 the clean run, 1 + s seed s's noised run (the engine's stacked outputs)
    donor = torch.where(mode == 0, 0, 1 + seed)
    noise_row = torch.where(mode == 0, 1 + seed, 0)  # by_seed row 0: no noise
    by_seed = torch.cat([torch.zeros_like(engine._noise_delta[:1]), engine._noise_delta])
    stacked = engine._stacked[kind.restore]  # [L, 1 + seeds, P, H]
    noise = NoiseAdd(seeds=engine.seeds, positions=engine.noise_positions,
                     scale=engine.noise.config()["scale"], sigma=engine.noise.config()["sigma"])
    restores = [CleanRestore(states=stacked[layer]) for layer in range(engine.n_layers)]
    reps = [{"component": bound.site("embed"), "intervention": noise}]
    reps += [{"component": engine._paths[kind.restore][layer], "intervention": made}
             for layer, made in enumerate(restores)]
    out = torch.empty(len(mode), dtype=torch.float64)
    forwards = 0
    with torch.no_grad(), intervened(bound, reps) as model:
        for first in range(0, len(mode), rows_per_forward):
            rows = slice(first, first + rows_per_forward)
            n = len(mode[rows])
            noise.retarget(by_seed, noise_row[rows].to(engine.device))
            row_masks = masks[rows].to(engine.device)  # [n, L, P]
            for layer, made in enumerate(restores):
                made.retarget(row_masks[:, layer], state_rows=donor[rows].to(engine.device))
            logits = model(input_ids=engine.ids.expand(n, -1), logits_to_keep=1).logits
            out[rows] = token_probs(logits[:, -1], engine.answer_id).cpu()
            forwards += 1
    return out, forwards


def _check(tracer: Tracer, result: TraceResult) -> TraceKind:
    if result.kind not in FAITHFUL_KINDS:
        raise InputError(f"result: a {result.kind} trace holds a sublayer at every layer; "
                         f"faithfulness reads the {', '.join(FAITHFUL_KINDS)} traces")
    mine = (list(result.tokens) == list(tracer.prompt.tokens)
            and list(result.seeds) == list(tracer.seeds)
            and result.answer_id == tracer.answer_id and result.scale == tracer.scale
            and result.sigma == tracer.sigma)
    if not mine:
        raise InputError("result: it is not this tracer's trace (its tokens, seeds, answer or "
                         "noise differ); the curves need the trace's own noise draws")
    return get_kind(result.kind)


@checked
def trace_faithfulness(tracer: Tracer, result: TraceResult, *,
                       settings: TraceFaithfulnessSettings | None = None,
                       **keywords) -> TraceFaithfulness:
    """Sufficiency and necessity curves of ``result``'s ranking of its cells (module
    docstring), made by ``tracer`` (its model and noise draws), with ``draws`` random rankings;
    settings: a :class:`TraceFaithfulnessSettings` or its fields as keywords. Refused
    (:class:`InputError`): a severed kind, another tracer's trace, a noise whose mean total
    effect is within 1e-4 of P(answer) (every share would be rounding over rounding)."""
    started = time.perf_counter()
    s = TraceFaithfulnessSettings.merged(settings, **keywords)
    kind = _check(tracer, result)
    engine = tracer.engine
    every = engine.n_layers * engine.seq_len
    candidates = torch.arange(every)  # the ranked cells' indices, layer-major
    if s.cells == "subject":
        candidates = candidates[torch.isin(candidates % engine.seq_len,
                                           torch.tensor(engine.noise_positions))]
    n_cells = len(candidates)
    # each point's k: the sizes' (the area points), then the top counts not above n_cells
    fractions = [round(size / 100, 12) for size in s.sizes]
    extra = [k for k in s.top if k <= n_cells]
    counts = [int(fraction * n_cells) for fraction in fractions] + extra
    in_area = [True] * len(fractions) + [False] * len(extra)
    ie = torch.as_tensor(result.grid("ie")).reshape(-1)[candidates]
    order = candidates[(-ie).argsort(stable=True)]
    g = torch.Generator().manual_seed(s.seed)
    orders = [order] + [candidates[torch.randperm(n_cells, generator=g)]
                        for _ in range(s.draws)]
    unique = sorted(set(counts))
    circuits = torch.zeros(len(orders), len(unique), every, dtype=torch.bool)
    for r, ranked in enumerate(orders):
        for i, k in enumerate(unique):
            circuits[r, i, ranked[:k]] = True
    clean = float(engine.clean_probs[engine.answer_id])
    corrupt = engine.corrupt_probs[:, engine.answer_id]  # [seeds]
    total = clean - corrupt
    if not abs(float(total.mean())) > 1e-4 * max(clean, float(corrupt.mean())):  # or NaN
        raise UndefinedCurveError(
            f"result: the noise barely moves P(answer) (clean {clean:g}, noised "
            f"{float(corrupt.mean()):g} on average): the shares recovered and lost would be "
            "rounding over rounding; trace with a larger noise scale")
    with measurement(tracer.bound):
        suff, nec, forwards = circuit_probs(engine, kind, result.window,
                                            circuits.view(-1, every),
                                            rows_per_forward=s.rows_per_forward)
    at = torch.tensor([unique.index(k) for k in counts])
    # [rankings, seeds, points]
    recovered = ((suff - corrupt) / total).view(len(orders), len(unique), -1)[:, at]
    lost = ((clean - nec) / total).view(len(orders), len(unique), -1)[:, at]
    recovered, lost = recovered.transpose(1, 2), lost.transpose(1, 2)
    # the curves: the seeds' mean P over their mean total effect (a seed whose noise leaves P
    # near clean would blow its own ratio up; its share is in *_per_seed)
    grid = (len(orders), len(unique), -1)
    mean_total = float(total.mean())
    f = ((suff.view(grid).mean(-1) - corrupt.mean()) / mean_total)[:, at]  # [rankings, points]
    gone = ((clean - nec.view(grid).mean(-1)) / mean_total)[:, at]
    area = slice(len(fractions))  # the area points come first
    # (CPR, CMD) of each ranking's curve: the trace's first, then the random ones
    (cpr, cmd), *suff_areas = [mib_areas(fractions, curve[area].tolist()) for curve in f]
    (nec_cpr, nec_cmd), *nec_areas = [mib_areas(fractions, curve[area].tolist()) for curve in gone]
    return TraceFaithfulness(
        kind=result.kind, window=result.window, answer=result.answer,
        tokens=list(result.tokens), subject_range=tuple(result.subject_range),
        settings={**asdict(s), "sizes": list(s.sizes), "top": list(s.top),
                  "seeds": list(engine.seeds)},
        n_layers=engine.n_layers, n_cells=n_cells, counts=counts, in_area=in_area,
        ranking=order.tolist(), clean_prob=clean, corrupt_probs=corrupt.tolist(),
        sufficiency=f[0].tolist(), necessity=gone[0].tolist(),
        sufficiency_per_seed=recovered[0].tolist(), necessity_per_seed=lost[0].tolist(),
        random_sufficiency=f[1:].tolist(), random_necessity=gone[1:].tolist(),
        cpr=cpr, cmd=cmd, necessity_cpr=nec_cpr, necessity_cmd=nec_cmd,
        random_cpr=[a[0] for a in suff_areas], random_cmd=[a[1] for a in suff_areas],
        random_necessity_cpr=[a[0] for a in nec_areas],
        random_necessity_cmd=[a[1] for a in nec_areas],
        forwards=forwards, rows=2 * len(engine.seeds) * circuits.shape[0] * circuits.shape[1],
        seconds=time.perf_counter() - started)
