"""The bound object attribution runs on: a model with its tokenizer and transcoder, checked once.

:class:`ReplacementModel` checks when made what every later step relies on (the transcoder fits
the model, the weights are finite), resolves the adapter and the device, and carries them to
each phase of :func:`~.attribute.attribute`:

    replacement = ReplacementModel(model, tokenizer, transcoder)
    prompt = replacement.prepare("The Eiffel Tower is in the city of", " Paris")
    replacement.check_memory(prompt.input_ids, memory_mb=AttributionSettings.memory_mb)
    run = replacement.run(prompt.input_ids)      # the local replacement model's forward

Position 0 is spliced and attributed like any token unless it is BOS (``bos``,
:data:`~..prompts.BOS_MODES`: ``"auto"`` follows the tokenizer, ``"always"`` is circuit-tracer's
convention). ``model`` is a plain model; :func:`~.attribute.attribute` binds the one a pyvene
``IntervenableModel`` wraps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..bound import BoundModel, bind
from ..errors import InputError
from ..fingerprint import transcoder_fingerprint
from ..finite import check_finite
from ..models import model_name
from ..prompts import bos_metadata, first_position, tokenizer_adds_bos
from ..transcoders.lorsa import LorsaSet, check_lorsa_fits
from ..transcoders.transcoder import Transcoder, check_fits
from .budget import active_counts, check_forward_fits
from .lorsa_nodes import lorsa_fingerprint
from .precision import compute_dtype as dtype_for
from .precision import precision
from .replacement import ReplacementRun, check_batch, replacement_forward, state_module
from .settings import BOS_ERRORS, AttributionSettings
from .targets import Target, make_targets

#: The keyword defaults: :class:`~.settings.AttributionSettings`' fields.
_DEFAULT = AttributionSettings()

if TYPE_CHECKING:  # transformers takes seconds to import; only the annotations need it
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PreparedPrompt:
    """A tokenized prompt, the clean model's logits on it and the targets they fix.

    ``logits`` are the real model's at the last position (soft-capped, if it caps);
    ``target_logits`` are what the graph explains: the pre-cap logits (the same tensor
    without a cap, ``softcap`` None).
    ``targets`` are the graph's logit nodes, in node order (:func:`~.targets.make_targets`)."""

    text: str
    input_ids: torch.Tensor  # [1, P], on the model's device
    logits: torch.Tensor
    target_logits: torch.Tensor
    softcap: float | None
    targets: tuple[Target, ...]
    #: ``[L]`` active features per layer, read during the clean forward (for the memory check)
    active_counts: torch.Tensor | None = None

    @property
    def target(self) -> Target:
        """The first (most probable) target."""
        return self.targets[0]

    @property
    def states(self) -> list[str]:
        """The residual-stream states the targets read (none for logit targets)."""
        return [t.output for t in self.targets if not t.is_logit]


