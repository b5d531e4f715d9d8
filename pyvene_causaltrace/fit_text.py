"""The first transcoder's text (:mod:`.fitting`): the model's own generations kept as token ids,
and the MLP pairs of any layers read back from them by batched forwards.

    ids = generate_ids(bound, tokenizer, 4096, 48, seed=0)      # sampled in left-padded batches
    x, y = read_pairs(bound, ids[:4000], range(0, 6))           # [tokens, 6, D] each

Token ids are small (a text of 50 tokens: 50 integers, against 50 x 30 layers x 576 x 2 numbers
of pairs), so a fit keeps the ids and reads one group of layers' pairs at a time: memory is one
group's pairs, whatever the number of texts. A forward over whole texts is cheaper than the
generation's one token a step, and stops after the group's last layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tqdm import tqdm

from .applier import Edit, Site, applying
from .bound import BoundModel
from .models import get_module
from .transcoders.hooks import hook_component, keeping_states

#: Where the model's own text starts: generic openings of encyclopedic sentences.
STARTS = (
    "The city of", "The capital of", "The river", "The museum", "The famous", "He was born in",
    "She is a", "The company", "The language of", "The team", "In 1990,", "The mountain",
    "The university", "The album", "The tower", "The bridge", "The president of", "The church",
    "The island of", "The film", "The author", "The novel", "The airport", "The country",
    "The song", "The street", "The station", "The painter", "The king of", "The football club",
    "The lake", "The castle",
)
#: Texts generated together (one batch of the model's forwards per new token).
GENERATION_BATCH = 128
#: Tokens a forward that reads pairs takes at once (whole texts, padded on the right).
PAIR_BATCH_TOKENS = 4096
#: How pairs are held: half float32's memory, float32's range (SmolLM2's first position reaches
#: ~2e4, a third of float16's largest), and an error (2**-9 relative) far below any fit's.
GENERATED_PAIRS = torch.bfloat16


class _Stop(Exception):
    """Raised after a group's last layer: the rest of the forward is not needed."""


def generate_ids(bound: BoundModel, tokenizer, n: int, new_tokens: int, seed: int, *,
                 first: int = 0, keep: Sequence[int] = (), record: int = 0,
                 dtype: torch.dtype = GENERATED_PAIRS, progress: bool = False,
                 batch: int | None = None):
    """``(ids, x, y)``: the token ids of ``n`` texts the model writes itself — :data:`STARTS` in
    turn, each continued by ``new_tokens`` sampled tokens (temperature 1, no top-k, seeded, the
    caller's random state kept), without padding — and the pairs at layers ``keep`` of the
    first ``record`` texts read from the generation's own forwards, as :func:`read_pairs` gives
    them (``None`` without ``keep``). Up to ``batch`` (:data:`GENERATION_BATCH`) texts are
    sampled together, shorter starts padded on the left (masked; positions count from each
    text's first token), through the KV cache."""
    batch = batch or GENERATION_BATCH
    keep = sorted(keep)
    starts = [tokenizer(STARTS[i % len(STARTS)])["input_ids"] for i in range(n)]
    pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    x = y = None
    if keep:
        total = sum(len(s) + new_tokens - 1 - first for s in starts[:record])
        x = torch.empty(total, len(keep), bound.d_model, dtype=dtype, device=bound.device)
        y = torch.empty_like(x)
    out: list[list[int]] = []
    at = 0
    size = math.ceil(n / math.ceil(n / batch)) if n else 1  # batches as even as they can be
    hooks = {"x": "hook_resid_mid", "y": "hook_mlp_out"} if keep else {}
    with torch.random.fork_rng(devices=[]), torch.no_grad(), \
            keeping_states(bound, hooks, dtype, keep) as take, \
            tqdm(total=n, desc="generating text", unit="text", disable=not progress) as bar:
        torch.manual_seed(seed)
        for begin in range(0, n, size):
            chunk = starts[begin:begin + size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(s)) + s for s in chunk], device=bound.device)
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in chunk],
                                device=bound.device)
            made = bound.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
            pairs = take()
            for row, (tokens, start) in enumerate(zip(made.tolist(), chunk, strict=True)):
                out.append(start + tokens[width:])
                if keep and begin + row < record:
                    offset = width - len(start) + first
                    n_kept = len(start) + new_tokens - 1 - first
                    if pairs["x"].shape[1] - offset != n_kept:
                        raise RuntimeError(f"the generation's forwards read "
                                           f"{pairs['x'].shape[1]} positions of a text of "
                                           f"{made.shape[1]} tokens")
                    x[at:at + n_kept] = pairs["x"][row, offset:]
                    y[at:at + n_kept] = pairs["y"][row, offset:]
                    at += n_kept
            del pairs
            bar.update(len(chunk))
    return out, x, y


def read_pairs(bound: BoundModel, ids: Sequence[Sequence[int]], layers: Sequence[int], *,
               first: int, dtype: torch.dtype = GENERATED_PAIRS, progress: bool = False,
               batch_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``hook_resid_mid`` and ``hook_mlp_out`` at ``layers`` for every text of
    ``ids``, ``[tokens, len(layers), D]`` in ``dtype``, texts in order, at every position from
    ``first`` (1 past a BOS, :func:`~.prompts.first_position`) but each text's last token (the
    generation's forwards never read it), as a forward of each text alone gives them. Texts run
    together up to ``batch_tokens`` (:data:`PAIR_BATCH_TOKENS`) tokens a forward, padded on the
    right (a causal model's earlier positions do not see it), each forward stopped after the
    last layer asked for."""
    layers = sorted(layers)
    batch_tokens = batch_tokens or PAIR_BATCH_TOKENS
    total = sum(len(row) - 1 - first for row in ids)
    x = torch.empty(total, len(layers), bound.d_model, dtype=dtype, device=bound.device)
    y = torch.empty_like(x)
    path, _, where = hook_component(bound.adapter, "hook_mlp_out", layers[-1]).rpartition(".")

    def stop(_value, _call):
        raise _Stop

    at = begin = 0
    with torch.no_grad(), keeping_states(bound, {"x": "hook_resid_mid", "y": "hook_mlp_out"},
                                         dtype, layers) as take, \
            applying(bound.model, [Edit(Site(get_module(bound.model, path), where), stop,
                                        last=True)]), \
            tqdm(total=len(ids), desc="reading pairs", unit="text", disable=not progress) as bar:
        while begin < len(ids):
            rows = [list(ids[begin][:-1])]
            while begin + len(rows) < len(ids) and (len(rows) + 1) * max(
                    max(map(len, rows)), len(ids[begin + len(rows)]) - 1) <= batch_tokens:
                rows.append(list(ids[begin + len(rows)][:-1]))
            width = max(map(len, rows))
            tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=bound.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows],
                                device=bound.device)
            try:
                bound.model(input_ids=tokens, attention_mask=mask, use_cache=False)
            except _Stop:
                pass
            pairs = take()
            for row, r in enumerate(rows):
                n = len(r) - first
                x[at:at + n] = pairs["x"][row, first:len(r)]
                y[at:at + n] = pairs["y"][row, first:len(r)]
                at += n
            bar.update(len(rows))
            begin += len(rows)
    return x, y
