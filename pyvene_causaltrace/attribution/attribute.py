"""``attribute``: prompt + answer -> :class:`~.graph.AttributionGraph`.

Steps: tokenize; run the local replacement model once (:mod:`.replacement`); the target row by
one backward and its closure check; every feature row in batches of gradient seeds sized to the
memory cap (:mod:`.edges`); package the graph.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ..clt.transcoder import CrossLayerTranscoder
from ..prompts import answer_token_id
from .edges import (
    batch_size_for,
    batches,
    feature_rows,
    feature_rows_loop,
    feature_targets,
    n_batches,
    target_row,
)
from .graph import AttributionGraph
from .replacement import run_local_replacement
from .targets import Target, demeaned_logit, logit_difference

#: How often a checkpointed run saves its rows.
SAVE_EVERY_S = 30.0


def _run_key(run, goal: Target, clt: CrossLayerTranscoder, freeze: bool) -> dict:
    """What must match for saved rows to belong to this graph."""
    return {"input_ids": run.input_ids[0].tolist(), "target": goal.describe(),
            "clt": clt.source or clt.cfg.model_name, "freeze": freeze,
            "features": [run.feature_layer.tolist(), run.feature_position.tolist(),
                         run.feature_id.tolist()]}


class _Checkpoint:
    """Rows computed so far, on disk (atomic replace), keyed by :func:`_run_key`."""

    def __init__(self, path: str | Path | None, key: dict) -> None:
        self.path = None if path is None else Path(path)
        self.key = key
        self.last = time.monotonic()

    def load(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.path is None or not self.path.exists():
            return [], []
        saved = torch.load(self.path, weights_only=False)
        if saved.get("key") != self.key:
            warnings.warn(f"{self.path} holds rows of another graph; starting afresh",
                          stacklevel=3)
            return [], []
        return [saved["rows"]], [saved["constants"]]

    def maybe_save(self, rows: list[torch.Tensor], constants: list[torch.Tensor]) -> None:
        if self.path is None or time.monotonic() - self.last < SAVE_EVERY_S:
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        torch.save({"key": self.key, "rows": torch.cat(rows),
                    "constants": torch.cat(constants)}, tmp)
        os.replace(tmp, self.path)
        self.last = time.monotonic()

    def remove(self) -> None:
        if self.path is not None and self.path.exists():
            self.path.unlink()


def make_target(logits: torch.Tensor, tokenizer, answer: str | None, *, kind: str = "demeaned",
                other: str | None = None, k: int = 10) -> Target:
    """The target on clean ``logits``: ``kind`` is ``"demeaned"`` (top-k, the default),
    ``"demeaned_vocab"`` or ``"difference"`` (``answer`` minus ``other``). No ``answer``: the
    clean argmax."""
    token = (int(logits[0, -1].argmax()) if answer is None
             else answer_token_id(tokenizer, answer, strict=True))
    if kind == "demeaned":
        return demeaned_logit(logits, token, k)
    if kind == "demeaned_vocab":
        return demeaned_logit(logits, token, demean="vocab")
    if kind == "difference":
        if other is None:
            raise ValueError("a logit-difference target needs the other token (other=...)")
        return logit_difference(logits.shape[-1], token,
                                answer_token_id(tokenizer, other, strict=True))
    raise ValueError(f"target kind must be demeaned, demeaned_vocab or difference, got {kind!r}")


def attribute(
    model: nn.Module, tokenizer, clt: CrossLayerTranscoder, prompt: str,
    answer: str | None = None, *, target: str = "demeaned", other: str | None = None,
    k: int = 10, memory_mb: float = 4096, batch_size: int | None = None,
    max_batch: int | None = None, freeze: bool = True, loop: bool = False,
    progress: bool = False, checkpoint: str | Path | None = None,
) -> AttributionGraph:
    """The attribution graph of ``prompt``'s next-token ``answer`` (a single token; default:
    the clean argmax) through ``clt``.

    ``memory_mb`` caps the forward graph plus the batched gradient rows (a prompt whose graph
    and one row exceed it raises :class:`~.edges.MemoryCapError`); rows per backward are as many
    as fit, at most ``max_batch`` (default: 32 on CPU, the fastest measured; 512 on GPU);
    ``batch_size`` fixes them instead; ``loop=True`` uses one backward per node (the reference).
    With ``checkpoint`` (a file path) the rows computed so far are saved every ``SAVE_EVERY_S``
    seconds and an interrupted call with the same inputs resumes from them; the file is removed
    when the graph is complete.
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        clean = model(input_ids=ids).logits
    goal = make_target(clean, tokenizer, answer, kind=target, other=other, k=k)
    run = run_local_replacement(model, clt, ids, freeze=freeze)
    logit_row, logit_constant, closure = target_row(run, goal)

    n = run.n_features
    size = batch_size or batch_size_for(run, run.forward_bytes, memory_mb, max_batch)
    store = _Checkpoint(checkpoint, _run_key(run, goal, clt, freeze))
    rows, constants = store.load()
    done = sum(len(r) for r in rows)
    chunks = (index + done for index in batches(n - done, size))
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, total=n_batches(n - done, size), desc="adjacency rows",
                      unit="batch")
    compute = feature_rows_loop if loop else feature_rows
    for index in chunks:
        r, c = compute(run, index.to(run.feature_layer.device))
        rows.append(r.float().cpu())
        constants.append(c.float().cpu())
        store.maybe_save(rows, constants)
    store.remove()
    with torch.no_grad():
        row_targets = feature_targets(run, torch.arange(n, device=run.feature_layer.device))
    logit_row = logit_row.float().cpu()
    width = logit_row.numel()
    adjacency = torch.cat([*rows, logit_row[None]]) if rows else logit_row[None]
    constants_all = torch.cat([*constants, torch.tensor([logit_constant])])
    probs = clean[0, -1].float().softmax(-1)
    tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
    graph = AttributionGraph(
        prompt=prompt, tokens=tokens, input_ids=ids[0].tolist(), target=goal.describe(),
        answer=tokenizer.decode([goal.token]), answer_prob=float(probs[goal.token]),
        n_layers=run.n_layers, feature_layer=run.feature_layer.cpu(),
        feature_position=run.feature_position.cpu(), feature_id=run.feature_id.cpu(),
        activation=run.activation.float().cpu(), adjacency=adjacency.reshape(-1, width),
        constants=constants_all,
        row_targets=torch.cat([row_targets.detach().float().cpu(),
                               torch.tensor([closure.target])]),
        closure=closure,
        metadata={"model": getattr(model, "pvct_source", None)
                  or getattr(model.config, "_name_or_path", ""),
                  "clt": clt.source or clt.cfg.model_name, "frozen": freeze,
                  "batch_size": size, "forward_mb": run.forward_bytes / 2**20,
                  "max_logit_change": float((run.logits.detach() - clean).abs().max())})
    return graph
