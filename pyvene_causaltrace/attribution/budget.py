"""Memory planning for an attribution graph: what the forward graph, a batch of gradient rows and
the stored rows will cost, decided before anything large is allocated.

- :func:`check_forward_fits`: the forward's parts (:func:`forward_parts`: saved activations,
  the features' writes, one gathering of decoder rows, encoder rows; attention patterns only
  under eager attention), all linear in tokens but the patterns;
- :func:`batch_size_for` / :func:`check_batch_fits`: rows per backward beside the forward graph;
- :func:`feature_budget`: how many feature rows the row store can hold, each bounded by its
  causal cone, plus what ranking by influence reads below the active features (on the host:
  beside the forward on the CPU, :func:`store_bytes`; in the host's memory for a GPU's run).

Every refusal is a :class:`MemoryCapError` that says what to change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..bound import BoundModel
from ..errors import InputError, MemoryCapError
from ..interventions.splice_math import GATHER_BYTES
from ..memory import device_bytes
from ..transcoders.checks import hook_states
from .store import CHUNK_ENTRIES

log = logging.getLogger("pyvene_causaltrace.attribution")

#: Rows per backward when the memory cap allows more: on 2 CPU cores 32 rows per backward were
#: fastest (SmolLM2: 2.7 ms/row against 4.0 at 8 and 3.4 at 128); GPUs want wide batches.
DEFAULT_MAX_BATCH = {"cpu": 32, "cuda": 512}

#: Saved activations per token, layer and d_model unit besides the decoder rows (float32
#: bytes / (P * L * D)), measured with ``_count_saved_bytes``: SmolLM2 14.9-15.3 (9-64 tokens),
#: tiny Llama/GPT-2 15.0-19.6. Taken with a margin.
ACTIVATION_UNITS = 24

#: Bytes per stored row entry (float32 value + int32 column).
ENTRY_BYTES = 8
#: Transient bytes per entry of a reading chunk (row/column int64, values as float64, masks).
CHUNK_BYTES = 48
#: Transient bytes per stored entry whose source is an explored feature while a ranking reads
#: the rows' influence (the edges among rows, int64 and float64, and two float64 temporaries per
#: term): measured 38 B beyond the chunks on a 6 M-entry store of only such entries.
INFLUENCE_BYTES = 40


def active_counts(model: BoundModel, transcoder, input_ids: torch.Tensor,
                  from_position: int = 1,
                  run: Callable[[], object] | None = None) -> torch.Tensor:
    """``[L]``: active features per layer on ``input_ids`` (no graph, one forward: ``run()``
    when given, a clean forward the caller needs anyway)."""
    with torch.no_grad():
        mid = hook_states(model, input_ids, {"x": transcoder.cfg.feature_input_hook}, run=run)["x"]
        if transcoder.cfg.joint:  # one layer's features need every layer's input
            acts = transcoder.encode_all(mid, zero_bos=False)[:, from_position:]
            return (acts != 0).flatten(1).sum(1).cpu()
        return torch.tensor([int((transcoder.encode(mid[layer, from_position:], layer) != 0).sum())
                             for layer in range(transcoder.n_layers)])


def forward_parts(model: BoundModel, transcoder, n_pos: int, counts: torch.Tensor) -> dict:
    """Estimated bytes of the local replacement forward on ``n_pos`` tokens with ``counts``
    active features per layer (docs/attribution.md, "Memory"): ``activations`` autograd saves
    (linear in tokens), ``patterns`` (eager attention's softmax weights, ``P^2`` per head and
    layer; 0 under sdpa, whose backward recomputes them), ``writes`` (what the features write
    into later layers, alive until the forward ends), ``decoder`` (one gathering of decoder
    rows: they are not kept) and ``encoder`` (the active features' encoder rows, kept)."""
    n_layers, d_model = transcoder.n_layers, transcoder.cfg.d_model
    item = torch.empty(0, dtype=transcoder.dtype).element_size()
    targets = torch.tensor([transcoder.cfg.n_targets(layer) for layer in range(n_layers)])
    gathered = int((counts * targets).sum()) * d_model * item
    eager = getattr(model.model.config, "_attn_implementation", "eager") in (None, "eager")
    return {"activations": ACTIVATION_UNITS * n_pos * n_layers * d_model * 4,
            "patterns": 2 * n_pos * n_pos * model.n_heads * n_layers * 4 if eager else 0,
            "writes": int(targets.sum()) * n_pos * d_model * item,
            "decoder": min(gathered, GATHER_BYTES),
            "encoder": int(counts.sum()) * d_model * item}


def check_forward_fits(model: BoundModel, transcoder, input_ids: torch.Tensor, memory_mb: float,
                       counts: torch.Tensor) -> int:
    """Raise :class:`MemoryCapError` unless the forward graph fits ``memory_mb``; returns its
    estimated bytes (:func:`forward_parts`)."""
    parts = forward_parts(model, transcoder, int(input_ids.shape[-1]), counts)
    need = sum(parts.values())
    if need > memory_mb * 2**20:
        raise MemoryCapError(
            f"the prompt ({input_ids.shape[-1]} tokens, {int(counts.sum())} active features) "
            f"needs about {need / 2**20:,.0f} MB for its forward graph ("
            + ", ".join(f"{name} {size / 2**20:,.0f} MB" for name, size in parts.items())
            + f") and the memory cap is {memory_mb:,.0f} MB. Raise memory_mb, shorten the "
            "prompt, or use a transcoder that fires fewer features.")
    return need


def row_bytes(run) -> int:
    """Estimated bytes one batched gradient row costs: its leaf gradients (computed and
    accumulated), its dense edge row, and an eighth of the forward's saved activations. On
    SmolLM2 (9 tokens) 2.2-4.6 MB were measured against this estimate's 9.3 MB
    (benchmarks/attribution_speed.py)."""
    activations = run.forward_bytes
    gradients = sum(x.numel() * x.element_size() for x in run.inputs())
    return 2 * gradients + 8 * run.n_columns + activations // 8


def batch_size_for(run, memory_mb: float, max_batch: int | None = None,
                   reserve: int = 0) -> int:
    """Rows per backward that fit ``memory_mb`` beside the forward graph and ``reserve``
    bytes (the row store's, :func:`store_bytes`; at most ``max_batch``, default
    :data:`DEFAULT_MAX_BATCH` for the device); raises :class:`MemoryCapError` when not even
    one does."""
    if max_batch is None:
        max_batch = DEFAULT_MAX_BATCH.get(run.logits.device.type, 64)
    budget = memory_mb * 2**20 - run.forward_bytes - reserve
    per_row = row_bytes(run)
    if budget < per_row:
        need = (run.forward_bytes + per_row) / 2**20
        raise MemoryCapError(
            f"the prompt ({run.n_pos} tokens, {run.n_features} active features) needs about "
            f"{need:.0f} MB for its forward graph and one gradient row; the memory cap is "
            f"{memory_mb:.0f} MB. Shorten the prompt or raise memory_mb.")
    return max(1, min(max_batch, int(budget // per_row)))


def check_batch_fits(run, memory_mb: float, batch: int) -> None:
    """Raise :class:`MemoryCapError` unless ``batch`` gradient rows per backward (a size the
    caller fixed) fit ``memory_mb`` beside the forward graph."""
    need = run.forward_bytes + batch * row_bytes(run)
    if need > memory_mb * 2**20:
        raise MemoryCapError(
            f"batch_size={batch} needs about {need / 2**20:,.0f} MB (forward graph "
            f"{run.forward_bytes / 2**20:,.0f} MB, {row_bytes(run) / 2**20:,.1f} MB per "
            f"gradient row) and the memory cap is {memory_mb:,.0f} MB; lower batch_size (or "
            f"leave it unset: at most {batch_size_for(run, memory_mb, batch)} fit) or raise "
            "memory_mb")


def row_feature_bounds(run) -> torch.Tensor:
    """``[n_features]``: the active features in each feature's causal cone (earlier layers,
    same or earlier positions): at most the feature entries of its row."""
    layers, positions = run.feature_layer.cpu(), run.feature_position.cpu()
    n_layers, n_pos = run.n_layers, run.n_pos
    grid = torch.zeros(n_layers, n_pos, dtype=torch.long)
    grid.index_put_((layers, positions), torch.ones_like(layers), accumulate=True)
    # cone[l, p] = features at layers < l and positions <= p; with Lorsa heads (attention
    # features, :mod:`.lorsa_nodes`) a layer-l feature also reads layer l's heads: <= l
    below = grid.cumsum(0) if getattr(run, "lorsa_layers", None) else torch.cat(
        [torch.zeros(1, n_pos, dtype=torch.long), grid.cumsum(0)[:-1]])
    return below.cumsum(1)[layers, positions]


def _ranking_bytes(feature_cones: torch.Tensor, rows: int) -> float:
    """At most what a ranking's influence holds with ``rows`` feature rows: each row has at
    most ``min(its cone's features, rows)`` entries whose source has a row."""
    return INFLUENCE_BYTES * float(feature_cones[:rows].clamp(max=rows).sum())


def _store_costs(run, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cost, bounds, cones)`` in ``order``: the bytes of the first ``k`` rows stored
    (``cost[k - 1]``), each row's entry bound and its feature cone."""
    n = run.n_features
    cones = row_feature_bounds(run)
    # at most how many nonzero entries each feature's row has: the active features, errors and
    # tokens in its causal cone (earlier layers, same or earlier positions)
    layers, positions = run.feature_layer.cpu(), run.feature_position.cpu()
    error_layers = layers + len(getattr(run, "lorsa_layers", None) or [])  # Lorsa errors
    bounds = (cones + error_layers * (positions + 1) + positions + 1)[order.cpu()].double()
    entries = bounds.cumsum(0)
    cost = entries * ENTRY_BYTES + 64 * torch.arange(1, n + 1) \
        + CHUNK_BYTES * entries.clamp(max=CHUNK_ENTRIES)
    return cost, bounds, cones[order.cpu()]


def store_bytes(run, rows: int | None, order: torch.Tensor) -> int:
    """Bytes the row store and its ranking take with ``rows`` feature rows (None: every active
    feature's) in ``order``, where they take the forward's memory (on the CPU; a GPU's run
    keeps them on the host): what :func:`batch_size_for` leaves beside the batch."""
    if run.logits.device.type != "cpu":
        return 0
    n = run.n_features
    rows = n if rows is None else min(rows, n)
    if rows <= 0:
        return 0
    cost, _, cones = _store_costs(run, order)
    return int(float(cost[rows - 1]) + (_ranking_bytes(cones, rows) if rows < n else 0.0))


def feature_budget(run, memory_mb: float, batch: int, requested: int | None,
                   order: torch.Tensor) -> int:
    """Feature rows to compute: ``requested`` (capped at the active features) when given, else
    as many as fit beside the forward graph and a batch of gradient rows, taken in ``order``
    (logged when not all). Rows are sized by their causal cones, and a budget below
    ``n_features`` counts its ranking too. The rows are stored on the host: on the CPU they
    share ``memory_mb`` with the forward; a GPU's run checks them against the host's memory
    (:func:`~..memory.device_bytes`). :class:`MemoryCapError` when not one row (or not the
    requested rows) fits."""
    n = run.n_features
    cost, bounds, cones = _store_costs(run, order)
    encoder = run.encoder_rows.numel() * run.encoder_rows.element_size()
    if run.logits.device.type == "cpu":
        free = memory_mb * 2**20 - run.forward_bytes - encoder - batch * row_bytes(run)
        where = f"forward graph {run.forward_bytes / 2**20:,.0f} MB, "
    else:
        memory_mb = device_bytes(None) / 2**20
        free = memory_mb * 2**20
        where = "the host's memory: "
    if requested is not None:
        if requested < 0:
            raise InputError(f"max_feature_nodes must be >= 0, got {requested}")
        requested = min(requested, n)
        ranking = _ranking_bytes(cones, requested) if requested < n else 0.0
        if requested and float(cost[requested - 1]) + ranking > free:
            raise MemoryCapError(
                f"max_feature_nodes={requested} needs up to "
                f"{(float(cost[requested - 1]) + ranking + memory_mb * 2**20 - free) / 2**20:,.0f}"
                f" MB ({where}rows of up to "
                f"{int(bounds[:requested].sum()):,} entries, {ranking / 2**20:,.0f} MB to rank "
                f"them) and the memory cap is {memory_mb:,.0f} MB; raise memory_mb or lower "
                "max_feature_nodes")
        return requested
    fits = int((cost <= free).sum())
    if fits >= n:
        return n
    low, high = 0, fits  # the most rows that fit with their ranking (monotone in the rows)
    while low < high:
        middle = (low + high + 1) // 2
        if float(cost[middle - 1]) + _ranking_bytes(cones, middle) <= free:
            low = middle
        else:
            high = middle - 1
    fits = low
    if fits == 0:
        raise MemoryCapError(
            f"no feature row fits beside the forward graph ({run.forward_bytes / 2**20:.0f} MB) "
            f"in the memory cap of {memory_mb:.0f} MB; raise memory_mb or shorten the prompt")
    log.warning("attribution: %d of %d feature rows fit in memory_mb=%.0f; computing the %d "
                "most influential (set max_feature_nodes or raise memory_mb to change this)",
                fits, n, memory_mb, fits)
    return fits
