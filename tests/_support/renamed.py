"""A new architecture made from the tiny Llama by renaming: every module the package could look
for and every config key it could read has another name, and the model type is new. Its one
adapter row, :data:`RENAMED_ROW`, is all the package is told (tests/test_adapter_table.py).

The weights and the computation are the tiny Llama's: Llama's own forward runs, reaching the
renamed submodules through read-only aliases on per-instance subclasses (an alias is a class
property, invisible to ``_modules``, so a path such as ``model.layers[0]`` resolves to nothing
here). The top-level config is a new class with the dimensions under new keys; the modules
inside keep Llama's config, as a model's own code may.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from pyvene_causaltrace.models import ArchAdapter

from .models import make_tiny_model

#: class name -> {Llama's attribute: the new one}
RENAMES = {
    "LlamaForCausalLM": {"model": "trunk", "lm_head": "readout"},
    "LlamaModel": {"embed_tokens": "wte", "layers": "stack", "norm": "ln_out",
                   "rotary_emb": "rope"},
    "LlamaDecoderLayer": {"self_attn": "mixer", "mlp": "ffn", "input_layernorm": "norm_a",
                          "post_attention_layernorm": "norm_b"},
    "LlamaAttention": {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"},
    "LlamaMLP": {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"},
}

RENAMED_ROW = ArchAdapter(
    model_type="renamed_lm", embed="trunk.wte", blocks="trunk.stack", attn="mixer", mlp="ffn",
    pre_attn_norm="norm_a", pre_mlp_norm="norm_b", final_norm="trunk.ln_out",
    unembed="readout", norm_kind="rms", attn_out="wo", n_layers_key="depth",
    hidden_key="width", positions_key="context", heads_key="query_heads",
    head_dim_key="head_width", kv_heads_key="kv_groups", mlp_key="ffn_width",
    vocab_key="n_tokens")


class RenamedConfig(PretrainedConfig):
    model_type = RENAMED_ROW.model_type


def _alias(name: str) -> property:
    return property(lambda self: self._modules[name])


def renamed_llama(**tiny) -> object:
    """:func:`~.models.make_tiny_model` ``("llama", **tiny)``, renamed (module docstring)."""
    model = make_tiny_model("llama", **tiny)
    for module in list(model.modules()):
        names = RENAMES.get(type(module).__name__)
        if names is None:
            continue
        base = type(module)
        module.__class__ = type(f"Renamed{base.__name__}", (base,), {
            "__module__": base.__module__,  # where its attention functions live
            **{old: _alias(new) for old, new in names.items()}})
        module._modules = {names.get(key, key): child for key, child in module._modules.items()}
    llama = model.config
    model.config = RenamedConfig(
        depth=llama.num_hidden_layers, width=llama.hidden_size,
        context=llama.max_position_embeddings,
        query_heads=llama.num_attention_heads, head_width=llama.head_dim,
        kv_groups=llama.num_key_value_heads, ffn_width=llama.intermediate_size,
        n_tokens=llama.vocab_size)
    return model