class ReplacementModel:
    """``model`` bound to its ``tokenizer`` and ``transcoder`` (module docstring).

    Raises :class:`~..errors.TranscoderMismatchError` for a transcoder that does not fit the
    model, :class:`~..errors.NonFiniteError` for weights with NaN/inf, and
    :class:`~..errors.UnsupportedModelError` for an architecture without an adapter."""

    def __init__(self, model: nn.Module | BoundModel, tokenizer: PreTrainedTokenizerBase,
                 transcoder: Transcoder, *, bos: str = _DEFAULT.bos,
                 attention: LorsaSet | None = None) -> None:
        #: the model bound once (its architecture, dimensions); ``model`` is its module
        self.bound = bind(model)
        check_fits(self.bound, transcoder)
        self.model = model = self.bound.model
        self.bound.check_weights()
        self.tokenizer = tokenizer
        self.transcoder = transcoder
        #: the Lorsa set replacing attention at its layers (:mod:`.lorsa_nodes`), or None
        self.lorsa = attention
        if attention is not None:
            check_lorsa_fits(self.bound, attention)
        self.device = self.bound.device
        #: how position 0 is treated (:data:`~..prompts.BOS_MODES`) and so the first position
        #: spliced and attributed: 1 when position 0 is BOS, else 0
        self.bos = bos
        self.from_position = first_position(tokenizer, bos)

    def tokenize(self, prompt: str) -> torch.Tensor:
        """``[1, P]`` token ids of ``prompt`` on the model's device, checked readable."""
        ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"].to(self.device)
        self.bound.check_inputs(ids)
        return ids

    def prepare(self, prompt: str, answer: str | None = None, *,
                settings: AttributionSettings | None = None) -> PreparedPrompt:
        """Tokenize ``prompt``, run the clean model and fix the targets
        (:func:`~.targets.make_targets`: the answer's, a direction, or without an answer the
        salient logits) as ``settings`` say (default :class:`~.settings.AttributionSettings`'
        defaults: its ``target``, ``other``, ``k`` and salient-logit settings are read)."""
        settings = _DEFAULT if settings is None else settings
        max_n_logits, desired_logit_prob = settings.salient()
        ids = self.tokenize(prompt)
        box: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            counts = active_counts(  # one forward: logits and counts
                self.bound, self.transcoder, ids, from_position=self.from_position,
                run=lambda: box.setdefault("logits", self.model(
                    input_ids=ids, logits_to_keep=1).logits))
            clean = box["logits"]  # [1, 1, V]: the targets read the last position alone
            with self.bound.pre_softcap() as cap:
                uncapped = clean if cap is None else \
                    self.model(input_ids=ids, logits_to_keep=1).logits
        check_finite(clean, "the clean run's logits",
                     "the weights are finite, so the activations overflow")
        probabilities = clean[0, -1].float().softmax(-1)
        goals = make_targets(uncapped, probabilities, self.tokenizer, answer,
                             target=settings.target, other=settings.other, k=settings.k,
                             max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob)
        for goal in goals:
            if goal.is_logit:
                self.bound.check_answer(goal.token)
            self._check_direction(goal, ids.shape[1])
        return PreparedPrompt(prompt, ids, clean, uncapped, cap, tuple(goals), counts)

    def _check_direction(self, goal: Target, n_pos: int) -> None:
        """Refuse a direction target that does not fit the model or the prompt."""
        if goal.is_logit:
            return
        d_model = self.bound.d_model
        if goal.coefficients.numel() != d_model:
            raise InputError(f"the direction target has {goal.coefficients.numel()} entries; "
                             f"the model's residual stream has {d_model}")
        if not -n_pos <= goal.position < n_pos:
            raise InputError(f"the direction target reads position {goal.position}; the prompt "
                             f"has {n_pos} tokens")
        state_module(self.bound, goal.output)  # refuses a layer out of range

    def check_memory(self, input_ids: torch.Tensor, memory_mb: float,
                     counts: torch.Tensor | None = None) -> int:
        """Raise :class:`~.budget.MemoryCapError` unless the local replacement forward on
        ``input_ids`` fits ``memory_mb``; returns its estimated bytes. ``counts``: the active
        features per layer if known (:attr:`PreparedPrompt.active_counts`), else one more
        forward counts them."""
        if counts is None:
            counts = active_counts(self.bound, self.transcoder, input_ids, self.from_position)
        return check_forward_fits(self.bound, self.transcoder, input_ids, memory_mb, counts)

    def run(self, input_ids: torch.Tensor, *, freeze: bool = _DEFAULT.freeze,
            from_position: int | None = None, states: Sequence[str] = (),
            bos_errors: str = _DEFAULT.bos_errors,
            compute_dtype: str | None = _DEFAULT.compute_dtype) -> ReplacementRun:
        """One forward of the local replacement model
        (:func:`~.replacement.run_local_replacement`, without checking the fit again), spliced
        from ``from_position`` (default :attr:`from_position`, the ``bos`` rule's), keeping
        the residual ``states`` a direction target reads; ``bos_errors="drop"`` makes the
        position-0 errors constants instead of nodes — only where position 0 is BOS (not
        spliced): elsewhere they are what the dictionary misses of a real token. ``compute_dtype``
        (:data:`~.precision.DTYPES`; None: the model's) is the forward's (:mod:`.precision`)."""
        check_batch(input_ids)
        if bos_errors not in BOS_ERRORS:
            raise InputError(f"bos_errors must be 'keep' or 'drop', got {bos_errors!r}")
        from_position = self.from_position if from_position is None else from_position
        self.check_bos_errors(bos_errors, from_position)
        model_dtype = next(self.model.parameters()).dtype
        wanted = dtype_for(model_dtype, compute_dtype)
        with precision(self.device, model_dtype, wanted):
            run = replacement_forward(self.bound, self.transcoder, input_ids,
                                      freeze=freeze, from_position=from_position, states=states,
                                      lorsa=self.lorsa)
        run.bos_errors, run.compute_dtype = bos_errors, wanted
        return run

    def check_bos_errors(self, bos_errors: str, from_position: int | None = None) -> None:
        """Refuse ``bos_errors="drop"`` where position 0 is spliced (not BOS)."""
        if bos_errors != "drop" or (self.from_position if from_position is None
                                    else from_position) > 0:
            return
        adds = "a" if tokenizer_adds_bos(self.tokenizer) else "no"
        raise InputError(
            "bos_errors='drop' makes position 0's errors constants, as circuit-tracer does for "
            f"its BOS; here position 0 is a real token, spliced like any other (bos={self.bos!r}"
            f", the tokenizer adds {adds} BOS), so its errors are what the transcoder misses "
            "of it: pass bos='always' with it for circuit-tracer's convention (position 0 "
            "treated as BOS whatever the tokenizer does)")

    def fingerprints(self) -> dict[str, str]:
        """The model's and the transcoder's weight fingerprints."""
        out = {"model": self.bound.fingerprint,
               "transcoder": transcoder_fingerprint(self.transcoder)}
        if self.lorsa is not None:
            out["lorsa"] = lorsa_fingerprint(self.lorsa)
        return out

    def describe(self, input_ids: torch.Tensor | None = None) -> dict:
        """What a graph's metadata says about the model, the transcoder and position 0 (of
        ``input_ids [1, P]``, when given)."""
        first = None if input_ids is None else self.tokenizer.decode([int(input_ids[0, 0])])
        return {"model": model_name(self.model),
                "clt": self.transcoder.source or self.transcoder.cfg.model_name,
                "transcoder": transcoder_metadata(self.transcoder),
                "bos": bos_metadata(self.tokenizer, self.bos, first)}


def transcoder_metadata(transcoder: Transcoder) -> dict:
    """What a graph's reader needs to know about the transcoder it was built with."""
    cfg = transcoder.cfg
    return {"source": transcoder.source, "model_name": cfg.model_name,
            "kind": cfg.model_kind, "activation": cfg.activation, "k": cfg.k, "skip": cfg.skip,
            "d_transcoder": cfg.d_transcoder, "scan": cfg.scan,
            "feature_input_hook": cfg.feature_input_hook,
            "feature_output_hook": cfg.feature_output_hook}
