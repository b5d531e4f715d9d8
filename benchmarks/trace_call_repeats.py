"""Seconds of many public ``trace()`` calls in one process, on a random 8-layer Llama (hidden
64), for comparing two checkouts call for call (run it once per tree, alternating):

    python benchmarks/trace_call_repeats.py /path/to/checkout 40

Prints the tree, the median and the minimum seconds of the timed calls (after one warm-up).
"""

from __future__ import annotations

import statistics
import sys
import time


def main() -> None:
    tree, repeats = sys.argv[1], int(sys.argv[2])
    sys.path[:0] = [tree, tree + "/tests"]
    import torch
    import transformers as tf
    from _support.models import make_tokenizer

    import pyvene_causaltrace as pvct

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256,
                            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256)
    model, tokenizer = tf.AutoModelForCausalLM.from_config(config).eval(), make_tokenizer()

    def call():
        pvct.trace(model, tokenizer, "The Eiffel Tower is in the city of", "The Eiffel Tower",
                   seeds=10, progress=False)

    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    print(tree, f"{statistics.median(seconds):.4f}", f"{min(seconds):.4f}")


if __name__ == "__main__":
    main()
