"""The batched engine behind every trace kind.

A trace is a set of *rows*, one per (noise seed, layer, position) cell. One forward runs many
rows: each carries its own noise seed and its own restore mask, applied by the registered
intervention types (``clean_restore``, ``window_restore``, ``freeze``, with ``noise_add``'s
recipe for the noise).

A row restoring position ``t`` from layer ``l`` equals its seed's corrupted run before ``t``
and below ``l``, so it is computed only from there (``reuse_prefix``: the corrupted run's keys
and values; ``replay_layers``: its stored block outputs, :mod:`.replay`); rows a forward would
only round take the reference runs' values (``skip_unchanged``). :func:`.chunks.plan_chunks`
groups rows into forwards. The interventions and their hooks are made once per
:meth:`TraceEngine.run` (pyvene's ``IntervenableModel`` would add and remove every hook on
every call, most of the cost on a small model or a GPU); per chunk only their row masks change.
docs/tracing.md ("Engine") has the whole design; the tests check it against batch-1 runs.

    engine = TraceEngine(model, ids, subject_positions, seeds=[0, 1], scale=3.0, sigma=0.12,
                         answer_id=7042)
    probs = engine.run(KINDS["residual"], cells=[(layer, pos) for ...])   # [seeds, cells]
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..applier import Call, Edit, applying, handle_ids
from ..bound import BoundModel, bind
from ..capture import capture
from ..errors import InputError
from ..interventions.noise import NoiseAdd
from ..interventions.restore import CleanRestore, Freeze, WindowRestore
from ..locations import window_layers
from ..models import get_module
from ..pyvene_boundary.calls import applied
from .chunks import Chunk, ChunkCost, plan_chunks
from .head import ReusedHead
from .metrics import token_probs
from .replay import LayerReplay, RaggedLayers, replayable
from .settings import TraceSettings


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
        raise InputError(f"unknown trace kind {name!r}; kinds: {', '.join(KINDS)}") from None


class TraceEngine:
    """Clean and corrupted reference runs of one prompt, and batched restore rows on top.

    Construction runs the clean and corrupted reference runs as one forward (row 0 clean, one
    noised row per seed), keeping every layer's block, MLP and attention outputs of both and the
    corrupted keys and values. :meth:`run` then evaluates restore rows; with
    ``skip_unchanged`` the rows a forward would only round (:meth:`_unchanged`) take the
    reference runs' values instead.
    """

    def __init__(
        self,
        model: nn.Module | BoundModel,
        input_ids: torch.Tensor,
        noise_positions: Sequence[int],
        seeds: Sequence[int],
        scale: float,
        sigma: float,
        answer_id: int,
        *,
        distribution: str = TraceSettings.distribution,
        memory_budget_mb: float = TraceSettings.memory_budget_mb,
        reuse_prefix: bool = TraceSettings.reuse_prefix,
        replay_layers: bool = TraceSettings.replay_layers,
        skip_unchanged: bool = True,
    ) -> None:
        self.bound = bound = bind(model)
        self.model = model = bound.model
        self.adapter = bound.adapter
        self.n_layers = bound.n_layers
        self.device = next(model.parameters()).device
        self.ids = input_ids.to(self.device)
        self.seq_len = int(self.ids.shape[1])
        self.noise_positions = list(noise_positions)
        self.seeds = list(seeds)
        self.noise = NoiseAdd(seeds=self.seeds, positions=self.noise_positions, scale=scale,
                              sigma=sigma, distribution=distribution)
        self.answer_id = int(answer_id)
        self.memory_budget_mb = memory_budget_mb
        self.reuse_prefix = reuse_prefix
        self.replay_layers = replay_layers
        self.skip_unchanged = skip_unchanged
        self._cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                          else "past_key_values")
        self.blocks = bound.blocks

        parts = ("block", "mlp", "attn")
        self._paths = {
            part: [self.adapter.site(f"{part}_output", layer) for layer in range(self.n_layers)]
            for part in parts
        }
        every = [p for part in parts for p in self._paths[part]]
        # the clean run and every seed's corrupted run in one forward: row 0 clean, then one
        # row per seed with ``noise_add``'s draws added to the embeddings (as the rows below)
        dtype = model.get_input_embeddings().weight.dtype
        delta = self.noise.noise(len(self.seeds), self.seq_len, bound.d_model)
        self._noise_delta = delta.to(self.device, dtype)  # every seed's noise, made once
        box: dict = {}

        def note_block_output(_value, call: Call) -> None:
            box["tuple"] = call.returned_tuple

        def reference_runs():
            edits = [Edit(bound.at("block", 0), note_block_output, last=True),
                     self.reference_noise()]
            with applying(model, edits):
                box["out"] = model(input_ids=self.ids.expand(1 + len(self.seeds), -1),
                                   use_cache=True, logits_to_keep=1)

        with torch.no_grad():
            states = capture(model, {}, every, run=reference_runs)
            # every layer's outputs of a part (and keys and values) in one tensor: a chunk
            # gathers its rows' stored ones in one op, not one per layer
            self._stacked = {part: torch.stack([states.pop(p) for p in self._paths[part]])
                             for part in parts}  # [layers, 1 + seeds, seq, hidden]
            for part, stacked in self._stacked.items():
                states.update(zip(self._paths[part], stacked, strict=True))
            out = box["out"]
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            kv = [torch.stack([layer.keys[1:], layer.values[1:]]) for layer in cache.layers]
            self._kv_stack = (torch.stack(kv) if len({(t.shape, t.dtype) for t in kv}) == 1
                              else None)  # [layers, 2, seeds, kv_heads, seq, head_dim]
        self.clean_states = {path: value[:1] for path, value in states.items()}
        self.corrupt_states = {path: value[1:] for path, value in states.items()}
        probs = out.logits[:, -1].double().softmax(-1).cpu()
        self.clean_probs, self.corrupt_probs = probs[0], probs[1:]
        self._kv = list(self._kv_stack.unbind(0) if self._kv_stack is not None else kv)
        self._returns_tuple = bool(box.get("tuple", False))
        weights = list(self.blocks[0].parameters())
        head = get_module(model, self.adapter.module_path("unembed")).weight
        self.cost = ChunkCost.estimate(
            self.device.type, layer_bytes=sum(p.numel() * p.element_size() for p in weights),
            layer_flops=2 * sum(p.numel() for p in weights),
            head_bytes=head.numel() * head.element_size())

    # ------------------------------------------------------------------------- helpers
    def reference_noise(self) -> Edit:
        """``noise_add`` on the embeddings of the reference runs' rows: row 0 clean, then
        one row per seed."""
        noise = self.noise
        clean = torch.zeros_like(self._noise_delta[:1])
        noise.retarget(torch.cat([clean, self._noise_delta]),
                       torch.arange(1 + len(self.seeds), device=self.device))
        return Edit(self.bound.at("embed"), lambda value, call: applied(noise, value, call))

    def restore_layers(self, kind: TraceKind, layer: int, window: int) -> list[int]:
        return window_layers(layer, window, self.n_layers) if kind.windowed else [layer]

    def rows_per_chunk(self, prefix: int) -> int:
        """Rows that fit the memory budget when positions before ``prefix`` are cached."""
        hidden, inner = self.bound.d_model, self.bound.d_mlp
        keys, _ = self._kv[0]  # [seeds, kv_heads, seq, head_dim]
        kv_width = keys.shape[1] * keys.shape[3]
        span = self.seq_len - prefix
        floats = (2 * self.n_layers * self.seq_len * kv_width  # cache, grown to full length
                  + 8 * span * max(hidden, inner)  # live activations
                  + 4 * span * hidden  # replayed output, masks, intervention copies
                  + 3 * self.bound.vocab_size)  # last-position logits and softmax
        return max(1, int(self.memory_budget_mb * 2**20 // (4 * floats)))

    # ------------------------------------------------------------------------------ run
    def run(
        self,
        kind: TraceKind,
        cells: Sequence[tuple[int, int]],
        *,
        window: int = TraceSettings.window,
        donor: str = "clean",
        progress: Callable[[int], None] | None = None,
        skip_unchanged: bool | None = None,
    ) -> torch.Tensor:
        """P(answer) for every (seed, cell): a ``[n_seeds, n_cells]`` float64 tensor.

        ``donor="corrupted"`` restores from the corrupted run's own states (a control: it must
        leave every probability at its corrupted value). ``progress`` is called with the number
        of rows finished after each chunk. ``skip_unchanged`` overrides the engine's setting
        for this run (the controls compute every row: they check the machinery).
        """
        skip = self.skip_unchanged if skip_unchanged is None else skip_unchanged
        if donor not in ("clean", "corrupted"):
            raise InputError(f"donor must be 'clean' or 'corrupted', got {donor!r}")
        if not cells:
            return torch.empty(len(self.seeds), 0, dtype=torch.float64)
        rows = _Rows.of(self, kind, cells, window)
        out = torch.empty(len(rows), dtype=torch.float64)
        known, value = (self._unchanged(kind, rows) if donor == "clean" and skip
                        else (None, None))
        todo = rows
        if known is not None and bool(known.any()):
            out[known] = value[known]
            if progress is not None:
                progress(int(known.sum()))
            todo = rows.take((~known).nonzero().squeeze(1))
        if len(todo):
            out[todo.index] = self._forwards(kind, todo, donor, progress)
        return out.view(len(cells), len(self.seeds)).T.contiguous()

    def _unchanged(self, kind: TraceKind, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows whose P(answer) a forward would only round, and that P.

        Like the reused prefix, this rests on causality: before the first noised position the
        clean and corrupted runs are equal, so a restore there is the corrupted run; a restore
        confined to the last layer reaches the last position's logits only at that position;
        and a restored last block output at the last position gives the donor's logits."""
        last, top = self.seq_len - 1, self.n_layers - 1
        first_noised = min(self.noise_positions, default=self.seq_len)
        corrupted = (rows.position < first_noised) | ((rows.lo == top) & (rows.position < last))
        clean = ((rows.hi == self.n_layers) & (rows.position == last)
                 if kind.restore == "block" else torch.zeros_like(corrupted))
        value = torch.where(clean, self.clean_probs[self.answer_id],
                            self.corrupt_probs[:, self.answer_id][rows.seed])
        return clean | corrupted, value

    def _forwards(self, kind: TraceKind, rows: _Rows, donor: str,
                  progress: Callable[[int], None] | None) -> torch.Tensor:
        """P(answer) of ``rows`` by batched forwards, in the planner's chunks."""
        run = _RunHooks(self, kind, donor, rows)
        # ragged rows start at their own layer inside a chunk: chunks need only band positions
        plan = plan_chunks(rows.position, rows.first, n_layers=self.n_layers,
                           seq_len=self.seq_len, max_rows=self.rows_per_chunk, cost=self.cost,
                           reuse_prefix=self.reuse_prefix,
                           replay_layers=run.replays and not run.ragged)
        if run.ragged:  # each chunk's rows by first layer: a block's rows are a batch prefix
            plan = [Chunk(prefix=chunk.prefix, first_layer=chunk.first_layer,
                          rows=chunk.rows[torch.argsort(rows.first[chunk.rows], stable=True)])
                    for chunk in plan]
        out = torch.empty(len(rows), dtype=torch.float64, device=self.device)
        # every chunk's row indices reach the device in one copy
        indices = torch.cat([chunk.rows for chunk in plan]).to(self.device).split(
            [chunk.rows.numel() for chunk in plan])
        with run.applied() as hooks:
            for chunk, index in zip(plan, indices, strict=True):
                out[index] = hooks.forward(chunk, index)
                if progress is not None:
                    progress(chunk.rows.numel())
        return out.cpu()


