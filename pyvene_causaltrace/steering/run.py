"""``intervene_features`` and what it measured, :class:`FeatureInterventionResult` (module
docstring of :mod:`pyvene_causaltrace.steering`)."""

from __future__ import annotations

import bisect
import json
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..arguments import MemoryMB, NonNegativeInt, PositiveInt, Text
from ..bound import BoundModel, bind
from ..errors import InputError, MemoryCapError, NonFiniteError
from ..finite import check_finite, positive_number
from ..interventions.clt_splice import clean_errors, clt_splice_representations
from ..interventions.frozen import FrozenAttention, attention_patterns
from ..memory import device_bytes
from ..model_guard import measured
from ..models import model_name
from ..prompts import first_position, tokenize_prompt
from ..runtime import intervened
from ..specs import SCHEMA_VERSION, validate_spec
from ..transcoders.transcoder import Transcoder, check_fits
from .settings import SteeringSettings

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

#: The keyword defaults: :class:`~.settings.SteeringSettings`' fields.
_DEFAULT = SteeringSettings()
#: New tokens from which a generation shows a progress bar by default.
LONG_GENERATION = 32
#: Interventions a summary lists before it only counts them.
SHOWN = 6

__all__ = ["FeatureInterventionResult", "check_feature_interventions", "feature_spec",
           "generation_mb", "intervene_features"]


@dataclass
class FeatureInterventionResult:
    """What :func:`~.run.intervene_features` measured: ``logits`` / ``clean_logits`` ``[vocab]``
    float32 at the last prompt position, with the interventions and without; the greedy
    continuations (empty without ``max_new_tokens``); ``top``, the ``top_k`` tokens of each run;
    ``spec``, whose ``run_spec`` reproduces the intervened logits (None for a transcoder not read
    from files: a spec names it by path)."""

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


