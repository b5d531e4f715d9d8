"""Attribution graphs over a dataset run: each kept fact's graph beside its traces.

    clt = load_transcoder("~/.cache/pyvene_causaltrace/transcoders/smollm2-135m-skip-plt-256-top16")
    trace_dataset(model, tokenizer, records, out="runs/known", transcoder=clt,
                  graph_options=GraphSettings(max_feature_nodes=2000))

A fact's graph (:func:`~pyvene_causaltrace.attribution.attribute`) explains the token its trace
scores (the prompt and target as the screen split them). Its ``graphs.jsonl`` line
(:func:`graph_row`) keeps what the aggregate reads and drops the graph: sizes, closure and
quality scores, seconds, and per part the ``[layer][position]`` influence share of the MLP
sublayer's nodes (:func:`~pyvene_causaltrace.crosscheck.sites.site_influence`, ``share=True``,
so grids of different prompts average). ``settings.save`` also keeps each graph as
``graphs/<index>.safetensors``, written before its row. The manifest records the transcoder's
fingerprint and :meth:`GraphSettings.to_manifest`, so a resume that differs is refused
(docs/datasets.md, "Attribution graphs beside the traces").

With ``faithfulness`` (a :class:`~..attribution.settings.FaithfulnessSettings`) each fact's row
also carries its graph's faithfulness curve (:func:`~..attribution.faithfulness.faithfulness`:
f(k), the random band, CPR and CMD), measured before the row is written, so a resumed run
never loses or recomputes one. Its counterfactual (:func:`counterfactuals`): with MIB's
``ablation="counterfactual"``, the next kept fact in the run's order (wrapping around) whose
prompt has as many tokens and another answer token, whose answer is the logit difference's foil;
a fact without one gets ``"faithfulness": null`` and the reason. ``"mean"`` takes the mean over
the next :data:`MEAN_REFERENCES` other kept facts' prompts (their tokens from the graph's first
spliced position on), ``"zero"`` nothing; neither gives a foil, so both read ``metric="prob"``
or ``"kl"``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from .._settings import Settings
from ..arguments import MemoryMB, PositiveInt
from ..attribution import attribute
from ..attribution.faithfulness import faithfulness as measure_faithfulness
from ..attribution.settings import AttributionSettings, FaithfulnessSettings
from ..crosscheck.sites import SITE_PARTS, site_influence
from ..defaults import DATASET_SAVE_GRAPHS
from ..errors import InputError, UndefinedCurveError
from ..fingerprint import transcoder_fingerprint
from ..prompts import tokenize_prompt
from ..tracing.results import finite_or_none
from ..transcoders import Transcoder, check_fits
from .records import FactRecord

if TYPE_CHECKING:  # transformers is slow to import; annotations only
    from transformers import PreTrainedTokenizerBase as Tokenizer

__all__ = ["GRAPH_DIR", "GRAPH_TARGETS", "GraphSettings", "check_faithfulness",
           "counterfactuals", "graph_manifest", "graph_row"]

#: Where ``GraphSettings(save=True)`` keeps each fact's graph, inside the run directory.
GRAPH_DIR = "graphs"
#: How many other kept facts' prompts (the next ones, wrapping around) a fact's
#: ``ablation="mean"`` averages over.
MEAN_REFERENCES = 8
#: Targets a dataset graph may explain: both read only the fact's own answer.
GRAPH_TARGETS = ("demeaned", "demeaned_vocab")


@dataclass(frozen=True)
class GraphSettings(Settings):
    """How each fact's graph is built (arguments of :func:`~..attribution.attribute`; the
    defaults are :class:`~..attribution.settings.AttributionSettings`').

    ``target``: ``"demeaned"`` (minus the top-``k`` mean) or ``"demeaned_vocab"``;
    ``max_feature_nodes``: feature rows per graph, the most influential (``None``: every
    active feature whose row fits ``memory_mb``); ``memory_mb``: the graph's memory cap;
    ``bos``: how position 0 is treated (``"auto"``: as BOS only when the tokenizer prepends
    one; ``"always"``: circuit-tracer's convention; ``"never"``), in the manifest, so a run made
    before the BOS rule or under another one is never resumed with it;
    ``save``: keep each graph under ``graphs/`` (an output choice, not in the manifest).
    Refused when made: what :class:`~..attribution.settings.AttributionSettings` refuses, and a
    target that needs more than the fact's answer."""

    target: str = AttributionSettings.target
    k: PositiveInt = AttributionSettings.k
    max_feature_nodes: PositiveInt | None = AttributionSettings.max_feature_nodes
    memory_mb: MemoryMB = AttributionSettings.memory_mb
    bos: str = AttributionSettings.bos
    save: bool = DATASET_SAVE_GRAPHS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target not in GRAPH_TARGETS:
            raise InputError(f"graph target must be one of {', '.join(GRAPH_TARGETS)} (a "
                             f"dataset graph explains the fact's own answer), got "
                             f"{self.target!r}")
        self.attribution()  # checked as attribute() checks it

    def attribution(self) -> AttributionSettings:
        """The :class:`~..attribution.settings.AttributionSettings` of each fact's graph (the
        others at their defaults)."""
        return AttributionSettings(target=self.target, k=self.k,
                                   max_feature_nodes=self.max_feature_nodes,
                                   memory_mb=self.memory_mb, bos=self.bos)

    def to_manifest(self) -> dict:
        """The settings a resumed run must share (everything that changes a graph)."""
        return {"target": self.target, "k": self.k, "max_feature_nodes": self.max_feature_nodes,
                "memory_mb": float(self.memory_mb), "bos": self.bos}


def graph_manifest(model: nn.Module, transcoder: Transcoder, settings: GraphSettings,
                   faithfulness: FaithfulnessSettings | None = None) -> dict:
    """The manifest keys of a run with graphs, once ``transcoder`` is checked to fit ``model``
    (:class:`~pyvene_causaltrace.errors.TranscoderMismatchError` if not); with
    ``faithfulness``, its settings (all but ``batch_size`` and the budget curve's ``budgets``,
    which change no number here) under ``graphs.faithfulness``, so a resume with other (or no)
    curves is refused."""
    check_fits(model, transcoder)
    graphs = settings.to_manifest()
    if faithfulness is not None:
        graphs["faithfulness"] = {**{k: v for k, v in asdict(faithfulness).items()
                                     if k not in ("batch_size", "budgets")},
                                  "sizes": list(faithfulness.sizes)}
    return {"transcoder": transcoder_fingerprint(transcoder), "graphs": graphs}


def check_faithfulness(settings: FaithfulnessSettings) -> None:
    """Refuse what a dataset run cannot measure: the logit difference without a counterfactual
    fact (its foil is that fact's answer)."""
    if settings.ablation != "counterfactual" and settings.metric == "logit_diff":
        raise InputError(f"metric: the logit difference's foil is the counterfactual fact's "
                         f"answer; with ablation={settings.ablation!r} there is none: choose "
                         "metric 'prob' or 'kl', or ablation 'counterfactual'")


def counterfactuals(tokenizer: Tokenizer, kept: list[dict], settings: FaithfulnessSettings
                    ) -> dict[str, dict | list[dict] | str | None]:
    """What each kept fact's curve is patched from (module docstring): ``{fact: the
    counterfactual fact's screen line}``, or the reason there is none (a string); with
    ``ablation="mean"`` the reference facts' lines (a list); ``None`` for ``"zero"``."""
    if settings.ablation == "zero":
        return {line["fact"]: None for line in kept}
    if settings.ablation == "mean":
        n = min(MEAN_REFERENCES, len(kept) - 1)
        return {line["fact"]: [kept[(i + step) % len(kept)] for step in range(1, n + 1)]
                or "no other kept fact to average over" for i, line in enumerate(kept)}
    lengths = [len(ids) for ids in tokenizer([line["prompt"] for line in kept])["input_ids"]]
    answers = [line["target_id"] for line in kept]
    out: dict[str, dict | str | None] = {}
    for i, line in enumerate(kept):
        others = [(i + step) % len(kept) for step in range(1, len(kept))]
        match = next((j for j in others if lengths[j] == lengths[i]
                      and answers[j] != answers[i]), None)
        out[line["fact"]] = kept[match] if match is not None else (
            f"no other kept fact has a {lengths[i]}-token prompt and another answer")
    return out


def _curve(model, tokenizer, transcoder, graph, settings: FaithfulnessSettings,
           counterfactual: dict | list[dict] | str | None) -> dict:
    """The row's ``faithfulness`` entries: the curve's summary (with the curve), the
    counterfactual fact (or the mean's reference facts), the forwards run; or ``None`` and the
    reason."""
    if isinstance(counterfactual, str):
        return {"faithfulness": None, "faithfulness_skipped": counterfactual}
    prompt = foil = reference = None
    if isinstance(counterfactual, list):
        reference = [line["prompt"] for line in counterfactual]
    elif counterfactual is not None:
        prompt, foil = counterfactual["prompt"], int(counterfactual["target_id"])
    try:
        curve = measure_faithfulness(model, tokenizer, transcoder, graph, prompt,
                                     reference=reference,
                                     foil=foil if settings.metric == "logit_diff" else None,
                                     settings=settings)
    except UndefinedCurveError as error:  # this fact's, not the run's: the others go on
        return {"faithfulness": None, "faithfulness_skipped": str(error)}
    return {"faithfulness": {
        **curve.summary(), "n_items": curve.n_items, "forwards": curve.forwards,
        "counterfactual": counterfactual["fact"] if isinstance(counterfactual, dict) else None,
        **({"reference": [line["fact"] for line in counterfactual]} if reference else {})}}


def graph_row(model: nn.Module, tokenizer: Tokenizer, transcoder: Transcoder, line: dict,
              record: FactRecord, settings: GraphSettings,
              save_dir: Path | None = None, *,
              faithfulness: FaithfulnessSettings | None = None,
              counterfactual: dict | list[dict] | str | None = None, built=None) -> dict:
    """The ``graphs.jsonl`` line of the fact screened as ``line`` (module docstring); with
    ``save_dir``, the graph is first saved there as ``<index>.safetensors``; with
    ``faithfulness``, its curve against ``counterfactual`` (:func:`counterfactuals`' entry for
    the fact) is in the row and the saved graph's metadata. ``built()`` is called once the
    graph is built (a progress step)."""
    tokenized = tokenize_prompt(tokenizer, line["prompt"], record.subject, record.occurrence)
    graph = attribute(model, tokenizer, transcoder, line["prompt"], line["target"],
                      settings=settings.attribution())
    if graph.n_pos != tokenized.seq_len:
        raise InputError(f"fact {record.id}: the graph reads {graph.n_pos} tokens, the trace "
                         f"{tokenized.seq_len}")
    curve = {}
    if faithfulness is not None:
        if built is not None:
            built()
        curve = _curve(model, tokenizer, transcoder, graph, faithfulness, counterfactual)
        if curve["faithfulness"] is not None:
            graph.metadata["faithfulness"] = curve["faithfulness"]
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        graph.save(save_dir / f"{line['index']}.safetensors")
    scores = graph.scores()
    return {
        "index": line["index"], "fact": record.id, "tokens": list(graph.tokens),
        "subject_range": list(tokenized.subject_range), "answer": graph.answer,
        "answer_prob": float(graph.answer_prob), "n_features": graph.n_features,
        "n_explored": graph.n_explored, "closure": float(graph.closure.relative),
        "feature_closure": float(graph.feature_closure()),
        **{key: finite_or_none(float(scores[key]))  # NaN (a target of 0 has no shares): null
           for key in ("error_share", "replacement", "completeness", "unexplored_influence")},
        "seconds": float(graph.metadata["seconds"]["total"]),
        "influence": {part: site_influence(graph, part, share=True).tolist()
                      for part in SITE_PARTS},
        **curve,
    }
