"""The batched engine behind every trace kind.

A trace is a set of *rows*, one per (noise seed, layer, position) cell. One forward runs many
rows: each carries its own noise seed and its own restore mask, applied by the registered
intervention types (``clean_restore``, ``window_restore``, ``freeze``, with ``noise_add``'s
recipe for the noise).

A row restoring position ``t`` from layer ``l`` on equals its seed's corrupted run everywhere
below: at positions before ``t`` (attention is causal) and at layers below ``l``. So it is
computed only from there — earlier positions' keys and values come from the corrupted run's
cache (``reuse_prefix``), and lower blocks are replayed from the corrupted run's stored outputs
(``replay_layers``, :mod:`.replay`). Rows are grouped into chunks by :func:`.chunks.plan_chunks`,
which weighs the recomputation a mixed chunk costs against the fixed cost of another forward.

The interventions are built once per :meth:`TraceEngine.run` and applied by forward hooks
registered once per run; per chunk only their row masks change (``retarget``). pyvene's
``IntervenableModel`` would register and remove every hook on every call, which is most of the
cost on a small model or a GPU; the tests check the engine against batch-1 runs row by row.

    engine = TraceEngine(model, ids, subject_positions, seeds=[0, 1], scale=3.0, sigma=0.12,
                         answer_id=7042)
    probs = engine.run(KINDS["residual"], cells=[(layer, pos) for ...])   # [seeds, cells]
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..capture import capture
from ..defaults import WINDOW
from ..errors import InputError
from ..hooking import Hook, installed
from ..interventions.noise import NoiseAdd
from ..interventions.restore import CleanRestore, Freeze, WindowRestore
from ..locations import window_layers
from ..models import get_adapter, get_module
from ..pyvene_compat import intervenable_model_class
from .chunks import Chunk, ChunkCost, plan_chunks
from .replay import LayerReplay


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
        replay_layers: bool = True,
    ) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.n_layers = self.adapter.n_layers(model)
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
        self._cache_kw = _cache_kwarg(model)
        self.blocks = [get_module(model, self.adapter.module_path("block", layer))
                       for layer in range(self.n_layers)]

        parts = ("block", "mlp", "attn")
        self._paths = {
            part: [self.adapter.site(f"{part}_output", layer) for layer in range(self.n_layers)]
            for part in parts
        }
        every = [p for part in parts for p in self._paths[part]]
        box: dict = {}

        def note_block_output(_module, _args, output) -> None:
            box["tuple"] = isinstance(output, tuple)

        def clean_run():
            with installed([(self.blocks[0], "forward", note_block_output)]):
                box["logits"] = model(input_ids=self.ids, logits_to_keep=1).logits

        with torch.no_grad():
            self.clean_states = capture(model, {}, every, run=clean_run)
            self.clean_probs = box["logits"][0, -1].double().softmax(-1).cpu()
            runner = intervenable_model_class()(
                [{"component": self.adapter.site("embed"), "intervention": self.noise}], model)
            inputs = {"input_ids": self.ids.repeat(len(self.seeds), 1), "use_cache": True,
                      "logits_to_keep": 1}
            self.corrupt_states = capture(
                model, {}, every, run=lambda: box.setdefault("corrupt", runner(base=inputs)[1]))
        out = box["corrupt"]
        self.corrupt_probs = out.logits[:, -1].double().softmax(-1).cpu()
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        self._kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._returns_tuple = bool(box.get("tuple", False))
        self._noise_delta: torch.Tensor | None = None  # every seed's noise, made on first use
        weights = list(self.blocks[0].parameters())
        head = get_module(model, self.adapter.module_path("unembed")).weight
        self.cost = ChunkCost.estimate(
            self.device.type, layer_bytes=sum(p.numel() * p.element_size() for p in weights),
            layer_flops=2 * sum(p.numel() for p in weights),
            head_bytes=head.numel() * head.element_size())

    # ------------------------------------------------------------------------- helpers
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
                  + 4 * span * hidden  # replayed output, masks, intervention copies
                  + 3 * config.vocab_size)  # last-position logits and softmax
        return max(1, int(self.memory_budget_mb * 2**20 // (4 * floats)))

    def _noise_rows(self, seed_rows: torch.Tensor, prefix: int) -> torch.Tensor:
        """Each row's noise at positions ``prefix..``: ``noise_add``'s draws, made once."""
        if self._noise_delta is None:
            dtype = self.model.get_input_embeddings().weight.dtype
            delta = self.noise.noise(len(self.seeds), self.seq_len,
                                     self.adapter.hidden_size(self.model))
            self._noise_delta = delta.to(self.device, dtype)
        return self._noise_delta.index_select(0, seed_rows)[:, prefix:]

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
            raise InputError(f"donor must be 'clean' or 'corrupted', got {donor!r}")
        if not cells:
            return torch.empty(len(self.seeds), 0, dtype=torch.float64)
        rows = _Rows.of(self, kind, cells, window)
        plan = plan_chunks(rows.position, rows.first, n_layers=self.n_layers,
                           seq_len=self.seq_len, max_rows=self.rows_per_chunk, cost=self.cost,
                           reuse_prefix=self.reuse_prefix, replay_layers=self.replay_layers)
        out = torch.empty(len(rows), dtype=torch.float64, device=self.device)
        # every chunk's row indices reach the device in one copy
        indices = torch.cat([chunk.rows for chunk in plan]).to(self.device).split(
            [chunk.rows.numel() for chunk in plan])
        with _RunHooks(self, kind, donor, rows).applied() as hooks:
            for chunk, index in zip(plan, indices, strict=True):
                out[index] = hooks.forward(chunk, index)
                if progress is not None:
                    progress(chunk.rows.numel())
        return out.cpu().view(len(cells), len(self.seeds)).T.contiguous()


@dataclass(frozen=True)
class _Rows:
    """One run's rows (cell-major, seed-minor) as index tensors: each row's seed index, cell
    position, restored layers ``lo..hi-1`` and first computed layer."""

    seed: torch.Tensor
    position: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    first: torch.Tensor

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
                   first=first)

    def __len__(self) -> int:
        return self.seed.numel()

    def on(self, device: torch.device) -> _Rows:
        return _Rows(*(t.to(device) for t in (self.seed, self.position, self.lo, self.hi,
                                               self.first)))


class _RunHooks:
    """The interventions of one run, their forward hooks (on the model inside
    :meth:`applied`), and the forward of one chunk."""

    def __init__(self, engine: TraceEngine, kind: TraceKind, donor: str, rows: _Rows) -> None:
        self.engine, self.kind, self.donor = engine, kind, donor
        self.rows = rows.on(engine.device)
        self.lo, self.hi = rows.lo, rows.hi  # on the CPU: which layers a chunk restores
        self.states = engine.clean_states if donor == "clean" else engine.corrupt_states
        self.noise: torch.Tensor | None = None
        self.active: dict[str, nn.Module | None] = {}
        self.restores: dict[int, nn.Module] = {}
        self.freezes: dict[int, Freeze] = {}

    @contextlib.contextmanager
    def applied(self) -> Iterator[_RunHooks]:
        """The run's hooks on the model for the block; the interventions built on entry."""
        engine, kind, states = self.engine, self.kind, self.states
        hooks = []
        for layer, path in enumerate(engine._paths[kind.restore]):
            if kind.windowed:
                self.restores[layer] = WindowRestore(
                    states=states[path], sublayer=kind.restore, window_layer=layer)
            else:
                self.restores[layer] = CleanRestore(states=states[path])
            hooks.append(self._hook(path))
        if kind.sever is not None:
            for layer, path in enumerate(engine._paths[kind.sever]):
                self.freezes[layer] = Freeze(states=engine.corrupt_states[path], run="corrupted")
                hooks.append(self._hook(path))
        embed = get_module(engine.model, engine.adapter.module_path("embed"))
        hooks.append((embed, "forward", self._add_noise))
        with installed(hooks) as handles:
            own = {handle.id for handle in handles}
            self.replay = LayerReplay(engine.blocks, engine._returns_tuple, keep=own)
            yield self

    def _hook(self, component: str) -> Hook:
        module = get_module(self.engine.model, component.rpartition(".")[0])
        self.active[component] = None

        def apply(_module, _args, output):
            made = self.active[component]
            if made is None:
                return None
            if isinstance(output, tuple):
                return (made(output[0]), *output[1:])
            return made(output)

        return module, "forward", apply

    def _add_noise(self, _module, _args, output):
        return None if self.noise is None else output + self.noise

    def forward(self, chunk: Chunk, index: torch.Tensor) -> torch.Tensor:
        """P(answer) of the chunk's rows (``index``: their row indices on the device)."""
        engine, kind, rows = self.engine, self.kind, self.rows
        prefix, first = chunk.prefix, chunk.first_layer
        n, span = index.numel(), engine.seq_len - prefix
        seed_rows = rows.seed[index]
        at = (torch.arange(span, device=engine.device)[None, :]
              == (rows.position[index] - prefix)[:, None])  # [n, span]: each row's column
        lo, hi = rows.lo[index], rows.hi[index]
        restored = range(int(self.lo[chunk.rows].min()), int(self.hi[chunk.rows].max()))
        state_rows = seed_rows if self.donor == "corrupted" else None
        for layer in range(engine.n_layers):
            component = engine._paths[kind.restore][layer]
            made = None
            if layer in restored:
                made = self.restores[layer]
                made.retarget(((lo <= layer) & (layer < hi))[:, None] & at,
                              self.states[component][:, prefix:], state_rows)
            self.active[component] = made
            if kind.sever is not None:
                component = engine._paths[kind.sever][layer]
                made = None
                if layer >= first:  # below, the block returns the corrupted run's output
                    made = self.freezes[layer]
                    made.retarget(at, engine.corrupt_states[component][:, prefix:], seed_rows)
                self.active[component] = made
        self.noise = engine._noise_rows(seed_rows, prefix) if first == 0 else None

        base = {"input_ids": engine.ids[:, prefix:].expand(n, -1), "logits_to_keep": 1}
        if prefix:
            from transformers import DynamicCache  # slow to import: loaded when a model is

            base[engine._cache_kw] = DynamicCache(ddp_cache_data=[
                (k[:, :, :prefix].index_select(0, seed_rows.to(k.device)),
                 v[:, :, :prefix].index_select(0, seed_rows.to(v.device))) if layer >= first
                else (k[:1, :, :prefix], v[:1, :, :prefix])  # never read: a replayed block
                for layer, (k, v) in enumerate(engine._kv)], config=engine.model.config)
        replayed = None
        if first:
            below = engine.corrupt_states[engine._paths["block"][first - 1]]
            replayed = below.index_select(0, seed_rows.to(below.device))[:, prefix:]
        with torch.no_grad(), self.replay.below(first, replayed):
            logits = engine.model(**base).logits[:, -1]
        return logits.double().softmax(-1)[:, engine.answer_id]
