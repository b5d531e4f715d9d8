"""``attribute``: prompt + answer -> :class:`~.graph.AttributionGraph`.

Phases on a :class:`~.replacement_model.ReplacementModel`: prepare (tokens, target, memory
check), one forward of the local replacement model, the target rows and their closure check,
then feature rows in batches (:mod:`.edges`) into a :class:`~.store.RowStore` — every feature
in node order, or under a budget the most influential by circuit-tracer's partial influence,
re-ranked as rows arrive (unexplored features stay as leaves). docs/attribution.md has the
whole story."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from ..arguments import MemoryMB, PositiveInt, Probability, Text
from ..errors import InputError
from ..fingerprint import package_version
from ..finite import check_finite
from ..meter import phase
from ..model_guard import measured
from ..runlock import single_writer
from ..transcoders.lorsa import LorsaSet
from ..transcoders.transcoder import Transcoder
from .budget import batch_size_for, check_batch_fits, feature_budget, store_bytes
from .checkpoint import Checkpoint, remove_checkpoint, tensor_digest
from .edges import (
    Closure,
    closure_error,
    closure_tolerance,
    feature_rows,
    feature_rows_loop,
    feature_targets_and_magnitudes,
    row_closures,
    target_rows,
)
from .graph import AttributionGraph
from .lorsa_nodes import lorsa_metadata
from .precision import deterministic_algorithms, dtype_name
from .reading import Layout, influence, logit_weights
from .replacement import ReplacementRun
from .replacement_model import PreparedPrompt, ReplacementModel
from .settings import AttributionSettings
from .spread import Spread
from .store import RowStore
from .targets import Target, make_target

if TYPE_CHECKING:  # transformers takes seconds to import; only the annotations need it
    from transformers import PreTrainedTokenizerBase

__all__ = ["attribute", "make_target", "steering_metadata"]

#: ``attribute()``'s keyword defaults: :class:`~.settings.AttributionSettings`'.
_DEFAULT = AttributionSettings()

#: How often a checkpointed run saves its rows.
SAVE_EVERY_S = 30.0
#: At most this many rankings per graph: each reads every stored row, so on big graphs the
#: queue between rankings grows to budget / RERANKS rows.
RERANKS = 16


class _Ranking:
    """Which feature rows to compute next: all in node order, or by partial influence."""

    def __init__(self, run: ReplacementRun, layout: Layout, weights: torch.Tensor, budget: int,
                 queue: int) -> None:
        self.n = run.n_features
        self.weights = logit_weights(layout, weights)
        self.budget = budget
        self.queue = queue

    def next_queue(self, store: RowStore, done: torch.Tensor) -> torch.Tensor:
        """Unexplored features to compute next (``done``: bool per feature)."""
        if self.budget >= self.n:
            return (~done).nonzero().squeeze(-1)
        estimate = influence(store, self.weights)[:self.n]
        order = estimate.argsort(descending=True, stable=True)
        left = self.budget - int(done.sum())
        return order[~done[order]][:min(self.queue, left)]


@measured(interventions=True)  # one graph per model at a time, in eval mode
def attribute(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, transcoder: Transcoder, prompt: Text,
    answer: Text | None = None, *, target: str | Target | torch.Tensor = _DEFAULT.target,
    other: Text | None = _DEFAULT.other, k: PositiveInt = _DEFAULT.k,
    max_n_logits: PositiveInt | None = _DEFAULT.max_n_logits,
    desired_logit_prob: Probability | None = _DEFAULT.desired_logit_prob,
    bos_errors: str = _DEFAULT.bos_errors, bos: str = _DEFAULT.bos,
    max_feature_nodes: PositiveInt | None = _DEFAULT.max_feature_nodes,
    memory_mb: MemoryMB = _DEFAULT.memory_mb, batch_size: PositiveInt | None = _DEFAULT.batch_size,
    max_batch: PositiveInt | None = _DEFAULT.max_batch,
    update_interval: PositiveInt = _DEFAULT.update_interval,
    freeze: bool = _DEFAULT.freeze, loop: bool = _DEFAULT.loop, progress: bool = False,
    checkpoint: str | Path | None = None, keep_checkpoint: bool = True,
    check_closure: bool = _DEFAULT.check_closure,
    compute_dtype: str | torch.dtype | None = _DEFAULT.compute_dtype,
    deterministic: bool = _DEFAULT.deterministic, settings: AttributionSettings | None = None,
    attention: LorsaSet | None = None,
) -> AttributionGraph:
    """The attribution graph of ``prompt``'s next token through ``transcoder``.

    Targets (:mod:`.targets`): with ``answer`` (one token), one logit of kind ``target``;
    without one, circuit-tracer's salient logits; or a direction. The settings (target,
    budget, ``bos``, ...) are :class:`~.settings.AttributionSettings`' fields, as keywords or
    all at once as ``settings`` (a keyword that contradicts it is refused); too big a prompt
    raises :class:`~.budget.MemoryCapError` before it runs. ``checkpoint`` (a directory) saves
    rows as they come and resumes from them (another graph's raises
    :class:`~pyvene_causaltrace.errors.CheckpointMismatchError`); it is kept on return unless
    ``keep_checkpoint=False``. On a ``pv.IntervenableModel`` the graph is of the model with its
    interventions applied, their constant parts as steering nodes. Every row must close to
    :data:`~.edges.CLOSURE_TOLERANCE` or :class:`~.edges.ClosureError` is raised
    (``check_closure=False`` returns the graph anyway); a ``compute_dtype="bfloat16"`` graph's
    rows to :data:`~.edges.BF16_CLOSURE_TOLERANCE` (:mod:`.precision`). ``deterministic``:
    torch's deterministic algorithms on for the call, so two runs are bit-identical.
    ``attention`` (a :func:`~..transcoders.lorsa.load_lorsa` set) replaces those layers'
    attention by Lorsa: its OV heads are feature nodes, its errors error nodes
    (:mod:`.lorsa_nodes`). Details:
    docs/attribution.md."""
    if not prompt:
        raise InputError("the prompt is empty")
    s = AttributionSettings.merged(
        settings, target=target, other=other, k=k, max_n_logits=max_n_logits,
        desired_logit_prob=desired_logit_prob, bos_errors=bos_errors, bos=bos,
        max_feature_nodes=max_feature_nodes, memory_mb=memory_mb, batch_size=batch_size,
        max_batch=max_batch, update_interval=update_interval, freeze=freeze, loop=loop,
        check_closure=check_closure, compute_dtype=dtype_name(compute_dtype),
        deterministic=deterministic).check_answer(answer)
    with deterministic_algorithms() if s.deterministic else contextlib.nullcontext():
        return _attribute(model, tokenizer, transcoder, prompt, answer, s, progress=progress,
                          checkpoint=checkpoint, keep_checkpoint=keep_checkpoint,
                          attention=attention)


def _attribute(model: nn.Module, tokenizer: PreTrainedTokenizerBase, transcoder: Transcoder,
               prompt: str, answer: str | None, s: AttributionSettings, *, progress: bool,
               checkpoint: str | Path | None, keep_checkpoint: bool,
               attention: LorsaSet | None = None) -> AttributionGraph:
    """:func:`attribute` of merged, checked settings ``s``."""
    max_n_logits, desired_logit_prob = s.salient()
    start = time.perf_counter()
    replacement = ReplacementModel(model, tokenizer, transcoder, bos=s.bos, attention=attention)
    replacement.check_bos_errors(s.bos_errors)
    spread = Spread.of(replacement, prompt, answer, s)
    prepared = replacement.prepare(prompt, answer, settings=s)
    if spread is not None and spread.mode == "features":  # every rank's features count
        prepared = replace(prepared, active_counts=spread.ranks.all_reduce(
            prepared.active_counts, "counting the active features"))
    replacement.check_memory(prepared.input_ids, s.memory_mb, prepared.active_counts)
    with phase("forward"):
        run = replacement.run(prepared.input_ids, freeze=s.freeze, states=prepared.states,
                              bos_errors=s.bos_errors, compute_dtype=s.compute_dtype)
    with phase("target_rows"):
        top = _target_rows(run, prepared.targets, s)
    forward_s = time.perf_counter() - start
    plan = _plan(run, top, s, spread)
    key = _run_key(replacement, run, prepared.targets, plan.settings, spread)
    store, resumed, ranking_s = _feature_rows(
        run, top, plan, key, s, checkpoint=checkpoint, keep_checkpoint=keep_checkpoint,
        progress=progress, spread=spread)
    seconds = {"total": time.perf_counter() - start, "forward": forward_s, "ranking": ranking_s}
    seconds["rows"] = seconds["total"] - seconds["forward"] - seconds["ranking"]
    goal = prepared.target
    if not goal.is_logit:
        selection = {"direction": goal.name, "output": goal.output, "position": goal.position}
    elif answer is not None or s.target == "difference":
        selection = {"answer": answer, "kind": s.target}
    else:
        selection = {"kind": s.target, "max_n_logits": max_n_logits,
                     "desired_logit_prob": desired_logit_prob, "chosen": len(prepared.targets),
                     "probability": float(sum(t.prob for t in prepared.targets))}
    return _graph(replacement, prepared, run, top, store, plan, s, resumed=resumed,
                  seconds=seconds, selection=selection, spread=spread,
                  fingerprints={name: key[name] for name in ("model", "transcoder", "lorsa")
                                if name in key})


@dataclass(frozen=True)
class _TargetRows:
    """The targets' rows (``[K, n_columns]``, logit node order), constants, closures and
    weights, and the user's edits the graph cannot see (named in a closure error)."""

    rows: torch.Tensor
    constants: torch.Tensor
    closures: list[Closure]
    weights: torch.Tensor
    hidden: list[str]

    def weighted(self) -> torch.Tensor:
        """``sum_i w_i * row_i / sum_i w_i``: the direct effects on the weighted mean target
        (:meth:`~.graph.AttributionGraph.target_row`)."""
        weights = self.weights / self.weights.sum()
        return (weights[:, None] * self.rows.detach().double().cpu()).sum(0)


