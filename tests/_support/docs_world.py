"""A tiny stand-in for the docs' world: a 30-layer Llama trained a little on the facts the docs
use, with a byte-level BPE trained on the docs' own text (so " Paris" is one token, as in a
real vocabulary). Built once per run (:func:`stand_in`) and shared by test_docs.py and
test_first_graph_path.py, whichever xdist worker asks first."""

from __future__ import annotations

from _support.built import built_once
from _support.data import PROJECT_FACTS, ROOT
from _support.models import make_tiny_model, train_tiny_lm

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
N_LAYERS = 30  # the docs name layers up to 23
VOCAB = 2000


def docs_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # slow imports
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [line for page in PAGES for line in page.read_text().splitlines()]
    bpe.train_from_iterator(text + [PROJECT_FACTS.read_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>",
                                   eos_token="<bos>")


def docs_model(tokenizer, steps: int = 150):
    model = make_tiny_model("llama", vocab_size=VOCAB, n_layers=N_LAYERS, init=0.2)
    texts = ["The Eiffel Tower is in the city of Paris", "The Colosseum is in the city of Rome",
             "The Space Needle is in the city of Seattle"] * 20
    train_tiny_lm(model, tokenizer, texts, steps=steps)
    return model


def stand_in(tmp_path_factory):
    """``(model, tokenizer)``: the docs' stand-in, trained once per run and saved; each call
    loads a fresh copy (bit-identical weights in every worker)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # slow imports

    def build(folder):
        tokenizer = docs_tokenizer()
        docs_model(tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    folder = built_once(tmp_path_factory, "docs-stand-in", build)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(folder)
