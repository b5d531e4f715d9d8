"""The batched engine behind every trace kind.

A trace is a set of *rows*, one per (noise seed, layer, position) cell. Each row carries its own
noise seed (``noise_add`` with per-row seeds) and its own restore mask (``clean_restore`` /
``window_restore`` / ``freeze`` with per-row masks), so one forward runs many cells.

Rows that restore position ``t`` agree with the corrupted run of their seed at every position
before ``t``, at every layer (attention is causal and nothing before ``t`` was touched). With
``reuse_prefix`` (the default) such rows start at ``t``: the corrupted run's keys and values of
positions ``< t`` come from a cache, gathered per row by seed, and only positions ``t..T-1`` are
computed. Rows are grouped by ``t`` and chunked to a memory budget.

    engine = TraceEngine(model, ids, subject_positions, seeds=[0, 1], scale=3.0, sigma=0.12,
                         answer_id=7042)
    probs = engine.run(KINDS["residual"], cells=[(layer, pos) for ...])   # [seeds, cells]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..capture import capture
from ..defaults import WINDOW
from ..interventions.noise import NoiseAdd
from ..interventions.restore import CleanRestore, Freeze, WindowRestore
from ..locations import window_layers
from ..models import get_adapter
from ..pyvene_compat import intervenable_model_class


@dataclass(frozen=True)
class TraceKind:
    """What a row of a trace restores.

    ``restore`` is the adapter part whose output is restored at the cell's position (``block``:
    the residual stream). ``windowed`` restores it over ROME's window of layers centred on the
    cell's layer instead of at that layer alone. ``sever`` names a sublayer held at its
    corrupted-run output at the cell's position, at every layer (ROME's severed traces).
    """

    name: str
    restore: str
    windowed: bool = False
    sever: str | None = None


KINDS: dict[str, TraceKind] = {
    "residual": TraceKind("residual", "block"),
    "mlp": TraceKind("mlp", "mlp", windowed=True),
    "attn": TraceKind("attn", "attn", windowed=True),
    "severed-mlp": TraceKind("severed-mlp", "block", sever="mlp"),
    "severed-attn": TraceKind("severed-attn", "block", sever="attn"),
}
#: The residual restored over a window of layers: only used by the window control.
RESIDUAL_WINDOW = TraceKind("residual-window", "block", windowed=True)


def get_kind(name: str) -> TraceKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown trace kind {name!r}; kinds: {', '.join(KINDS)}") from None


def _cache_kwarg(model: nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TraceEngine:
    """Clean and corrupted reference runs of one prompt, and batched restore rows on top.

    Construction runs the clean forward (batch 1) and the corrupted forward (one row per seed),
    keeping every layer's block, MLP and attention outputs of both and the corrupted keys and
    values. :meth:`run` then evaluates restore rows.
    """

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        noise_positions: Sequence[int],
        seeds: Sequence[int],
        scale: float,
        sigma: float,
        answer_id: int,
        *,
        distribution: str = "gaussian",
        memory_budget_mb: float = 2048.0,
        reuse_prefix: bool = True,
    ) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.n_layers = self.adapter.n_layers(model)
        self.device = next(model.parameters()).device
        self.ids = input_ids.to(self.device)
        self.seq_len = int(self.ids.shape[1])
        self.noise_positions = list(noise_positions)
        self.seeds = list(seeds)
        self.noise_config = dict(scale=scale, sigma=sigma, distribution=distribution)
        self.answer_id = int(answer_id)
        self.memory_budget_mb = memory_budget_mb
        self.reuse_prefix = reuse_prefix
        self._cache_kw = _cache_kwarg(model)
        self._intervenable = intervenable_model_class()

        parts = ("block", "mlp", "attn")
        self._paths = {
            part: [self.adapter.site(f"{part}_output", layer) for layer in range(self.n_layers)]
            for part in parts
        }
        every = [p for part in parts for p in self._paths[part]]
        box: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            self.clean_states = capture(model, {}, every, run=lambda: box.setdefault(
                "logits", model(input_ids=self.ids, logits_to_keep=1).logits))
            self.clean_probs = box["logits"][0, -1].double().softmax(-1).cpu()
            noise = self._noise(self.seeds, offset=0)
            runner = self._intervenable([self._embed(noise)], model)
            inputs = {"input_ids": self.ids.repeat(len(self.seeds), 1), "use_cache": True,
                      "logits_to_keep": 1}
            self.corrupt_states = capture(
                model, {}, every, run=lambda: box.setdefault("corrupt", runner(base=inputs)[1]))
        out = box["corrupt"]
        self.corrupt_probs = out.logits[:, -1].double().softmax(-1).cpu()
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        self._kv = [(layer.keys, layer.values) for layer in cache.layers]

    # ------------------------------------------------------------------------- helpers
    def _noise(self, seeds: Sequence[int], offset: int) -> NoiseAdd:
        return NoiseAdd(seeds=list(seeds), positions=self.noise_positions, offset=offset,
                        **self.noise_config)

    def _embed(self, noise: NoiseAdd) -> dict:
        return {"component": self.adapter.site("embed"), "intervention": noise}

    def restore_layers(self, kind: TraceKind, layer: int, window: int) -> list[int]:
        return window_layers(layer, window, self.n_layers) if kind.windowed else [layer]

    def rows_per_chunk(self, prefix: int) -> int:
        """Rows that fit the memory budget when positions before ``prefix`` are cached."""
        config = self.model.config
        hidden = self.adapter.hidden_size(self.model)
        inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        keys, _ = self._kv[0]  # [seeds, kv_heads, seq, head_dim]
        kv_width = keys.shape[1] * keys.shape[3]
        span = self.seq_len - prefix
        floats = (2 * self.n_layers * self.seq_len * kv_width  # cache, grown to full length
                  + 8 * span * max(hidden, inner)  # live activations
                  + self.n_layers * 3 * span * hidden  # intervention copies
                  + 3 * config.vocab_size)  # last-position logits and softmax
        return max(1, int(self.memory_budget_mb * 2**20 // (4 * floats)))

    # ------------------------------------------------------------------------------ run
    def run(
        self,
        kind: TraceKind,
        cells: Sequence[tuple[int, int]],
        *,
        window: int = WINDOW,
        donor: str = "clean",
        progress: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """P(answer) for every (seed, cell): a ``[n_seeds, n_cells]`` float64 tensor.

        ``donor="corrupted"`` restores from the corrupted run's own states (a control: it must
        leave every probability at its corrupted value). ``progress`` is called with the number
        of rows finished after each chunk.
        """
        if donor not in ("clean", "corrupted"):
            raise ValueError(f"donor must be 'clean' or 'corrupted', got {donor!r}")
        n_seeds = len(self.seeds)
        out = torch.empty(n_seeds, len(cells), dtype=torch.float64)
        by_position: dict[int, list[tuple[int, int]]] = {}
        for index, (_, position) in enumerate(cells):
            by_position.setdefault(position, []).extend((s, index) for s in range(n_seeds))
        for position, rows in sorted(by_position.items()):
            prefix = position if self.reuse_prefix else 0
            size = self.rows_per_chunk(prefix)
            for start in range(0, len(rows), size):
                chunk = rows[start:start + size]
                probs = self._run_chunk(kind, cells, chunk, position, prefix, window, donor)
                for (seed_index, cell_index), p in zip(chunk, probs.tolist(), strict=True):
                    out[seed_index, cell_index] = p
                if progress is not None:
                    progress(len(chunk))
        return out

    def _run_chunk(self, kind, cells, chunk, position, prefix, window, donor) -> torch.Tensor:
        n_rows, span, column = len(chunk), self.seq_len - prefix, position - prefix
        seed_rows = torch.tensor([s for s, _ in chunk], device=self.device)
        representations = [self._embed(self._noise([self.seeds[s] for s, _ in chunk], prefix))]

        # which rows restore which layer (one intervention per layer that any row needs)
        wanted: dict[int, list[int]] = {}
        for row, (_, cell_index) in enumerate(chunk):
            for layer in self.restore_layers(kind, cells[cell_index][0], window):
                wanted.setdefault(layer, []).append(row)
        for layer, rows in sorted(wanted.items()):
            mask = torch.zeros(n_rows, span, dtype=torch.bool)
            mask[rows, column] = True
            path = self._paths[kind.restore][layer]
            if donor == "clean":
                states, state_rows = self.clean_states[path][:, prefix:], None
            else:
                states, state_rows = self.corrupt_states[path][:, prefix:], seed_rows
            if kind.windowed:
                made = WindowRestore(positions=mask, states=states, state_rows=state_rows,
                                     sublayer=kind.restore, window_layer=layer, center=None,
                                     window=window)
            else:
                made = CleanRestore(positions=mask, states=states, state_rows=state_rows)
            representations.append({"component": path, "intervention": made})
        if kind.sever is not None:
            mask = torch.zeros(n_rows, span, dtype=torch.bool)
            mask[:, column] = True
            for path in self._paths[kind.sever]:
                representations.append({"component": path, "intervention": Freeze(
                    positions=mask, states=self.corrupt_states[path][:, prefix:],
                    state_rows=seed_rows, run="corrupted")})

        base = {"input_ids": self.ids[:, prefix:].repeat(n_rows, 1), "logits_to_keep": 1}
        if prefix:
            from transformers import DynamicCache

            base[self._cache_kw] = DynamicCache(
                ddp_cache_data=[(k.index_select(0, seed_rows)[:, :, :prefix],
                                 v.index_select(0, seed_rows)[:, :, :prefix])
                                for k, v in self._kv],
                config=self.model.config)
        runner = self._intervenable(representations, self.model)
        with torch.no_grad():
            logits = runner(base=base)[1].logits[:, -1]
        return logits.double().softmax(-1)[:, self.answer_id].cpu()
