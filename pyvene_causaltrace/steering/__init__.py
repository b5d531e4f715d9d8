"""``intervene_features``: set transcoder features to chosen values, read the next-token logits
and generate with the features held — circuit-tracer's ``feature_intervention`` and
``feature_intervention_generate``, as registered pyvene interventions.

    result = intervene_features(model, tokenizer, clt, "The Eiffel Tower is in the city of",
                                [(20, 8, 1234, 10.0), (21, "all", 77, 0.0)], max_new_tokens=10)
    result.to_dataframe()                  # top tokens, clean and intervened
    result.generated_text, result.clean_generated_text
    result.spec                            # the JSON spec that reproduces the logits

The run is the model with the transcoder spliced in at every layer (``clt_splice``), each
``(layer, position, feature, value)`` a ``feature_ablate`` with ``value`` after its layer's
encoder, and optionally ``frozen_attention`` holding the clean run's patterns. What the
transcoder misses (its error) is held at the clean run's value on the prompt (``hold_errors``),
or kept live — the model's own MLP output plus what the set features change, which is what
circuit-tracer does. ``result.spec`` runs the same interventions through ``run_spec``.

:mod:`.settings` holds :class:`SteeringSettings`, :mod:`.run` the run and its result.
"""

from .run import FeatureInterventionResult, intervene_features
from .settings import SteeringSettings

__all__ = ["FeatureInterventionResult", "SteeringSettings", "intervene_features"]
