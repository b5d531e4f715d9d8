"""Tiny random-init causal LMs of every supported architecture, the small BPE tokenizer that
goes with them, and a few seconds of training for the tests that need MLPs that matter."""

from __future__ import annotations

import torch

CORE_ARCHS = ("gpt2", "llama", "qwen2", "qwen3")
ALL_ARCHS = CORE_ARCHS + ("mistral", "gemma2", "gemma3_text")

PROMPT = "The Eiffel Tower is in the city of"
SUBJECT = "The Eiffel Tower"

#: What the tiny tokenizer is trained on (tests_peer's tokenizer too).
CORPUS = [
    PROMPT, "The Space Needle is in the city of Seattle", "Paris is the capital of France",
    "Miles Davis plays the trumpet", "The keys to the cabinet are on the table",
    "Two plus three is five and five plus four is nine", "Danielle Darrieux speaks French",
    "The mother tongue of Danielle Darrieux is French", "Toko Yasuda plays the guitar",
] * 4


def make_tokenizer(corpus: list[str] = CORPUS, vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on ``corpus``: real subword splits and character
    offsets, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>")


def make_tiny_model(arch: str, vocab_size: int = 420, n_layers: int = 3, seed: int = 0,
                    init: float = 0.02):
    """A random-init causal LM of architecture ``arch`` (float32, eval mode). ``init`` is the
    weights' std: 0.2 gives MLPs whose outputs matter to the logits (the CLT tests need that)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256, initializer_range=init)
    if arch == "gpt2":
        config = tf.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=n_layers, n_head=4,
                               n_positions=256, bos_token_id=0, eos_token_id=0,
                               initializer_range=init)
    else:
        config_class = {
            "llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
            "mistral": tf.MistralConfig, "gemma2": tf.Gemma2Config,
            "gemma3_text": tf.Gemma3TextConfig,
        }[arch]
        config = config_class(**common)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if arch.startswith("gemma"):  # zero-init norm weights would hide norm bugs
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    return model


def train_tiny_lm(model, tokenizer, texts, steps: int = 300, lr: float = 3e-3, seed: int = 0):
    """A few seconds of next-token training, so that the tiny model's MLPs matter to its loss
    (random weights have no language-modelling loss worth anchoring a CLT to)."""
    g = torch.Generator().manual_seed(seed)
    encoded = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [encoded[i] for i in torch.randint(0, len(encoded), (16,), generator=g)]
        n = min(len(b) for b in batch)
        ids = torch.stack([b[:n] for b in batch])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def prompt_ids(tokenizer, text: str = PROMPT) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]