def _target_rows(run: ReplacementRun, goals: tuple[Target, ...],
                 s: AttributionSettings) -> _TargetRows:
    """The targets' rows by one batched backward, checked finite and (with
    ``s.check_closure``) closed."""
    rows, constants, closures = target_rows(run, goals)
    check_finite(rows, "the targets' attribution rows",
                 "the transcoder's features or the replacement model's gradients overflow")
    hidden = [f"{e.site.key} ({e.site.intervention} at {e.site.component or e.site.module})"
              for e in run.steering if not e.reached]
    if s.check_closure:
        for goal, closure in zip(goals, closures, strict=True):
            if not closure.ok:
                what = "the target row" if len(goals) == 1 else f"the row of target {goal.name}"
                raise closure_error(what, closure, freeze=s.freeze, hidden=hidden)
    weights = torch.tensor([g.weight for g in goals], dtype=torch.float64)
    return _TargetRows(rows, constants, closures, weights, hidden)


@dataclass(frozen=True)
class _Plan:
    """Rows per backward, feature rows to compute, their order, and the settings a
    checkpoint's rows must share."""

    size: int
    budget: int
    ranking: _Ranking
    settings: dict


def _plan(run: ReplacementRun, top: _TargetRows, s: AttributionSettings,
          spread: Spread | None = None) -> _Plan:
    """Fit the batch and the feature budget to ``s.memory_mb`` (:mod:`.budget`); across ranks,
    the smallest rank's."""
    # the first queue's order: circuit-tracer's partial influence of the logit rows alone
    logit_rows = top.rows.detach().abs().double().cpu()
    normalized = logit_rows / logit_rows.sum(1, keepdim=True).clamp(min=1e-30)
    first_guess = (top.weights[:, None] * normalized[:, :run.n_features]).sum(0) \
        .argsort(descending=True)
    if s.batch_size is not None:
        check_batch_fits(run, s.memory_mb, s.batch_size)
    # a budget's rows first, where they share the device (the CPU), then the batch
    reserve = 0 if s.max_feature_nodes is None else store_bytes(run, s.max_feature_nodes,
                                                                first_guess)
    size = s.batch_size or batch_size_for(run, s.memory_mb, s.max_batch, reserve)
    if spread is not None:
        size = int(spread.ranks.all_reduce(torch.tensor([size]), "agreeing on the batch",
                                           op="min"))
    budget = feature_budget(run, s.memory_mb, size, s.max_feature_nodes, first_guess)
    if spread is not None:
        budget = int(spread.ranks.all_reduce(torch.tensor([budget]), "agreeing on the budget",
                                             op="min"))
    ranking = _Ranking(run, replace(run.layout, n_logits=len(top.weights)), top.weights, budget,
                       max(s.update_interval * size, -(-budget // RERANKS)))
    return _Plan(size, budget, ranking, {"freeze": s.freeze, "budget": budget, "batch": size,
                                         "loop": s.loop, "update_interval": s.update_interval,
                                         "dtype": str(run.compute_dtype)})


def _run_key(replacement: ReplacementModel, run: ReplacementRun, goals: tuple[Target, ...],
             settings: dict, spread: Spread | None = None) -> dict:
    """What must match for saved rows to belong to this graph (a distributed run's: the same
    world size and mode, and every rank's transcoder shard)."""
    fingerprints = replacement.fingerprints()
    distributed = None
    if spread is not None:
        distributed = {"world": spread.ranks.world, "mode": spread.mode}
        if spread.mode == "features":
            fingerprints["transcoder"] = spread.ranks.gather_objects(
                fingerprints["transcoder"], "gathering the transcoder shards' fingerprints")
            if "lorsa" in fingerprints:
                fingerprints["lorsa"] = spread.ranks.gather_objects(
                    fingerprints["lorsa"], "gathering the Lorsa shards' fingerprints")
    return {"input_ids": run.input_ids[0].tolist(),
            "target": [goal.describe() for goal in goals], "bos_errors": run.bos_errors,
            "from_position": replacement.from_position, "distributed": distributed,
            **fingerprints, "version": package_version(), **settings,
            "features": tensor_digest(run.feature_layer, run.feature_position, run.feature_id),
            "steering": [{**s.site.describe(), "value": tensor_digest(s.value)}
                         for s in run.steering]}


def _feature_rows(run: ReplacementRun, top: _TargetRows, plan: _Plan, key: dict,
                  s: AttributionSettings, *, checkpoint: str | Path | None,
                  keep_checkpoint: bool, progress: bool,
                  spread: Spread | None = None) -> tuple[RowStore, int, float]:
    """The target rows and ``plan.budget`` feature rows in a store, resumed from and saved to
    ``checkpoint``; returns the store, the rows it resumed and the seconds spent ranking.
    Across ranks (``spread``) rank 0 reads and writes the checkpoint and chooses each queue;
    every rank holds every row."""
    n, ranking_s = run.n_features, 0.0
    writer = spread is None or spread.ranks.first
    checkpoint_dir = checkpoint if writer else None
    lock = single_writer(checkpoint_dir) if checkpoint_dir is not None \
        else contextlib.nullcontext()
    with lock:
        store_file = Checkpoint(checkpoint_dir, key, SAVE_EVERY_S)
        restored = store_file.load(run.n_columns, n, len(top.closures))
        if spread is not None and checkpoint is not None:
            restored = spread.ranks.broadcast_object(restored, "sharing the checkpoint's rows")
        resumed = 0 if restored is None else restored[0].n_rows
        if restored is None:
            store, pending = RowStore(run.n_columns), torch.zeros(0, dtype=torch.long)
            store.append(run.n_columns + torch.arange(len(top.closures)), top.rows,
                         top.constants, torch.tensor([c.target for c in top.closures]))
        else:
            store, pending = restored
        done = torch.zeros(n, dtype=torch.bool)
        done[store.nodes[store.nodes < n]] = True

        bar = tqdm(total=plan.budget, initial=int(done.sum()), desc="feature rows", unit="row",
                   disable=not (progress and writer))
        compute = feature_rows_loop if s.loop else feature_rows
        on = run.feature_layer.device
        in_flight = pending[:0]  # rows being computed: back in the queue if Ctrl-C comes
        try:
            while int(done.sum()) < plan.budget:
                if len(pending) == 0:
                    start = time.perf_counter()
                    with phase("ranking"):
                        pending = plan.ranking.next_queue(store, done)
                    if spread is not None:  # rank 0's choice: ranks must not drift apart
                        pending = spread.ranks.broadcast_object(pending, "sharing the queue")
                    ranking_s += time.perf_counter() - start
                chunk, pending = pending[:plan.size], pending[plan.size:]
                in_flight = chunk
                with phase("rows"):
                    if spread is None:
                        rows, constants = compute(run, chunk.to(on))
                    else:
                        rows, constants = spread.rows(compute, run, chunk.to(on))
                check_finite(rows, f"the attribution rows of features {chunk[:4].tolist()}...")
                with torch.no_grad():
                    targets, magnitudes = feature_targets_and_magnitudes(run, chunk.to(on))
                if s.check_closure:
                    _check_rows(run, chunk, rows, constants, targets, magnitudes, s.freeze,
                                top.hidden)
                with phase("store"):
                    store.append(chunk, rows, constants, targets, magnitudes)
                in_flight = pending[:0]
                done[chunk] = True
                store_file.maybe_save(store, pending)
                bar.update(len(chunk))
        except KeyboardInterrupt:  # keep every finished row; the unfinished ones come first next
            store_file.maybe_save(store, torch.cat([in_flight, pending]), force=True)
            raise
        bar.close()
        store_file.maybe_save(store, pending, force=True)
    if checkpoint is not None and not keep_checkpoint and writer:
        remove_checkpoint(checkpoint)
    return store, resumed, ranking_s


def _graph(replacement: ReplacementModel, prepared: PreparedPrompt, run: ReplacementRun,
           top: _TargetRows, store: RowStore, plan: _Plan, s: AttributionSettings, *,
           resumed: int, seconds: dict, selection: dict, spread: Spread | None = None,
           fingerprints: dict | None = None) -> AttributionGraph:
    """The graph of the computed rows, with what its reader needs to know in ``metadata``."""
    tokenizer, ids, goals, cap = (replacement.tokenizer, prepared.input_ids, prepared.targets,
                                  prepared.softcap)
    targets = [{**goal.describe(),
                "text": tokenizer.decode([goal.token]) if goal.is_logit else goal.name}
               for goal in goals]
    first = targets[0]
    return AttributionGraph(
        prompt=prepared.text, tokens=[tokenizer.decode([i]) for i in ids[0].tolist()],
        input_ids=ids[0].tolist(), target={k: first[k] for k in ("name", "token",
                                                                 "coefficients")},
        answer=first["text"],
        answer_prob=float("nan") if first["prob"] is None else first["prob"],
        n_layers=run.n_layers, feature_layer=run.feature_layer.cpu(),
        feature_position=run.feature_position.cpu(), feature_id=run.feature_id.cpu(),
        activation=run.activation.float().cpu(), rows=store, closure=top.closures[0],
        steering=[{**edit.site.describe(), "positions": positions.tolist()}
                  for edit, positions in zip(run.steering_leaves, run.steering_positions,
                                             strict=True)],
        targets=targets,
        metadata={**replacement.describe(ids), "frozen": s.freeze, "fingerprints": fingerprints,
                  "logit_softcap": None if cap is None else {
                      "cap": cap, "target": "pre-soft-cap logits (cap off while the graph was "
                                            "built, restored after)"},
                  "targets": selection,
                  "bos_errors": {"keep": "kept: the position-0 errors are nodes",
                                 "drop": "dropped: the position-0 errors are constants, not "
                                         "nodes (circuit-tracer's convention)"}[run.bos_errors],
                  "batch_size": plan.size, "max_feature_nodes": plan.budget,
                  "active_features": run.n_features, "forward_mb": run.forward_bytes / 2**20,
                  "rows_mb": store.nbytes / 2**20, "seconds": seconds,
                  "max_logit_change": float((run.logits.detach()
                                             - prepared.target_logits).abs().max()),
                  "steering": steering_metadata(run, top.weighted()),
                  "closure_checked": s.check_closure, "rows_resumed": resumed,
                  "dtype": precision_metadata(run, replacement.model,
                                              top.closures[0].tolerance),
                  "deterministic": torch.are_deterministic_algorithms_enabled(),
                  "rows_computed": store.n_rows - resumed,
                  "lorsa": lorsa_metadata(replacement.lorsa, run),
                  "distributed": None if spread is None
                  else spread.describe(replacement.transcoder, replacement.lorsa)})


def precision_metadata(run: ReplacementRun, model: nn.Module, tolerance: float) -> dict:
    """What a graph's metadata says of its precision (:mod:`.precision`): the dtype it was
    computed in, whether under autocast (a lower dtype than the model's), where it sums wider
    and the closure tolerance its rows were held to."""
    model_dtype = next(model.parameters()).dtype
    name = str(run.compute_dtype).removeprefix("torch.")
    return {"compute": name, "model": str(model_dtype).removeprefix("torch."),
            "autocast": run.compute_dtype != model_dtype, "closure_tolerance": tolerance,
            "sums": "edges and their sums in float32 at least, closures in float64"}


def steering_metadata(run: ReplacementRun, logit_row: torch.Tensor) -> list[dict]:
    """What a graph's reader needs to know about the user's interventions: each one's class,
    component, module, layer, steering node count and direct contribution to the target; one
    without a node says why."""
    out, start = [], run.layout.steering.start
    leaves = iter(run.steering_positions)
    for s in run.steering:
        entry = s.site.describe()
        if s.leaf is None:
            entry.update(nodes=0, contribution=None, note=(
                "no constant part (f(0) = 0)" if s.is_zero else
                "edits an output the local replacement model replaces (token embedding "
                "leaf, MLP reconstruction + error, frozen attention or norm): its effect is "
                "inside that node, or the graph does not close"))
        else:
            n = len(next(leaves))
            entry.update(nodes=n, contribution=float(logit_row[start:start + n].double().sum()))
            start += n
        out.append(entry)
    return out


def _check_rows(run: ReplacementRun, chunk: torch.Tensor, rows: torch.Tensor,
                constants: torch.Tensor, targets: torch.Tensor, magnitudes: torch.Tensor,
                freeze: bool, hidden: list[str]) -> None:
    """Raise :class:`~.edges.ClosureError` for the worst of these feature rows if it does not
    close."""
    relative = row_closures(rows, constants, targets, magnitudes)
    worst = int(relative.argmax())
    tolerance = closure_tolerance(run.compute_dtype)
    if float(relative[worst]) <= tolerance:
        return
    row = rows[worst].detach().double()
    closure = Closure(float(targets[worst]), float(row.sum()), float(constants[worst]),
                      float(row.abs().sum() + abs(constants[worst]) + abs(targets[worst])
                            + magnitudes[worst]), tolerance)
    node = int(chunk[worst])
    name = (f"the row of feature {int(run.feature_id[node])} (layer "
            f"{int(run.feature_layer[node])}, position {int(run.feature_position[node])})")
    raise closure_error(name, closure, freeze=freeze, hidden=hidden)
