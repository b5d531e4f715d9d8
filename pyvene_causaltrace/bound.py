"""A model bound once: what every method needs to know about it, learnt at the API boundary.

    bound = bind(model)               # done for you by trace(), attribute(), run_spec(), ...
    bound.n_layers, bound.d_model     # from the architecture's config keys
    bound.site("mlp_output", 3)       # "model.layers[3].mlp.output"
    bound.module("mlp", 3)            # the module itself
    bound.check_inputs(ids, answer)   # token ids the model can read
    bound.check_weights()             # no NaN/inf in its weights (scanned again only if written)

:func:`bind` is the one place that resolves a model's architecture (its row of
:data:`~pyvene_causaltrace.models.ADAPTERS`), and :class:`BoundModel` the one reader of the
model's config, through the keys the row names (``tests/test_adapter_table.py``); every
function below the public API takes the :class:`BoundModel` and asks it. Public functions take a
plain model or a bound one (``bind`` of a bound model is itself), so a call binds once however
deep it goes (``tests/test_bound_model.py`` counts it). A ``pv.IntervenableModel`` is bound
only by the calls that apply its interventions (:func:`bind`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .applier import Site
from .errors import InputError, PyveneModelError
from .fingerprint import model_fingerprint
from .finite import check_weights, weights_stamp
from .hooking import thread_view
from .models import get_adapter, get_module, is_intervenable, model_name

__all__ = ["BoundModel", "bind"]


class BoundModel:
    """A causal LM with its architecture resolved and its dimensions read, once.

    ``model``: the ``nn.Module`` that holds the weights. ``adapter``: its row of the
    adapter table. ``n_layers``, ``d_model``, ``n_heads``, ``head_dim``, ``kv_width`` (keys'
    width per position, all heads), ``d_mlp``, ``vocab_size``, ``max_positions`` (None when the
    config does not say), ``logit_softcap`` (None without one): read from the config once,
    under the keys the adapter names.
    ``given``: what the caller passed — ``model`` itself, or the ``pv.IntervenableModel``
    wrapping it, whose interventions then act on every forward of a measurement
    (:func:`~.model_guard.measurement`, the only place that applies them) and nowhere else.
    """

    def __init__(self, model: nn.Module, given: nn.Module | None = None) -> None:
        if not hasattr(model, "config"):
            raise InputError(
                f"expected a transformers causal LM as the model (a module with .config), got "
                f"{type(model).__name__}: the model comes first, then the transcoder "
                "(attribute(model, tokenizer, transcoder, ...), check_pairing(model, tokenizer, "
                "transcoder, texts))")
        self.model = model
        self.given = model if given is None else given
        self.applying = 0  # measurements of this bound model open now (nested: one thread)
        self.adapter = adapter = get_adapter(model)
        key = functools.partial(getattr, model.config)  # the adapter's keys: only here
        self.model_type: str = adapter.model_type
        self.n_layers = int(key(adapter.n_layers_key))
        self.d_model = int(key(adapter.hidden_key))
        self.n_heads = int(key(adapter.heads_key))
        self.head_dim = int(key(adapter.head_dim_key, None) or self.d_model // self.n_heads)
        self.kv_width = int(key(adapter.kv_heads_key, None) or self.n_heads) * self.head_dim
        self.d_mlp = int(key(adapter.mlp_key, None) or 4 * self.d_model)
        self.vocab_size = int(key(adapter.vocab_key))
        positions = key(adapter.positions_key, None)
        self.max_positions: int | None = positions if isinstance(positions, int) \
            and not isinstance(positions, bool) and positions > 0 else None
        cap = key(adapter.softcap_key, None) if adapter.softcap_key else None
        self.logit_softcap: float | None = float(cap) if cap else None
        self._finite_stamp: tuple | None = None  # the weights as they were when last checked

    def __repr__(self) -> str:
        return (f"BoundModel({self.model_type}, {self.n_layers} layers, d_model "
                f"{self.d_model}, {self.name or 'unnamed'})")

    # -- what the model is
    @property
    def name(self) -> str:
        """What results and specs name the model by (:func:`~.models.model_name`)."""
        return model_name(self.model)

    @functools.cached_property
    def fingerprint(self) -> str:
        """The weights' fingerprint (:func:`~.fingerprint.model_fingerprint`), computed on first
        use: a bound model lives for one call, during which the weights do not change."""
        return model_fingerprint(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def element_size(self) -> int:
        """Bytes per weight element (the model's first parameter's dtype)."""
        return next(self.model.parameters()).element_size()

    @property
    def config(self) -> Any:
        return self.model.config

    @functools.cached_property
    def decoder_config(self) -> Any:
        """The transformers config of the module that holds the blocks (what its forward builds
        a key/value cache from), whatever the top-level config's keys are called."""
        path = self.adapter.blocks.rpartition(".")[0]
        return getattr(get_module(self.model, path) if path else self.model, "config",
                       self.config)

    @contextlib.contextmanager
    def pre_softcap(self) -> Iterator[float | None]:
        """Inside the block the model returns its logits before the final soft-cap, which are
        linear in the residual stream; yields the cap (None without one). The cap is off for
        this thread alone (:func:`~.hooking.thread_view`)."""
        if self.logit_softcap is None:
            yield None
            return
        with thread_view(self.config, **{self.adapter.softcap_key: None}):
            yield self.logit_softcap

    # -- where its parts are
    def site(self, name: str, layer: int | None = None) -> str:
        """The pyvene component of site ``name`` at ``layer`` (:meth:`.ArchAdapter.site`)."""
        return self.adapter.site(name, layer)

    def module_path(self, part: str, layer: int | None = None) -> str:
        return self.adapter.module_path(part, layer)

    def module(self, part: str, layer: int | None = None) -> nn.Module:
        """The module of adapter part ``part`` (``block``, ``mlp``, ``embed``, ...) at
        ``layer``."""
        return get_module(self.model, self.adapter.module_path(part, layer))

    @functools.cached_property
    def blocks(self) -> list[nn.Module]:
        """Every block (transformer layer), in order."""
        return [self.module("block", layer) for layer in range(self.n_layers)]

    @functools.cached_property
    def stream_inputs(self) -> frozenset[int]:
        """Ids of the modules whose input is the residual stream itself (every block's
        ``pre_attn_norm`` and ``pre_mlp_norm``: the sites ``resid_pre`` and ``resid_mid``),
        which the block's residual add also reads (:mod:`.applier`'s rule)."""
        return frozenset(id(self.module(part, layer)) for layer in range(self.n_layers)
                         for part in ("pre_attn_norm", "pre_mlp_norm"))

    def site_of(self, component: str) -> Site:
        """The :class:`~.applier.Site` of a pyvene component (``"<module path>.output"`` or
        ``".input"``)."""
        path, _, where = component.rpartition(".")
        if where not in ("output", "input") or not path:
            raise InputError(f"component {component!r}: expected '<module path>.output' or "
                             "'<module path>.input'")
        module = get_module(self.model, path)
        return Site(module, where, where == "input" and id(module) in self.stream_inputs)

    def at(self, part: str, layer: int | None = None, where: str = "output") -> Site:
        """The :class:`~.applier.Site` of adapter part ``part``'s output (or input)."""
        module = self.module(part, layer)
        return Site(module, where, where == "input" and id(module) in self.stream_inputs)

    def carrying(self, given: nn.Module) -> BoundModel:
        """This bound model as if bound from ``given`` (its model, or a ``pv.IntervenableModel``
        wrapping it): nothing is resolved or read again."""
        twin = copy.copy(self)
        twin.given, twin.applying = given, 0
        return twin

    @property
    def carries_interventions(self) -> bool:
        """Bound from a ``pv.IntervenableModel``: its interventions act in measurements."""
        return self.given is not self.model

    # -- what it can read
    def check_weights(self) -> None:
        """Refuse weights with NaN or inf (:func:`~.finite.check_weights`, naming the tensor).
        Weights that passed and have not been written since (same storage, same version
        counters) are not scanned again: a dataset run checks once for every fact. The stamp
        lives on this object, not on the user's model."""
        stamp = weights_stamp(self.model)
        if stamp != self._finite_stamp:
            check_weights(self.model)
            self._finite_stamp = stamp

    def check_inputs(self, input_ids: torch.Tensor, answer_id: int | None = None) -> None:
        """Refuse token ids the model cannot read: a prompt longer than an absolute position
        table (GPT-2's), ids outside the embedding (a tokenizer that is not the model's), an
        answer outside the output vocabulary. A prompt longer than a rotary model's
        ``max_position_embeddings`` only warns: it runs, on positions it was not trained on."""
        n = int(input_ids.shape[-1])
        limit = self.max_positions
        if limit and n > limit:
            if self.adapter.position_embed is not None:
                raise InputError(f"the prompt is {n} tokens; {self.model_type} has a table "
                                 f"of {limit} positions")
            warnings.warn(f"the prompt is {n} tokens, beyond the {limit} positions "
                          f"{self.model_type} was trained on", stacklevel=2)
        vocab = self.model.get_input_embeddings().num_embeddings
        if n and int(input_ids.max()) >= vocab:
            raise InputError(f"token id {int(input_ids.max())} is outside the model's "
                             f"vocabulary of {vocab}: the tokenizer is not this model's")
        if answer_id is not None:
            self.check_answer(answer_id)

    def check_answer(self, answer_id: int) -> None:
        """Refuse an answer token outside the output vocabulary (a tokenizer that is not the
        model's); for an answer known only after the prompt was checked."""
        outputs = self.model.get_output_embeddings()
        size = outputs.out_features if outputs is not None \
            else self.model.get_input_embeddings().num_embeddings
        if not 0 <= answer_id < size:
            raise InputError(f"the answer's token id {answer_id} is outside the model's "
                             f"vocabulary of {size}: the tokenizer is not this model's")

    def check_generation_length(self, n_prompt: int, max_new_tokens: int,
                                what: str = "max_new_tokens") -> None:
        """Refuse, before any forward, a generation that would pass the model's positions: a
        position table has no row for them, and a rotary model was never trained on them
        (and each step of a generation without a key-value cache reruns the whole sequence,
        so an absurd count would run for days). No new tokens: nothing to check."""
        limit = self.max_positions
        if max_new_tokens > 0 and limit is not None and n_prompt + max_new_tokens > limit:
            raise InputError(f"{what}={max_new_tokens}: the prompt ({n_prompt} tokens) and the "
                             f"new tokens pass {self.model_type}'s {limit} positions "
                             f"({self.adapter.positions_key}); at most "
                             f"{max(0, limit - n_prompt)} new tokens fit")


def bind(model: nn.Module | BoundModel, *, interventions: bool = False) -> BoundModel:
    """``model`` bound (:class:`BoundModel`); a bound model is returned as it is.

    The only place that resolves an architecture: an unsupported one raises
    ``UnsupportedModelError`` naming the supported ones. A pyvene ``IntervenableModel`` is
    bound (the model it wraps, its interventions carried in ``given``) only by the public calls
    that apply them (``interventions=True``: :class:`~.tracing.Tracer`, ``attribute``,
    ``run_spec``); anywhere else it raises ``PyveneModelError``, and so does a bound model that
    carries interventions outside one of its measurements (it would run without them)."""
    if isinstance(model, BoundModel):
        if model.carries_interventions and not (interventions or model.applying):
            raise PyveneModelError(
                "this bound model carries a pv.IntervenableModel's interventions, which act "
                "only inside the calls that apply them (Tracer/trace, attribute, run_spec): "
                "pass it to one of those, or bind pv_model.model for a run without them")
        return model
    if interventions and is_intervenable(model):
        return BoundModel(model.model, given=model)
    return BoundModel(model)
