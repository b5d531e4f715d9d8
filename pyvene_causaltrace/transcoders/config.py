"""What a transcoder is, apart from its weights: kind, shapes, activation, hooks.

Kinds: ``cross_layer_transcoder`` (CLT: layer ``l``'s features decode into every layer ``t >=
l``) and ``transcoder_set`` (per-layer: only into ``l``), either with an optional linear skip
``W_skip``. Activations: ``jumprelu`` (``z * 1[z > threshold]``), ``relu``, ``topk`` (the ``k``
largest pre-activations per token), ``relu_topk`` (the ``k`` largest of ``relu(z)``) and
``joint_topk`` (the ``k`` largest ``relu(z) * score_weight`` over every layer at once, kept as
``relu(z)``; ``k`` counts all layers). Hooks are TransformerLens names (:mod:`.hooks`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import InputError
from .hooks import INPUT_HOOKS, OUTPUT_HOOKS, hook_component, hook_name

CROSS_LAYER = "cross_layer_transcoder"
TRANSCODER_SET = "transcoder_set"
MODEL_KINDS = (CROSS_LAYER, TRANSCODER_SET)
ACTIVATIONS = ("jumprelu", "relu", "topk", "relu_topk", "joint_topk")
#: Activations whose selection at a layer needs every layer's pre-activations.
JOINT_ACTIVATIONS = ("joint_topk",)

#: What the mntss CLT layout's config.yaml holds.
YAML_KEYS = ("model_name", "model_kind", "feature_input_hook", "feature_output_hook")


@dataclass(frozen=True)
class TranscoderConfig:
    """Shapes and metadata of a transcoder. ``d_transcoder`` is features *per layer*; the total
    is ``n_layers * d_transcoder`` (mntss/clt-llama-3.2-1b-524k: 16 x 32768 = 524288).

    ``scan`` is the Neuronpedia name of the feature set (circuit-tracer's ``scan``, or a
    sae-lens release), so exported graphs link each feature to its page."""

    model_name: str
    n_layers: int
    d_model: int
    d_transcoder: int
    feature_input_hook: str = "hook_resid_mid"
    feature_output_hook: str = "hook_mlp_out"
    model_kind: str = CROSS_LAYER
    disk_dtype: str = "float32"
    activation: str = "jumprelu"
    k: int | None = None
    skip: bool = False
    scan: str | None = None

    def __post_init__(self) -> None:
        if self.model_kind not in MODEL_KINDS:
            raise InputError(f"model_kind must be one of {MODEL_KINDS}, got {self.model_kind!r}")
        if self.activation not in ACTIVATIONS:
            raise InputError(f"unknown activation {self.activation!r}; known: "
                             f"{', '.join(ACTIVATIONS)}")
        if self.activation.endswith("topk") and not (isinstance(self.k, int) and self.k >= 1):
            raise InputError(f"a topk transcoder needs an integer k >= 1, got {self.k!r}")
        if self.activation in JOINT_ACTIVATIONS and self.model_kind != CROSS_LAYER:
            raise InputError(f"{self.activation} selects over all layers of a cross-layer "
                             "transcoder; a per-layer set takes topk")
        for role, hook, allowed in (("input", self.feature_input_hook, INPUT_HOOKS),
                                    ("output", self.feature_output_hook, OUTPUT_HOOKS)):
            if hook_name(hook) not in allowed:
                raise InputError(f"unknown feature_{role}_hook {hook!r}; known: "
                                 f"{', '.join(allowed)}")

    @property
    def cross_layer(self) -> bool:
        return self.model_kind == CROSS_LAYER

    @property
    def joint(self) -> bool:
        """Whether a layer's features depend on every layer's pre-activations."""
        return self.activation in JOINT_ACTIVATIONS

    @property
    def n_features(self) -> int:
        return self.n_layers * self.d_transcoder

    def n_targets(self, layer: int) -> int:
        """How many layers layer ``layer``'s features write: ``L - layer`` or 1."""
        return self.n_layers - layer if self.cross_layer else 1

    def sources(self, layer: int) -> range:
        """The layers whose features write into ``layer``'s output."""
        return range(layer + 1) if self.cross_layer else range(layer, layer + 1)

    def yaml_dict(self) -> dict[str, str]:
        """Exactly what the mntss ``config.yaml`` holds."""
        return {key: getattr(self, key) for key in YAML_KEYS}

    def to_dict(self) -> dict:
        return asdict(self)

    def hf_hooks(self, adapter, layer: int) -> dict[str, str]:
        """pyvene component strings of the input and output hooks at ``layer`` for a model
        with this architecture adapter."""
        return {"input": hook_component(adapter, self.feature_input_hook, layer),
                "output": hook_component(adapter, self.feature_output_hook, layer)}
