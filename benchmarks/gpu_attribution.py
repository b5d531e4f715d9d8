"""Attribution rows on the GPU at Llama-3.2-1B's and Qwen3-8B's shapes: ``attribution_speed.py``
(ours beside circuit-tracer's replicated forward, ms per row and peak memory, each method in a
fresh process) with two changes made here, so that file stays as it is:

- the random model is initialised on the device (an 8B model's float32 initialisation on the
  CPU takes minutes);
- a ``qwen3_8b`` shape: Qwen3-8B's sizes (36 layers, hidden 4,096, MLP 12,288, 32 query and 8
  key-value heads of 128, vocabulary 151,936) built as a Llama (no q/k norms: the timings are
  the sizes'), with a random CLT of ``PVCT_CLT_FEATURES`` features per layer (default 8,192; a
  published width would be larger, but the active features, not the width, set a row's cost:
  the decoder is a bank of ``PVCT_CLT_BANK`` repeating rows, default 256 for this shape).

    python benchmarks/gpu_attribution.py --synthetic qwen3_8b --device cuda \
        --features-per-position 50 --prompts p64 --batches 512 --memory-caps "" --skip-loop \
        --replicated 4 --rows 7500 --out attribution_qwen.json
    python benchmarks/gpu_attribution.py --synthetic tiny --device cpu ...   # a smoke run

Arguments are ``attribution_speed.py``'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).parent))
import attribution_speed  # noqa: E402
import synthetic_clt  # noqa: E402

QWEN3_8B_AS_LLAMA = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False,
                         max_position_embeddings=4096)
synthetic_clt.SHAPES["qwen3_8b"] = (QWEN3_8B_AS_LLAMA,
                                    int(os.environ.get("PVCT_CLT_FEATURES", "8192")))
if "qwen3_8b" in sys.argv:  # a bank of [BANK, L - l, 4096] per layer: 2.8 GB at 256 rows
    synthetic_clt.BANK = int(os.environ.get("PVCT_CLT_BANK", "256"))


def synthetic_model_and_clt(shape: str, device: str = "cpu", features_per_position: float = 12.0,
                            calibration: str = "The Eiffel Tower is in the city of"):
    """``synthetic_clt.synthetic_model_and_clt``, the model initialised on ``device``."""
    config_kwargs, n_features = synthetic_clt.SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**config_kwargs)).eval()
    model.pvct_source = f"random-init {shape}"
    tokenizer = synthetic_clt.known_facts_tokenizer()
    clt = synthetic_clt.synthetic_clt_for(model, tokenizer, n_features, features_per_position,
                                          calibration, device)
    return model, tokenizer, clt


synthetic_clt.synthetic_model_and_clt = synthetic_model_and_clt
attribution_speed.__file__ = str(Path(__file__).resolve())  # its methods run as this script

if __name__ == "__main__":
    attribution_speed.main()
