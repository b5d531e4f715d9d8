"""CLT attribution graphs: local replacement model, exact edges, reading, export, validation.

    from pyvene_causaltrace.attribution import attribute
    graph = attribute(model, tokenizer, transcoder, "The Eiffel Tower is in the city of", " Paris")
    graph.closure.relative            # ~1e-7 of what is summed: the edges sum to the target
    graph.direct_attributions(10)
    graph.to_json("eiffel.json")      # opens in the circuit-tracer / Neuronpedia viewer

Data flows one way: :mod:`.replacement_model` (the model, tokenizer and transcoder, checked
once) -> :mod:`.replacement` (one forward of the local replacement model) ->
:mod:`.edges` (rows of the adjacency, closure; :mod:`.budget` plans their memory) ->
:mod:`.store` (sparse rows) -> :mod:`.graph` (the result object, its file
:mod:`.graph_file`; :mod:`.checkpoint` for interrupted runs, :mod:`.spread` for a run over
several ranks) -> :mod:`.reading` (influence, pruning, scores), :mod:`.export`, :mod:`.plots`;
:mod:`.validate` ablates the graph's top features in the real (spliced) model;
:mod:`.heads` splits edges by attention head and :mod:`.qk` a head's score into QK terms, both
on the graph's replayed run (:mod:`.graph_replay`); :mod:`.attention` puts both into the
export.
"""

from ..errors import GraphFileError
from .attention import AttentionAnnotations, attention_annotations
from .attribute import attribute, make_target
from .budget import MemoryCapError
from .checkpoint import remove_checkpoint
from .edges import CLOSURE_TOLERANCE, Closure, ClosureError
from .graph import AttributionGraph
from .heads import HeadLoadings, head_loadings
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
    "Closure",
    "ClosureError",
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
    "demeaned_logit",
    "head_loadings",
    "logit_difference",
    "make_target",
    "qk_attribution",
    "remove_checkpoint",
    "run_local_replacement",
]
