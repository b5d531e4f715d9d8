"""``intervene_features``: set transcoder features to chosen values, read the next-token logits
and generate with the features held — circuit-tracer's ``feature_intervention`` and
``feature_intervention_generate``, as registered pyvene interventions (``clt_splice``,
``feature_ablate``, optionally ``frozen_attention``).

    result = intervene_features(model, tokenizer, clt, "The Eiffel Tower is in the city of",
                                [(20, 8, 1234, 10.0), (21, "all", 77, 0.0)], max_new_tokens=10)
    result.to_dataframe(), result.generated_text, result.spec"""

from .run import FeatureInterventionResult, intervene_features
from .settings import SteeringSettings

__all__ = ["FeatureInterventionResult", "SteeringSettings", "intervene_features"]
