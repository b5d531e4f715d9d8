"""A random-init model of a real shape with a random CLT of the real shape, for timings where
the real weights cannot travel (the GPU machine): Llama-3.2-1B's config with a CLT of
16 x 32,768 features (mntss/clt-llama-3.2-1b-524k's shape), thresholds set so that about
``features_per_position`` features fire per position and layer.

The 18 GB decoder is never materialised: :class:`RepeatingDecoder` serves row ``f`` from a bank
of 1,024 random rows (``f mod 1024``), so gathering the rows of the features that fired — all an
attribution graph reads — costs what it costs with a real decoder.
"""

from __future__ import annotations

import torch

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                    max_position_embeddings=4096)
SHAPES = {
    "llama1b": (LLAMA_3_2_1B, 32768),
    "tiny": (dict(vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16), 512),
}
BANK = 1024


class RepeatingDecoder:
    """Stands in for ``W_dec[l]`` ``[F, L - l, D]``: row ``f`` is ``bank[f % BANK]``."""

    def __init__(self, n_features: int, n_targets: int, d_model: int, device, seed: int):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.bank = (torch.randn(BANK, n_targets, d_model, generator=g) * 0.02).to(device)
        self.shape = (n_features, n_targets, d_model)
        self.device = self.bank.device
        self.dtype = self.bank.dtype

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        return self.bank.index_select(0, ids.to(self.device) % BANK)

    # what the transcoder's fingerprint (pyvene_causaltrace.fingerprint) reads: the bank's values
    def detach(self) -> RepeatingDecoder:
        return self

    def reshape(self, *shape) -> torch.Tensor:
        return self.bank.reshape(*shape)


def known_facts_tokenizer():
    """A byte-level BPE tokenizer (8,000 pieces, ``<bos>``) trained on known_1000's facts: real
    subword splits for random-init models, no download."""
    import json
    from pathlib import Path

    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(__file__).resolve().parents[1]
    known = next(p for p in (root.parent / "shared" / "data" / "known_1000.json",
                             root / ".devdata" / "known_1000.json") if p.exists())
    texts = [f"{r['prompt']} {r['attribute']}" for r in json.loads(known.read_text())]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>")


def synthetic_clt_for(model, tokenizer, n_features: int, features_per_position: float,
                      calibration: str, device: str = "cpu", source: str | None = None):
    """A random CLT of ``n_features`` per layer for ``model``'s shape (float32), thresholds per
    layer set so that ``features_per_position`` features fire per position on ``calibration``
    (positions >= 1; other texts fire about as many)."""
    from pyvene_causaltrace.bound import bind
    from pyvene_causaltrace.transcoders.checks import hook_states
    from pyvene_causaltrace.transcoders.transcoder import Transcoder

    bound = bind(model)
    n_layers, d_model = bound.n_layers, bound.d_model
    g = torch.Generator(device=device).manual_seed(1)
    W_enc = torch.randn(n_layers, n_features, d_model, generator=g, device=device)
    W_enc /= d_model**0.5
    b_enc = torch.zeros(n_layers, n_features, device=device)
    ids = tokenizer(calibration, return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        mid = hook_states(model, ids, {"mid": "hook_resid_mid"})["mid"]  # [L, P, D]
        # per layer: the value exceeded by features_per_position x (P - 1) pre-activations
        # over positions 1.. (position 0 is zeroed anyway)
        count = max(1, int(round(features_per_position * (mid.shape[1] - 1))))
        threshold = torch.stack([
            (mid[layer, 1:].float() @ W_enc[layer].T).flatten().topk(count + 1).values[-1]
            .expand(n_features) for layer in range(n_layers)])
    W_dec = [RepeatingDecoder(n_features, n_layers - layer, d_model, device, seed=layer)
             for layer in range(n_layers)]
    name = source or getattr(model, "pvct_source", None) or model.config._name_or_path
    return Transcoder.from_tensors(
        name, W_enc, b_enc, threshold, torch.zeros(n_layers, d_model), W_dec, device=device)


def synthetic_model_and_clt(shape: str, device: str = "cpu", features_per_position: float = 12.0,
                            calibration: str = "The Eiffel Tower is in the city of"):
    """``(model, tokenizer, clt)``: float32 random-init model and CLT of ``shape``'s sizes."""
    import transformers as tf

    config_kwargs, n_features = SHAPES[shape]
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config_kwargs)).to(device).eval()
    model.pvct_source = f"random-init {shape}"
    tokenizer = known_facts_tokenizer()
    clt = synthetic_clt_for(model, tokenizer, n_features, features_per_position, calibration,
                            device)
    return model, tokenizer, clt
