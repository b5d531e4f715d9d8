"""Causal tracing of one prompt (Meng et al. 2022): the whole protocol in a few calls.

    tracer = Tracer(model, tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower",
                    answer=" Paris", seeds=10)   # or settings=TraceSettings(...)
    result = tracer.trace("residual")            # also "mlp", "attn", "severed-mlp", ...
    heads = tracer.trace_heads(layers=[10, 11])  # one attention head restored at a time
    tracer.controls()                            # the two checks that can fail
    trace(model, tokenizer, prompt, subject, kind="mlp", window=10)   # one-shot form

Settings are :class:`~.settings.TraceSettings`' fields; docs/tracing.md has the protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..arguments import MemoryMB, NonNegativeInt, PositiveInt, Text, checked
from ..bound import bind
from ..errors import InputError
from ..finite import check_finite, positive_number
from ..interventions.noise import seed_list
from ..model_guard import measurement
from ..model_interventions import describe, model_for_spec
from ..models import model_name
from ..prompts import answer_token_id, tokenize_prompt
from ..specs import ExperimentSpec, SpecError, load_spec
from .chunks import check_seeds_fit
from .engine import KINDS, RESIDUAL_WINDOW, TraceEngine, get_kind
from .head_restore import HeadRestorer, check_layers
from .noise_scale import NoiseScaleSweep, resolve_sigma, sweep_noise_scale
from .results import HeadTraceResult, TraceResult
from .settings import TraceSettings

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

_DEFAULT = TraceSettings()


@dataclass(frozen=True)
class ControlReport:
    """The controls that can fail (the grid's corners hold for any donor):
    ``corrupted_donor_max_abs``, the largest change of P(answer) when every cell restores the
    corrupted run's own states (should be 0), and ``window_vs_single``, per window tried at the last
    position, ``(window layers, |difference|)`` between a residual window restore and the
    single-layer restore at the window's last layer (should be 0)."""

    corrupted_donor_max_abs: float
    window_vs_single: list[tuple[list[int], float]]
    tolerance: float

    @property
    def passed(self) -> bool:
        return (self.corrupted_donor_max_abs <= self.tolerance
                and all(diff <= self.tolerance for _, diff in self.window_vs_single))

    def summary(self) -> str:
        lines = [f"restore from the corrupted run's own states: max |change in P| = "
                 f"{self.corrupted_donor_max_abs:.2e}"]
        for layers, diff in self.window_vs_single:
            lines.append(f"last position, residual window layers {layers[0]}..{layers[-1]} vs "
                         f"layer {layers[-1]} alone: |difference| = {diff:.2e}")
        lines.append(f"controls {'pass' if self.passed else 'FAIL'} "
                     f"(tolerance {self.tolerance:g})")
        return "\n".join(lines)


class Tracer:
    """One prompt, its clean and corrupted runs, and every trace kind on top of them.

    ``subject`` must occur in ``prompt`` (``occurrence`` picks which); ``answer`` is a string
    (its first token; a warning if it has more) or, by default, the clean argmax. The other
    keywords are :class:`~.settings.TraceSettings`' fields, or ``settings=`` gives them at once
    (a keyword that contradicts it is refused). ``model`` may be a ``pv.IntervenableModel``: its
    interventions act in every run, and :meth:`spec` writes them into the spec or refuses."""

    @checked
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        prompt: Text,
        subject: Text,
        *,
        answer: Text | None = None,
        seeds: int | Sequence[int] = _DEFAULT.seeds,
        scale: float | str = _DEFAULT.scale,
        sigma: str | float = _DEFAULT.sigma,
        occurrence: NonNegativeInt = 0,
        distribution: str = _DEFAULT.distribution,
        memory_budget_mb: MemoryMB = _DEFAULT.memory_budget_mb,
        reuse_prefix: bool = _DEFAULT.reuse_prefix,
        replay_layers: bool = _DEFAULT.replay_layers,
        scales: Sequence[float] = _DEFAULT.scales,
        window: PositiveInt = _DEFAULT.window,
        settings: TraceSettings | None = None,
    ) -> None:
        #: The :class:`~.settings.TraceSettings` this tracer runs with (checked when made).
        self.settings = settings = TraceSettings.merged(
            settings, seeds=seeds, scale=scale, scales=scales, sigma=sigma,
            distribution=distribution, window=window, memory_budget_mb=memory_budget_mb,
            reuse_prefix=reuse_prefix, replay_layers=replay_layers)
        seeds, scale, sigma = settings.seeds, settings.scale, settings.sigma
        distribution, memory_budget_mb = settings.distribution, settings.memory_budget_mb
        # the architecture, resolved once per tracer (a dataset binds once for every fact); a
        # pv.IntervenableModel's interventions act in every run (each inside measurement())
        self.bound = bound = bind(model, interventions=True)
        with measurement(bound) as model:
            bound.check_weights()
            self.model, self.tokenizer = model, tokenizer
            self.prompt = tokenize_prompt(tokenizer, prompt, subject, occurrence)
            self.occurrence = occurrence  # a spec written from this tracer repeats it
            self.noise_positions = list(range(*self.prompt.subject_range))
            bound.check_inputs(self.prompt.input_ids)
            # a count is checked before its list is made: 10^8 seeds would fill memory
            check_seeds_fit(settings.n_seeds, self.prompt.seq_len, bound, memory_budget_mb)
            self.seeds = seeds = seed_list(seeds)
            self.sigma_method, self.sigma = resolve_sigma(sigma, bound, tokenizer, subject)
            self.answer_text = answer  # as given: a spec written from this tracer repeats it
            if answer is not None:
                self.answer_id = answer_token_id(tokenizer, answer)
                bound.check_answer(self.answer_id)
            else:
                with torch.no_grad():
                    ids = self.prompt.input_ids.to(next(model.parameters()).device)
                    logits = model(input_ids=ids, logits_to_keep=1).logits
                    self.answer_id = int(logits[0, -1].argmax())
            self.sweep: NoiseScaleSweep | None = None
            if scale == "auto":
                self.sweep = sweep_noise_scale(
                    bound, self.prompt.input_ids, self.noise_positions, self.answer_id, seeds,
                    self.sigma, sigma_method=self.sigma_method, scales=settings.scales,
                    distribution=distribution)
                if self.sweep.chosen is None:
                    raise InputError(f"scale='auto': {self.sweep.reason()}")
                scale = self.sweep.chosen
            self.scale = positive_number(scale, "scale")
            self.distribution = distribution
            self.engine = TraceEngine(
                bound, self.prompt.input_ids, self.noise_positions, seeds, self.scale, self.sigma,
                self.answer_id, distribution=distribution, memory_budget_mb=memory_budget_mb,
                reuse_prefix=settings.reuse_prefix, replay_layers=settings.replay_layers)
            check_finite(self.engine.clean_probs, "the clean run's probabilities",
                         "the weights are finite, so the activations overflow (try float32)")
            check_finite(self.engine.corrupt_probs, "the corrupted run's probabilities",
                         f"the noise (scale {self.scale} x sigma {self.sigma:.4g}) is too large")

    @property
    def with_interventions(self) -> bool:
        """Built on a ``pv.IntervenableModel``: its interventions act in every run."""
        return self.bound.carries_interventions

    @property
    def clean_prob(self) -> float:
        return float(self.engine.clean_probs[self.answer_id])

    @property
    def corrupt_probs(self) -> np.ndarray:
        return self.engine.corrupt_probs[:, self.answer_id].numpy()

    def cells(self) -> list[tuple[int, int]]:
        return [(layer, pos) for layer in range(self.engine.n_layers)
                for pos in range(self.prompt.seq_len)]

    def _window(self, window: int | None) -> int:
        """``window``, or the settings' when ``None`` (checked as the settings check it)."""
        return self.settings.window if window is None else \
            replace(self.settings, window=window).window

    @checked
    def trace(self, kind: str = "residual", *, window: int | None = None,
              progress: bool = True) -> TraceResult:
        """Every (layer, position) cell of ``kind``, for every seed; ``window`` layers per
        window of the windowed kinds (``None``: the settings'). ``progress``: a tqdm bar over the
        rows on stderr, as the command line shows."""
        trace_kind = get_kind(kind)
        window = self._window(window)
        spec = self.spec(kind, window)  # before the run: a model it cannot write is refused
        cells = self.cells()
        bar = tqdm(total=len(self.seeds) * len(cells), desc=f"{kind} trace", unit="row",
                   disable=not progress)
        with bar, measurement(self.bound):
            probs = self.engine.run(trace_kind, cells, window=window, progress=bar.update)
        check_finite(probs, f"the restored probabilities of the {kind} trace")
        restored = probs.numpy().reshape(len(self.seeds), self.engine.n_layers,
                                         self.prompt.seq_len)
        return TraceResult(**self._result_fields(), kind=kind, restored_probs=restored,
                           window=window if trace_kind.windowed else None, spec=spec)

    @checked
    def trace_heads(self, layers: int | Sequence[int] | None = None, *, position: int = -1,
                    progress: bool = True) -> HeadTraceResult:
        """The attention trace broken down by head: for every head of ``layers`` (default all)
        and seed, P(answer) with that head's clean output alone restored at ``position`` (default
        the last) in the corrupted run (:mod:`.head_restore`). ``progress`` as :meth:`trace`'s."""
        chosen = check_layers(layers, self.engine.n_layers)
        with measurement(self.bound):
            restorer = HeadRestorer(self.engine, chosen)
            at = restorer.position(position)
            n_heads = restorer.n_heads
            cells = [(layer, (head,)) for layer in chosen for head in range(n_heads)]
            bar = tqdm(total=len(self.seeds) * len(cells), desc="head trace", unit="row",
                       disable=not progress)
            with bar:
                probs = restorer.run(cells, at, progress=bar.update)
        check_finite(probs, "the restored probabilities of the head trace")
        restored = probs.numpy().reshape(len(self.seeds), len(chosen), n_heads)
        return HeadTraceResult(**self._result_fields(), layers=chosen, position=at,
                               restored_probs=restored)

    def _result_fields(self) -> dict:
        """The fields a trace's and a head trace's results share."""
        return {"tokens": list(self.prompt.tokens), "subject_range": self.prompt.subject_range,
                "noise_positions": self.noise_positions, "answer_id": self.answer_id,
                "answer": self.tokenizer.decode([self.answer_id]), "scale": self.scale,
                "sigma": self.sigma, "sigma_method": self.sigma_method, "seeds": self.seeds,
                "clean_prob": self.clean_prob, "corrupt_probs": self.corrupt_probs}

    @checked
    def spec(self, kind: str, window: int | None = None) -> dict:
        """The JSON spec that reproduces ``trace(kind)`` (``window``: ``None`` is the settings'),
        a ``pv.IntervenableModel``'s interventions in ``model_interventions``; one a spec cannot
        rebuild exactly is refused (``PyveneModelError``, with the reason)."""
        entries = describe(self.bound)
        model = model_name(self.model)
        sigma = self.sigma if self.sigma_method == "given" else self.sigma_method
        spec = {"schema_version": 1}
        if model:
            spec["model"] = model
        spec.update(prompt=self.prompt.text, subject=self.prompt.subject)
        if self.occurrence:
            spec["subject_occurrence"] = self.occurrence
        if self.answer_text is not None:  # otherwise the clean argmax, found again
            spec["answer"] = self.answer_text
        spec["interventions"] = [{"type": "noise_add", "positions": "subject",
                                  "seeds": self.seeds, "scale": self.scale, "sigma": sigma,
                                  "distribution": self.distribution}]
        spec["trace"] = {"kind": kind, "window": self._window(window)}
        if entries:
            spec["model_interventions"] = entries
        return spec

    @checked
    def controls(self, *, window: int | None = None, tolerance: float = 1e-5) -> ControlReport:
        """Run the two controls that can fail (see :class:`ControlReport`; ``window``:
        ``None`` is the settings')."""
        window = self._window(window)
        engine, residual, last = self.engine, KINDS["residual"], self.prompt.seq_len - 1
        n_layers = engine.n_layers
        centres = sorted({0, n_layers // 3, (2 * n_layers) // 3, n_layers - 1})
        ends = [engine.restore_layers(RESIDUAL_WINDOW, c, window) for c in centres]
        with measurement(self.bound):
            donor = engine.run(residual, self.cells(), donor="corrupted")
            # every row computed: a window reaching the last layer would otherwise take the
            # clean P on both sides without a forward, and the control would check nothing there
            windowed = engine.run(RESIDUAL_WINDOW, [(c, last) for c in centres], window=window,
                                  skip_unchanged=False)
            single = engine.run(residual, [(layers[-1], last) for layers in ends],
                                skip_unchanged=False)
        corrupt = engine.corrupt_probs[:, self.answer_id][:, None]
        pairs = [(layers, float((windowed[:, i] - single[:, i]).abs().max()))
                 for i, layers in enumerate(ends)]
        return ControlReport(float((donor - corrupt).abs().max()), pairs, tolerance)


@checked
def trace(model: nn.Module, tokenizer: Tokenizer, prompt: Text, subject: Text, *,
          kind: str = "residual", progress: bool = True, **options) -> TraceResult:
    """One trace of one kind; ``options`` are :class:`Tracer`'s keyword arguments, ``progress``
    :meth:`Tracer.trace`'s. Every setting is checked before the model runs."""
    get_kind(kind)
    return Tracer(model, tokenizer, prompt, subject, **options).trace(kind, progress=progress)


@checked
def tracer_from_spec(spec: ExperimentSpec | dict | str, model: nn.Module, tokenizer: Tokenizer,
                     **options) -> Tracer:
    """A :class:`Tracer` for a trace spec (one with ``"trace"``); ``options`` add Tracer
    keywords (``memory_budget_mb``), other noise settings default to
    :class:`~.settings.TraceSettings`'; the spec's ``trace.window`` is the tracer's window.
    The spec's ``model_interventions`` are rebuilt around the bare ``model`` and act in every
    run."""
    spec = spec if isinstance(spec, ExperimentSpec) else load_spec(spec)
    if spec.trace is None:
        raise SpecError("$.trace", "not a trace spec: add {\"trace\": {\"kind\": ...}}")
    if spec.subject is None:
        raise SpecError("$.subject", "a trace needs a subject")
    noise = spec.noise
    positions = noise.get("positions", "subject")
    if positions != "subject":
        raise SpecError("$.interventions[0].positions",
                        f"a trace noises the subject; got {positions!r}")
    model = model_for_spec(spec, bind(model, interventions=True))
    given = {key: value for key in ("scale", "sigma", "distribution")
             if (value := noise.get(key)) is not None}
    if spec.trace.get("window") is not None:  # the mlp and attn kinds': trace(kind) uses it
        given["window"] = spec.trace["window"]
    return Tracer(
        model, tokenizer, spec.prompt, spec.subject, answer=spec.answer,
        seeds=noise.get("seeds"), occurrence=spec.subject_occurrence or 0, **given, **options)