@dataclass(frozen=True)
class _Rows:
    """Rows (cell-major, seed-minor) as index tensors: each row's seed index, cell position,
    restored layers ``lo..hi-1``, first computed layer, and index in its run."""

    seed: torch.Tensor
    position: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    first: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, engine: TraceEngine, kind: TraceKind, cells, window: int) -> _Rows:
        n_seeds = len(engine.seeds)
        spans = [engine.restore_layers(kind, layer, window) for layer, _ in cells]
        lo = torch.tensor([s[0] for s in spans]).repeat_interleave(n_seeds)
        # a restored block output is a corrupted one with a column overwritten: replay it
        first = lo + 1 if kind.restore == "block" else lo
        return cls(seed=torch.arange(n_seeds).repeat(len(cells)),
                   position=torch.tensor([p for _, p in cells]).repeat_interleave(n_seeds),
                   lo=lo, hi=torch.tensor([s[-1] + 1 for s in spans]).repeat_interleave(n_seeds),
                   first=first, index=torch.arange(len(cells) * n_seeds))

    def __len__(self) -> int:
        return self.seed.numel()

    def take(self, index: torch.Tensor) -> _Rows:
        return _Rows(*(t[index] for t in self._fields()))

    def on(self, device: torch.device) -> _Rows:
        return _Rows(*(t.to(device) for t in self._fields()))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return self.seed, self.position, self.lo, self.hi, self.first, self.index


