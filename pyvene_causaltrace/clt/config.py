"""The configuration of a cross-layer transcoder: what ``config.yaml`` and the tensor shapes say.

On disk (the ``mntss`` layout) ``config.yaml`` holds four keys — ``model_name``, ``model_kind:
cross_layer_transcoder``, ``feature_input_hook: hook_resid_mid``, ``feature_output_hook:
hook_mlp_out`` — and the widths come from the safetensors headers. The hook names are
TransformerLens names; :meth:`CLTConfig.hf_hooks` translates them into module paths of a
transformers model through its architecture adapter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: TransformerLens hook name -> (adapter part, pyvene hook suffix)
HOOKS = {
    "hook_resid_mid": ("pre_mlp_norm", "input"),  # residual after attention, before 2nd norm
    "hook_mlp_out": ("mlp", "output"),  # MLP output before the residual add
    "hook_resid_pre": ("pre_attn_norm", "input"),  # block input (the pairing check's control)
}
MODEL_KIND = "cross_layer_transcoder"
YAML_KEYS = ("model_name", "model_kind", "feature_input_hook", "feature_output_hook")


@dataclass(frozen=True)
class CLTConfig:
    """Shapes and metadata of a CLT. ``d_transcoder`` is features *per layer*; the total is
    ``n_layers * d_transcoder`` (mntss/clt-llama-3.2-1b-524k: 16 x 32768 = 524288)."""

    model_name: str
    n_layers: int
    d_model: int
    d_transcoder: int
    feature_input_hook: str = "hook_resid_mid"
    feature_output_hook: str = "hook_mlp_out"
    model_kind: str = MODEL_KIND
    disk_dtype: str = "float32"

    @property
    def n_features(self) -> int:
        return self.n_layers * self.d_transcoder

    def yaml_dict(self) -> dict[str, str]:
        """Exactly what ``config.yaml`` holds."""
        return {key: getattr(self, key) for key in YAML_KEYS}

    def to_dict(self) -> dict:
        return asdict(self)

    def hf_hooks(self, adapter, layer: int) -> dict[str, str]:
        """pyvene component strings of the input and output hooks at ``layer`` for a model
        with this architecture adapter."""
        out = {}
        for role, hook in (("input", self.feature_input_hook),
                           ("output", self.feature_output_hook)):
            if hook not in HOOKS:
                raise ValueError(f"unknown hook {hook!r}; known: {', '.join(HOOKS)}")
            part, kind = HOOKS[hook]
            out[role] = f"{adapter.module_path(part, layer)}.{kind}"
        return out
