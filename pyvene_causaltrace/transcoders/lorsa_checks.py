"""Is a Lorsa set the model's? What :func:`~.lorsa.check_lorsa_fits` reads beside the width
and the layers: the model the set was fitted on and the shape of its QK heads. Where
``fit.json`` (``fit-lorsa`` writes it beside the set's layer directories) records the
fingerprint of the model's own weights (:func:`~..fingerprint.model_fingerprint`), the set is
that model's, wherever the model was loaded from. Otherwise (no record, other weights: a
fine-tuned or edited copy, another dtype) the names decide (``lm_config.json``'s
``model_name``, :func:`names_match`), as for any transcoder: the error nodes keep a graph exact
whatever the weights. Each refusal is a :class:`~..errors.TranscoderMismatchError` naming the
file and the field, so the command line prints it as one ``error:`` line."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..errors import TranscoderMismatchError
from ..models import model_name
from .formats.common import read_json_object

#: What ``fit-lorsa`` writes beside a set's layer directories (:mod:`..fit_output`'s record).
FIT_RECORD = "fit.json"


def _short(name: str) -> str:
    """A model's name as compared: the last part of a hub id or path, lower case."""
    return PurePosixPath(name.strip().rstrip("/")).name.lower()


def names_match(lorsa_name: str, model: str) -> bool:
    """Whether the model a Lorsa was made for is ``model``: the last part of each name, case
    aside, one the start of the other (``smollm2-135m`` is ``HuggingFaceTB/SmolLM2-135M-
    Instruct``); unknown names (empty) match anything."""
    a, b = _short(lorsa_name), _short(model)
    return not a or not b or a.startswith(b) or b.startswith(a)


def fitted_on(folder: Path, layer: int) -> str | None:
    """The fingerprint ``fit.json`` beside Lorsa directory ``folder`` (in the set's directory)
    records of the model layer ``layer`` was fitted on; None without a Lorsa fit's record naming
    the layer. A ``fit.json`` that is not JSON is refused naming it."""
    file = folder.parent / FIT_RECORD
    if not file.is_file():
        return None
    settings = read_json_object(file).get("settings")
    if not isinstance(settings, dict) or not isinstance(settings.get("model_fingerprint"), str) \
            or not isinstance(settings.get("layers"), list) or layer not in settings["layers"]:
        return None
    return settings["model_fingerprint"]


def check_lorsa_model(bound, lorsa) -> None:
    """Refuse a Lorsa set made for another model (module docstring): unless ``fit.json`` records
    the model's own weights, ``lm_config.json`` names another model; or a
    QK head's width (``d_qk_head``) is not the model's head width (a Lorsa's QK heads are the
    shape of its model's: llamascopium starts them from the model's heads, as our fit does)."""
    name = model_name(bound.model)
    same = lorsa.fitted_on is not None and bound.fingerprint == lorsa.fitted_on
    for layer, one in lorsa.layers.items():
        folder = one.path.parent if one.path is not None else None
        if not same and lorsa.model_name and not names_match(lorsa.model_name, name):
            where = folder / "lm_config.json" if folder is not None else "the Lorsa set"
            raise TranscoderMismatchError(
                f"{where}: model_name is {lorsa.model_name!r}; the model is {name!r}: a Lorsa "
                "of another model (run it on that model; if it is the same model under another "
                "name, correct model_name)")
        if one.cfg.d_qk_head != bound.head_dim:
            where = folder / "config.json" if folder is not None else f"layer {layer}"
            raise TranscoderMismatchError(
                f"{where}: d_qk_head is {one.cfg.d_qk_head}; the model's heads are "
                f"{bound.head_dim} wide: a Lorsa of another model")


__all__ = ["check_lorsa_model", "fitted_on", "names_match"]
