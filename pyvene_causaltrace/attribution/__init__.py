"""CLT attribution graphs: local replacement model, exact edges, reading, export, validation.

    from pyvene_causaltrace.attribution import attribute
    graph = attribute(model, tokenizer, transcoder, "The Eiffel Tower is in the city of", " Paris")
    graph.closure.relative            # ~1e-7 of what is summed: the edges sum to the target
    graph.to_json("eiffel.json")      # opens in the circuit-tracer / Neuronpedia viewer

Data flows one way: :mod:`.replacement_model` -> :mod:`.replacement` (the local replacement
forward) -> :mod:`.edges` (rows, closure; :mod:`.budget`) -> :mod:`.store` -> :mod:`.graph`
(:mod:`.graph_file`, :mod:`.checkpoint`, :mod:`.spread`) -> :mod:`.reading`, :mod:`.export`,
:mod:`.plots`; :mod:`.validate` ablates top features, :mod:`.faithfulness` measures MIB's
faithfulness curve (f(k), CPR, CMD), :mod:`.budget_curve` the feature-budget curve (PIE's);
:mod:`.heads` and :mod:`.qk` decompose edges and scores on the replayed run
(:mod:`.graph_replay`), :mod:`.attention` exports them."""

from ..errors import GraphFileError
from .attention import AttentionAnnotations, attention_annotations
from .attribute import attribute, make_target
from .budget import MemoryCapError
from .budget_curve import BudgetCurve, budget_curve
from .checkpoint import remove_checkpoint
from .edges import CLOSURE_TOLERANCE, Closure, ClosureError
from .faithfulness import FaithfulnessCurve, FaithfulnessSettings, faithfulness
from .graph import AttributionGraph
from .heads import HeadLoadings, head_loadings
from .lorsa_qk import trace_lorsa_qk
from .qk import QKAttribution, qk_attribution
from .replacement import ReplacementRun, pre_softcap_logits, run_local_replacement
from .replacement_model import PreparedPrompt, ReplacementModel
from .settings import AttributionSettings, ReadingSettings
from .targets import Target, demeaned_logit, logit_difference

__all__ = [
    "CLOSURE_TOLERANCE",
    "AttentionAnnotations",
    "AttributionGraph",
    "AttributionSettings",
    "BudgetCurve",
    "Closure",
    "ClosureError",
    "FaithfulnessCurve",
    "FaithfulnessSettings",
    "GraphFileError",
    "HeadLoadings",
    "MemoryCapError",
    "PreparedPrompt",
    "QKAttribution",
    "ReadingSettings",
    "ReplacementModel",
    "ReplacementRun",
    "Target",
    "pre_softcap_logits",
    "attention_annotations",
    "attribute",
    "budget_curve",
    "demeaned_logit",
    "faithfulness",
    "head_loadings",
    "logit_difference",
    "make_target",
    "qk_attribution",
    "remove_checkpoint",
    "run_local_replacement",
    "trace_lorsa_qk",
]
