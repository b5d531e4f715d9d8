"""The bound object attribution runs on: a model with its tokenizer and transcoder, checked once.

:class:`ReplacementModel` checks, when it is made, what every later step relies on — the
transcoder fits the model (:func:`~..transcoders.transcoder.check_fits`), the weights are
finite (:func:`~..finite.check_weights`) — looks up the architecture adapter and the device,
and carries them to each phase of :func:`~.attribute.attribute`:

    replacement = ReplacementModel(model, tokenizer, transcoder)
    prompt = replacement.prepare("The Eiffel Tower is in the city of", " Paris")
    replacement.check_memory(prompt.input_ids, memory_mb=4096)
    run = replacement.run(prompt.input_ids)      # the local replacement model's forward

``model`` is a plain model: :func:`~.attribute.attribute` takes a pyvene ``IntervenableModel``
too, and binds the model it wraps inside the block where its interventions are applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..fingerprint import model_fingerprint, transcoder_fingerprint
from ..finite import check_finite, check_weights
from ..models import check_inputs, get_adapter, model_name
from ..transcoders.transcoder import Transcoder, check_fits
from .budget import active_counts, check_forward_fits
from .replacement import ReplacementRun, check_batch, pre_softcap_logits, replacement_forward
from .targets import Target, make_target

if TYPE_CHECKING:  # transformers takes seconds to import; only the annotations need it
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PreparedPrompt:
    """A tokenized prompt, the clean model's logits on it and the target they fix.

    ``logits`` are the real model's (soft-capped, if it caps); ``target_logits`` are what the
    graph explains: the pre-cap logits (the same tensor without a cap, ``softcap`` None)."""

    text: str
    input_ids: torch.Tensor  # [1, P], on the model's device
    logits: torch.Tensor
    target_logits: torch.Tensor
    softcap: float | None
    target: Target


class ReplacementModel:
    """``model`` bound to its ``tokenizer`` and ``transcoder`` (module docstring).

    Raises :class:`~..errors.TranscoderMismatchError` for a transcoder that does not fit the
    model, :class:`~..errors.NonFiniteError` for weights with NaN/inf, and
    :class:`~..errors.UnsupportedModelError` for an architecture without an adapter."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                 transcoder: Transcoder) -> None:
        check_fits(transcoder, model)
        check_weights(model)
        self.model = model
        self.tokenizer = tokenizer
        self.transcoder = transcoder
        self.adapter = get_adapter(model)
        self.device = next(model.parameters()).device

    def tokenize(self, prompt: str) -> torch.Tensor:
        """``[1, P]`` token ids of ``prompt`` on the model's device, checked readable."""
        ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"].to(self.device)
        check_inputs(self.model, ids)
        return ids

    def prepare(self, prompt: str, answer: str | None = None, *, target: str = "demeaned",
                other: str | None = None, k: int = 10) -> PreparedPrompt:
        """Tokenize ``prompt``, run the clean model and fix the target
        (:func:`~.targets.make_target`; no ``answer``: the clean argmax)."""
        ids = self.tokenize(prompt)
        with torch.no_grad():
            clean = self.model(input_ids=ids).logits
            with pre_softcap_logits(self.model) as cap:
                uncapped = clean if cap is None else self.model(input_ids=ids).logits
        check_finite(clean, "the clean run's logits",
                     "the weights are finite, so the activations overflow")
        goal = make_target(uncapped, self.tokenizer, answer, kind=target, other=other, k=k)
        check_inputs(self.model, ids, goal.token)
        return PreparedPrompt(prompt, ids, clean, uncapped, cap, goal)

    def check_memory(self, input_ids: torch.Tensor, memory_mb: float) -> int:
        """Raise :class:`~.budget.MemoryCapError` unless the local replacement forward on
        ``input_ids`` fits ``memory_mb``; returns its estimated bytes."""
        counts = active_counts(self.model, self.transcoder, input_ids)
        return check_forward_fits(self.model, self.transcoder, input_ids, memory_mb, counts)

    def run(self, input_ids: torch.Tensor, *, freeze: bool = True,
            from_position: int = 1) -> ReplacementRun:
        """One forward of the local replacement model
        (:func:`~.replacement.run_local_replacement`, without checking the fit again)."""
        check_batch(input_ids)
        return replacement_forward(self.model, self.transcoder, self.adapter, input_ids,
                                   freeze=freeze, from_position=from_position)

    def fingerprints(self) -> dict[str, str]:
        """The model's and the transcoder's weight fingerprints."""
        return {"model": model_fingerprint(self.model),
                "transcoder": transcoder_fingerprint(self.transcoder)}

    def describe(self) -> dict:
        """What a graph's metadata says about the model and the transcoder."""
        return {"model": model_name(self.model),
                "clt": self.transcoder.source or self.transcoder.cfg.model_name,
                "transcoder": transcoder_metadata(self.transcoder)}


def transcoder_metadata(transcoder: Transcoder) -> dict:
    """What a graph's reader needs to know about the transcoder it was built with."""
    cfg = transcoder.cfg
    return {"source": transcoder.source, "model_name": cfg.model_name,
            "kind": cfg.model_kind, "activation": cfg.activation, "k": cfg.k, "skip": cfg.skip,
            "d_transcoder": cfg.d_transcoder, "scan": cfg.scan,
            "feature_input_hook": cfg.feature_input_hook,
            "feature_output_hook": cfg.feature_output_hook}