def _integer(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise InputError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # int, numpy and torch integers
    except TypeError:
        raise InputError(f"{what} must be an integer, got {value!r}") from None


def check_feature_interventions(interventions: object, transcoder: Transcoder, n_positions: int,
                                dtype: torch.dtype = torch.float32, first: int = 1
                                ) -> list[tuple[int, int | str, int, float]]:
    """``interventions`` as ``(layer, position, feature, value)`` tuples of plain numbers,
    negative positions made absolute. :class:`InputError` for an empty list, a malformed item, a
    layer, feature or position out of range (spliced positions start at ``first``), or a feature
    set twice at a position; :class:`NonFiniteError` for a value ``dtype`` (the narrower of the
    model's and transcoder's) cannot hold."""
    largest = float(torch.finfo(dtype).max)
    items = None
    if not isinstance(interventions, str | bytes):
        try:
            items = list(interventions)  # type: ignore[call-overload]
        except TypeError:
            pass
    if items is None:
        raise InputError("interventions must be a list of (layer, position, feature, value), "
                         f"got {type(interventions).__name__}")
    if not items:
        raise InputError("no feature interventions: give a list of (layer, position, feature, "
                         "value)")
    n_layers, n_features = transcoder.n_layers, transcoder.cfg.d_transcoder
    out, seen = [], {}
    for i, item in enumerate(items):
        where = f"interventions[{i}]"
        try:
            layer, position, feature, value = item
        except (TypeError, ValueError):
            raise InputError(f"{where} must be (layer, position, feature, value), got "
                             f"{item!r}") from None
        layer = _integer(layer, f"{where} layer")
        if not 0 <= layer < n_layers:
            raise InputError(f"{where}: layer {layer} is outside the transcoder's 0..."
                             f"{n_layers - 1}")
        feature = _integer(feature, f"{where} feature")
        if not 0 <= feature < n_features:
            raise InputError(f"{where}: feature {feature} is outside 0..{n_features - 1} (the "
                             f"transcoder has {n_features} per layer)")
        if position != "all":
            position = _integer(position, f"{where} position (an integer or 'all')")
            absolute = position + n_positions if position < 0 else position
            if not first <= absolute < n_positions:
                why = ("position 0 is BOS here, never spliced: bos='never' splices it"
                       if first else "negative positions count from the end")
                raise InputError(f"{where}: position {position} is outside the prompt's "
                                 f"spliced positions {first}..{n_positions - 1} ({why}; 'all' "
                                 "also reaches generated tokens)")
            position = absolute
        if isinstance(value, bool | str | bytes):
            raise InputError(f"{where} value must be a number, got {value!r}")
        try:
            value = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InputError(f"{where} value must be a number, got {value!r}") from None
        if not math.isfinite(value):
            raise NonFiniteError(f"{where}: value {value} is not finite")
        if abs(value) > largest:
            raise NonFiniteError(f"{where}: value {value:g} does not fit {dtype} (largest "
                                 f"{largest:.4g}): it would be inf in the run")
        clashes = [j for (lay, feat, pos), j in seen.items() if (lay, feat) == (layer, feature)
                   and (pos == position or "all" in (pos, position))]
        if clashes:
            raise InputError(f"{where} sets layer {layer} feature {feature} at a position "
                             f"where interventions[{clashes[0]}] already sets it")
        seen[(layer, feature, position)] = i
        out.append((layer, position, feature, value))
    return out


def _ablations(items: list[tuple[int, int | str, int, float]]) -> list[dict[str, Any]]:
    """``feature_ablate`` settings: one per (layer, position) in first-seen order, with one
    value per feature (a single number when they share it)."""
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for layer, position, feature, value in items:
        groups.setdefault((layer, position), []).append((feature, value))
    out = []
    for (layer, position), pairs in groups.items():
        settings: dict[str, Any] = {"clt_layer": layer, "features": [f for f, _ in pairs]}
        if position != "all":
            settings["positions"] = [position]
        values = [v for _, v in pairs]
        out.append({**settings, "value": values[0] if len(set(values)) == 1 else values})
    return out


def generation_mb(bound: BoundModel, transcoder: Transcoder, length: int) -> float:
    """MB one generation step holds at ``length`` tokens (each step reruns the whole
    sequence): the logits twice (the model's and pyvene's copy), one layer's attention scores
    and probabilities, the block's states, and every layer's transcoder features."""
    hidden, heads, inner = bound.d_model, bound.n_heads, bound.d_mlp
    model_bytes = bound.element_size * (2 * length * bound.vocab_size
                                        + 2 * heads * length * length
                                        + 8 * length * max(hidden, inner))
    features = transcoder.n_layers * length * transcoder.cfg.d_transcoder
    return (model_bytes + 4 * features) / 2**20


def check_generation_fits(model: BoundModel, transcoder: Transcoder, n_prompt: int,
                          max_new_tokens: int, memory_mb: float | None = None) -> None:
    """Refuse, before any forward, a generation past the model's positions or whose last
    step would not fit ``memory_mb`` (default: the device's memory), saying how many new tokens
    fit."""
    model.check_generation_length(n_prompt, max_new_tokens)
    device = model.device
    if memory_mb is not None:
        budget = positive_number(memory_mb, "memory_mb")
    else:  # a GPU's memory, else what this process may use of the machine's
        budget = device_bytes(device) / 2**20
    if generation_mb(model, transcoder, n_prompt + max_new_tokens) <= budget:
        return
    # the most new tokens that fit (the size grows with the length): bisected
    low = max(0, bisect.bisect_right(range(max_new_tokens), budget, key=lambda new: generation_mb(
        model, transcoder, n_prompt + new)) - 1)
    raise MemoryCapError(
        f"max_new_tokens={max_new_tokens}: the last step reruns {n_prompt + max_new_tokens} "
        f"tokens and would hold {generation_mb(model, transcoder, n_prompt + max_new_tokens):,.0f}"
        f" MB, over the {budget:,.0f} MB budget (memory_mb, default the {device.type}'s "
        f"memory); at most {low} new tokens fit")


def _greedy(step, ids: torch.Tensor, max_new_tokens: int, eos: int | None, show: bool,
            desc: str) -> tuple[torch.Tensor, list[int]]:
    """The last-position logits of ``step(ids)`` and up to ``max_new_tokens`` greedy tokens,
    each step on the whole sequence so far (no key-value cache); stops after ``eos``. With
    ``show``, a tqdm bar ``desc`` on stderr counts the tokens."""
    from tqdm.auto import tqdm  # loaded when a generation runs

    first, generated = None, []
    with tqdm(total=max_new_tokens, desc=desc, unit="token", leave=False, disable=not show) as bar:
        for _ in range(max(1, max_new_tokens)):
            logits = step(ids)[0, -1]
            if first is None:
                first = logits
            if len(generated) == max_new_tokens:
                break
            token = int(logits.argmax())
            generated.append(token)
            bar.update(1)
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
            if token == eos:
                break
    return first, generated


def _top(logits: torch.Tensor, tokenizer, run: str, k: int) -> list[dict[str, Any]]:
    probs = logits.double().softmax(-1)
    values, ids = probs.topk(min(k, probs.numel()))
    return [{"run": run, "rank": rank, "token_id": int(i), "token": tokenizer.decode([int(i)]),
             "logit": float(logits[i]), "prob": float(p)}
            for rank, (p, i) in enumerate(zip(values, ids, strict=True))]


def feature_spec(prompt: str, items: list[tuple[int, int | str, int, float]], source: str, *,
                 hold_errors: bool, freeze_attention: bool, model: str = "",
                 from_position: int = 1) -> dict[str, Any]:
    """The JSON spec of a feature intervention on ``prompt`` (a ``clt_splice`` with ``error``
    ``"clean"`` or ``"live"`` from ``from_position`` on, one ``feature_ablate`` with ``value``
    per (layer, position), ``frozen_attention`` with ``pattern: "clean"``); validated."""
    entries: list[dict[str, Any]] = [
        {"type": "clt_splice", "clt": source, "error": "clean" if hold_errors else "live",
         "from_position": from_position}]
    entries += [{"type": "feature_ablate", **settings} for settings in _ablations(items)]
    if freeze_attention:
        entries.append({"type": "frozen_attention", "pattern": "clean"})
    spec = {"schema_version": SCHEMA_VERSION, "name": "feature_steering",
            **({"model": model} if model else {}), "prompt": prompt, "interventions": entries}
    validate_spec(spec)
    return spec


@measured  # one measurement per model at a time, in eval mode
def intervene_features(
    model: nn.Module, tokenizer: Tokenizer, transcoder: Transcoder, prompt: Text,
    interventions: list | tuple, *, max_new_tokens: NonNegativeInt = _DEFAULT.max_new_tokens,
    hold_errors: bool = _DEFAULT.hold_errors,
    freeze_attention: bool = _DEFAULT.freeze_attention, top_k: PositiveInt = _DEFAULT.top_k,
    memory_mb: MemoryMB | None = _DEFAULT.memory_mb, progress: bool | None = None,
    bos: str = _DEFAULT.bos, settings: SteeringSettings | None = None,
) -> FeatureInterventionResult:
    """Set transcoder features to values and read the logits; optionally generate greedily
    with them held (circuit-tracer's ``feature_intervention`` / ``_generate``).

    ``model`` is the bare model; ``transcoder`` is spliced in at every layer. Each ``(layer,
    position, feature, value)`` sets the feature after its encoder; ``position`` is a spliced
    prompt position (negative from the end) or ``"all"`` (also every generated token). The
    settings are :class:`~.settings.SteeringSettings`' fields; ``progress`` (None: from
    ``LONG_GENERATION`` tokens) shows a bar. Bad items, values the dtype cannot hold and a
    generation over ``memory_mb`` are refused before any forward. ``result.spec`` reproduces
    the intervened logits through ``run_spec``. Details: docs/attribution.md, "Feature
    interventions and steering"."""
    s = SteeringSettings.merged(settings, max_new_tokens=max_new_tokens, hold_errors=hold_errors,
                                freeze_attention=freeze_attention, top_k=top_k,
                                memory_mb=memory_mb, bos=bos)
    steps, hold_errors, freeze_attention = s.max_new_tokens, s.hold_errors, s.freeze_attention
    top_k, memory_mb = s.top_k, s.memory_mb
    bound = bind(model)  # the architecture, resolved once for this call
    model = bound.model
    check_fits(bound, transcoder)
    tokenized = tokenize_prompt(tokenizer, prompt)
    n_pos = tokenized.seq_len
    if progress is not None and not isinstance(progress, bool):
        raise InputError(f"progress must be True, False or None, got {progress!r}")
    narrowest = min((next(model.parameters()).dtype, transcoder.dtype),
                    key=lambda t: torch.finfo(t).max)
    start = first_position(tokenizer, s.bos)
    items = check_feature_interventions(interventions, transcoder, n_pos, narrowest, start)
    device = next(model.parameters()).device
    ids = tokenized.input_ids.to(device)
    bound.check_inputs(ids)
    check_generation_fits(bound, transcoder, n_pos, steps, memory_mb)
    bound.check_weights()
    eos = tokenizer.eos_token_id
    show = steps >= LONG_GENERATION if progress is None else progress and steps > 0

    with torch.no_grad():
        clean, clean_new = _greedy(lambda x: model(input_ids=x).logits, ids, steps, eos, show,
                                   "clean generation")
        errors = clean_errors(bound, transcoder, ids, start) if hold_errors else None
        reps = clt_splice_representations(
            bound, transcoder, from_position=start, ablations=_ablations(items), errors=errors,
            live_error=True, error_from="clean" if hold_errors else None)
        if freeze_attention:
            reps += [{"component": bound.site("attn_output", layer),
                      "intervention": FrozenAttention(pattern=pattern, pattern_from="clean")}
                     for layer, pattern in enumerate(attention_patterns(bound, ids))]
        with intervened(bound, reps) as spliced:
            steered, new = _greedy(lambda x: spliced(input_ids=x).logits, ids, steps, eos, show,
                                   "steered generation")
    check_finite(steered, "the intervened run's logits", "a value this large overflows")
    source = transcoder.source
    spec = None if source is None else feature_spec(
        prompt, items, source, hold_errors=hold_errors, freeze_attention=freeze_attention,
        model=model_name(model), from_position=start)
    return FeatureInterventionResult(
        prompt=prompt, tokens=list(tokenized.tokens), interventions=items,
        hold_errors=hold_errors, freeze_attention=freeze_attention,
        logits=steered.float().cpu(), clean_logits=clean.float().cpu(),
        top=_top(clean, tokenizer, "clean", top_k) + _top(steered, tokenizer, "intervened",
                                                          top_k),
        generated_ids=new, generated_text=tokenizer.decode(new) if new else "",
        clean_generated_ids=clean_new,
        clean_generated_text=tokenizer.decode(clean_new) if clean_new else "",
        spec=spec, model=model_name(model), transcoder=source)