class _RunHooks:
    """The interventions of one run, their forward hooks (on the model inside
    :meth:`applied`), and the forward of one chunk."""

    def __init__(self, engine: TraceEngine, kind: TraceKind, donor: str, rows: _Rows) -> None:
        self.engine, self.kind, self.donor = engine, kind, donor
        self.rows = rows.on(engine.device)
        # on the host: which layers a chunk restores, where its rows start (no device sync)
        self.lo, self.hi, self.first = rows.lo.numpy(), rows.hi.numpy(), rows.first.numpy()
        self.layer_ids = torch.arange(engine.n_layers, device=engine.device)
        self.span_ids = torch.arange(engine.seq_len, device=engine.device)
        self.states = engine.clean_states if donor == "clean" else engine.corrupt_states
        self.noise_on = False
        self.active: dict[str, nn.Module | None] = {}
        self.restores: dict[int, nn.Module] = {}
        self.freezes: dict[int, Freeze] = {}
        # rows start at their own layer within a chunk, unless a hook of someone else's on a
        # block's output would then see stored rows again (LayerReplay handles that case)
        self.ragged = engine.replay_layers and not any(block._forward_hooks
                                                       for block in engine.blocks)
        # LayerReplay silences the package's hooks on a replayed block, and can silence no
        # one else's: with such a hook on a block, every row computes every layer
        self.replays = engine.replay_layers and (self.ragged or replayable(engine.blocks))

    @contextlib.contextmanager
    def applied(self) -> Iterator[_RunHooks]:
        """The run's edits on the model (:mod:`..applier`) for the block; the interventions
        built on entry."""
        engine, kind, states = self.engine, self.kind, self.states
        bound = engine.bound
        edits = []
        for layer, path in enumerate(engine._paths[kind.restore]):
            if kind.windowed:
                self.restores[layer] = WindowRestore(
                    states=states[path], sublayer=kind.restore, window_layer=layer)
            else:
                self.restores[layer] = CleanRestore(states=states[path])
            edits.append(self._edit(path))
        if kind.sever is not None:
            for layer, path in enumerate(engine._paths[kind.sever]):
                self.freezes[layer] = Freeze(states=engine.corrupt_states[path], run="corrupted")
                edits.append(self._edit(path))
        edits.append(Edit(bound.at("embed"), self._add_noise))
        if kind.restore != "mlp" and kind.sever != "mlp":
            edits += self._last_mlp_at_last_position()
        head = ReusedHead(bound.module("unembed"))
        with applying(engine.model, edits), head.installed():
            if not self.ragged:
                self.replay = LayerReplay(engine.blocks, engine._returns_tuple,
                                          keep=handle_ids(engine.model))
                yield self
                return
            self.layers = RaggedLayers(engine.blocks, engine._returns_tuple)
            with self.layers.installed():
                yield self

    def _last_mlp_at_last_position(self) -> list[Edit]:
        """The last block's MLP on the last position alone: the logits read only that position,
        so its MLP elsewhere is wasted work (the output broadcasts over the residual's
        positions). Left off when anything else hooks that block: it might read them. The
        edit narrows the MLP's input (the applier's rule: its new value replaces the old)."""
        engine = self.engine
        if any(module._forward_hooks or module._forward_pre_hooks
               for module in engine.blocks[-1].modules()):
            return []

        def last_only(value: torch.Tensor, _call: Call) -> torch.Tensor | None:
            return value[:, -1:] if value.dim() == 3 else None

        return [Edit(engine.bound.at("mlp", engine.n_layers - 1, "input"), last_only)]

    def _edit(self, component: str) -> Edit:
        self.active[component] = None

        def apply(value: torch.Tensor, call: Call) -> torch.Tensor | None:
            made = self.active[component]
            return None if made is None else applied(made, value, call)

        return Edit(self.engine.bound.site_of(component), apply)

    def _add_noise(self, value: torch.Tensor, call: Call) -> torch.Tensor | None:
        """``noise_add`` (the engine's, :meth:`NoiseAdd.retarget` to the chunk's rows) when
        the chunk computes from the embeddings."""
        return applied(self.engine.noise, value, call) if self.noise_on else None

    def forward(self, chunk: Chunk, index: torch.Tensor) -> torch.Tensor:
        """P(answer) of the chunk's rows (``index``: their row indices on the device; sorted by
        first layer when ragged). The chunk's masks, keys and values and stored rows are each
        made in one op for every layer (its layers take views): few launches per layer."""
        engine, kind, rows = self.engine, self.kind, self.rows
        prefix, on_host = chunk.prefix, chunk.rows.numpy()
        n, span = index.numel(), engine.seq_len - prefix
        seed_rows = rows.seed[index]
        at = self.span_ids[:span] == (rows.position[index] - prefix)[:, None]  # [n, span]
        lo, hi = self.lo[on_host], self.hi[on_host]
        # the layers some row restores, and each row's masks at them: [n, layers, span]
        low = int(lo.min())
        layers = self.layer_ids[low:int(hi.max())]
        masks = (((rows.lo[index, None] <= layers) & (layers < rows.hi[index, None]))[:, :, None]
                 & at[:, None])
        restored = np.flatnonzero(np.cumsum(np.bincount(lo, minlength=engine.n_layers + 1)
                                            - np.bincount(hi, minlength=engine.n_layers + 1)))
        restored = set(restored.tolist())
        state_rows = seed_rows if self.donor == "corrupted" else None
        if kind.sever is not None:  # each row's seed's corrupted output at its position
            frozen = engine._stacked[kind.sever][:, 1 + seed_rows, rows.position[index]]
        # block j computes the first counts[j] rows; ragged, it returns the first
        # counts[j + 1] (the rows that have started by then), and the last block all n
        if self.ragged:
            firsts = self.first[on_host]
            first = int(firsts[0])
            counts = np.searchsorted(firsts, np.arange(engine.n_layers), side="right").tolist()
            counts.append(n)
        else:
            first = chunk.first_layer
            counts = [0 if layer < first else n for layer in range(engine.n_layers)] + [n]
        for layer in range(engine.n_layers):
            component = engine._paths[kind.restore][layer]
            made = None
            if layer in restored:
                # a sublayer sees its block's computed rows only; a block output the rows
                # its block returns (all n under LayerReplay: restored layers are >= first - 1)
                k = counts[layer + 1] if kind.restore == "block" else counts[layer]
                made = self.restores[layer]
                made.retarget(masks[:k, layer - low], self.states[component][:, prefix:],
                              None if state_rows is None else state_rows[:k])
            self.active[component] = made
            if kind.sever is not None:
                component = engine._paths[kind.sever][layer]
                made = None
                k = counts[layer]
                if k:  # below, the block returns the corrupted run's output
                    made = self.freezes[layer]
                    made.retarget(at[:k], frozen[layer, :k, None].expand(-1, span, -1))
                self.active[component] = made
        self.noise_on = first == 0
        if self.noise_on:
            engine.noise.retarget(engine._noise_delta, seed_rows, prefix)

        # no cache to fill unless the chunk starts from the corrupted run's (two copies a layer)
        base = {"input_ids": engine.ids[:, prefix:].expand(n, -1), "logits_to_keep": 1,
                "use_cache": bool(prefix)}
        if prefix:
            base[engine._cache_kw] = self._cache(prefix, seed_rows, counts)
        if self.ragged:
            # each row's stored output below its first layer (rows computed from the
            # embeddings take an unused one): the rows joining at block j are a slice
            stored = engine._stacked["block"][rows.first[index] - 1, 1 + seed_rows, prefix:]
            self.layers.counts = counts
            self.layers.stored = lambda _layer, k, end: stored[k:end]
            lower_blocks = contextlib.nullcontext()
        else:
            replayed = None
            if first:
                below = engine.corrupt_states[engine._paths["block"][first - 1]]
                replayed = below.index_select(0, seed_rows.to(below.device))[:, prefix:]
            lower_blocks = self.replay.below(first, replayed)
        with torch.no_grad(), lower_blocks:
            logits = engine.model(**base).logits[:, -1]
        return token_probs(logits, engine.answer_id)

    def _cache(self, prefix: int, seed_rows: torch.Tensor, counts: list[int]):
        """The corrupted run's keys and values before ``prefix`` for the chunk's rows, block
        ``j`` the first ``counts[j]`` (one gather for every layer where they share a shape)."""
        from transformers import DynamicCache  # slow to import: loaded when a model is

        engine = self.engine
        stack = engine._kv_stack
        if stack is not None:
            kv = stack[..., :prefix, :].index_select(2, seed_rows.to(stack.device)).unbind(0)
        else:
            kv = [torch.stack([k[:, :, :prefix].index_select(0, seed_rows.to(k.device)),
                               v[:, :, :prefix].index_select(0, seed_rows.to(v.device))])
                  for k, v in engine._kv]
        return DynamicCache(ddp_cache_data=[  # a block whose rows are all stored reads none
            (keys[:max(count, 1)], values[:max(count, 1)])
            for count, (keys, values) in zip(counts[:-1], kv, strict=True)],
            config=engine.bound.decoder_config)
