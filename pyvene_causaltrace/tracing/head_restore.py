"""Per-head restores: attention heads' clean outputs put back into the corrupted run.

Head ``h`` of layer ``l`` writes the ``h``-th ``head_dim`` slice of the attention output
projection's input (the slices :func:`~pyvene_causaltrace.attribution.heads.head_loadings`
splits edges by). A row restores chosen heads of one layer at one position in one seed's
corrupted run, by ``clean_restore`` with per-row masks over (position, head) units, so a forward
carries a different head, layer and seed in every row; all heads of a layer equal the ``attn``
trace with a one-layer window (tested). Head traces are small, so no prefix reuse or replay.

    restorer = HeadRestorer(tracer.engine, layers=[2, 5])   # one reference forward
    probs = restorer.run([(2, (0,)), (5, (1, 3))], position=-1)   # [seeds, cells] float64"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Integral

import torch

from ..applier import Call, Edit, applying
from ..arguments import check_index
from ..capture import capture
from ..errors import InputError
from ..interventions.restore import CleanRestore
from ..pyvene_boundary.calls import applied
from .engine import TraceEngine
from .metrics import token_probs

__all__ = ["HeadRestorer", "check_layers"]


def check_layers(layers: int | Sequence[int] | None, n_layers: int) -> list[int]:
    """``layers`` (None: every layer; an int: that one) as a list of distinct layers of the
    model, in the order given; anything else is refused naming the bad entries."""
    if layers is None:
        return list(range(n_layers))
    chosen = [layers] if isinstance(layers, Integral) else list(layers)
    bad = [layer for layer in chosen if not _is_index(layer, n_layers)]
    if bad or not chosen:
        raise InputError(f"layers {bad or chosen} are not layers of the model "
                         f"(0..{n_layers - 1})")
    return list(dict.fromkeys(int(layer) for layer in chosen))


def _is_index(value: object, size: int) -> bool:
    """An integer (a NumPy one too, not a bool) in ``0..size-1``."""
    return not isinstance(value, bool) and isinstance(value, Integral) and 0 <= value < size


class HeadRestorer:
    """Per-head restores on top of a :class:`~.engine.TraceEngine` (module docstring).

    Construction runs one reference forward (the clean row and one noised row per seed, the
    engine's noise) keeping the input of each chosen layer's output projection. Refused
    (:class:`~..errors.InputError`): a layer outside the model, a projection whose input is
    not ``n_heads x head_dim`` values per position."""

    def __init__(self, engine: TraceEngine, layers: int | Sequence[int] | None = None) -> None:
        bound = engine.bound
        self.engine = engine
        self.layers = check_layers(layers, bound.n_layers)
        self.n_heads, self.head_dim = bound.n_heads, bound.head_dim
        paths = {layer: bound.module_path("attn_out", layer) + ".input" for layer in self.layers}

        def reference_runs() -> None:
            with applying(engine.model, [engine.reference_noise()]):
                engine.model(input_ids=engine.ids.expand(1 + len(engine.seeds), -1),
                             logits_to_keep=1)

        with torch.no_grad():
            states = capture(engine.model, {}, paths.values(), run=reference_runs)
        width = self.n_heads * self.head_dim
        self.clean: dict[int, torch.Tensor] = {}
        self.corrupt: dict[int, torch.Tensor] = {}
        for layer, path in paths.items():
            value = states[path]
            if value.dim() != 3 or value.shape[-1] != width:
                raise InputError(f"layer {layer}'s attention output projection ({path}) takes "
                                 f"{tuple(value.shape)}, not [rows, positions, {self.n_heads} "
                                 f"heads x {self.head_dim}]: its heads cannot be told apart")
            units = self._units(value)
            self.clean[layer], self.corrupt[layer] = units[:1], units[1:]

    def _units(self, z: torch.Tensor) -> torch.Tensor:
        """``[rows, positions, heads * head_dim]`` as ``[rows, positions * heads, head_dim]``."""
        return z.reshape(z.shape[0], z.shape[1] * self.n_heads, self.head_dim)

    def position(self, position: int) -> int:
        """``position`` (negative: from the end) as an index of the prompt, or refused."""
        return check_index("position", position, self.engine.seq_len, "positions of the prompt",
                           negative=True)

    def run(self, cells: Sequence[tuple[int, Sequence[int]]], position: int = -1, *,
            donor: str = "clean",
            progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """P(answer) for every (seed, cell): a ``[n_seeds, n_cells]`` float64 tensor.

        A cell ``(layer, heads)`` restores those heads of that layer (one of :attr:`layers`)
        at ``position``; ``heads=()`` restores nothing (the corrupted run, computed in the
        same forwards). ``donor="corrupted"`` takes the corrupted run's own slices (a control:
        every probability stays the corrupted one). ``progress`` is called with the rows
        finished after each forward."""
        engine, n_heads = self.engine, self.n_heads
        if donor not in ("clean", "corrupted"):
            raise InputError(f"donor must be 'clean' or 'corrupted', got {donor!r}")
        position = self.position(position)
        n_seeds = len(engine.seeds)
        units = torch.zeros(len(cells), engine.seq_len * n_heads, dtype=torch.bool)
        cell_layer = torch.empty(len(cells), dtype=torch.long)
        for c, (layer, heads) in enumerate(cells):
            if not _is_index(layer, self.engine.n_layers) or int(layer) not in self.clean:
                raise InputError(f"cell {c}: layer {layer} is not among this restorer's layers "
                                 f"{self.layers}")
            heads = list(heads)
            bad = [h for h in heads if not _is_index(h, n_heads)]
            if bad:
                raise InputError(f"cell {c}: heads {bad} are not heads of layer {layer} "
                                 f"(0..{n_heads - 1})")
            cell_layer[c] = int(layer)
            units[c, [position * n_heads + int(h) for h in heads]] = True
        seed_of = torch.arange(n_seeds).repeat(len(cells))
        cell_of = torch.arange(len(cells)).repeat_interleave(n_seeds)
        states = self.clean if donor == "clean" else self.corrupt
        restores = {layer: CleanRestore(states=states[layer]) for layer in self.layers}

        def restore_heads(layer: int):
            restore = restores[layer]

            def edit(z: torch.Tensor, call: Call) -> torch.Tensor:
                if not call.args or call.args[0] is not z:
                    raise InputError(f"layer {layer}'s attention output projection was called "
                                     "without its input as the first argument")
                return applied(restore, self._units(z), call).reshape(z.shape)
            return edit

        bound = engine.bound
        edits = [Edit(bound.at("embed"), lambda value, call: applied(engine.noise, value, call))]
        edits += [Edit(bound.at("attn_out", layer, "input"), restore_heads(layer))
                  for layer in self.layers]
        out = torch.empty(len(seed_of), dtype=torch.float64)
        device = engine.device
        with applying(engine.model, edits), torch.no_grad():
            for rows in torch.arange(len(seed_of)).split(engine.rows_per_chunk(0)):
                seeds, chunk_cells = seed_of[rows], cell_of[rows]
                engine.noise.retarget(engine._noise_delta, seeds.to(device))
                for layer in self.layers:
                    mask = units[chunk_cells] & (cell_layer[chunk_cells] == layer)[:, None]
                    restores[layer].retarget(mask.to(device),
                                             state_rows=None if donor == "clean"
                                             else seeds.to(device))
                logits = engine.model(input_ids=engine.ids.expand(len(rows), -1),
                                      logits_to_keep=1).logits[:, -1]
                out[rows] = token_probs(logits, engine.answer_id).cpu()
                if progress is not None:
                    progress(len(rows))
        return out.view(len(cells), n_seeds).T.contiguous()
