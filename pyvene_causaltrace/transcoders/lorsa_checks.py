"""Is a Lorsa set the model's? What :func:`~.lorsa.check_lorsa_fits` reads beside the width
and the layers: the model the set was fitted on and the shape of its QK heads. The model is
known best by ``fit.json`` (``fit-lorsa`` writes it beside the set's layer directories): the
fingerprint of the weights it was fitted on (:func:`~..fingerprint.model_fingerprint`), so the
same model loaded from another folder is the same, and another model of the same name is not.
Without one, or with the model in another dtype than the fit's (its fingerprint then differs),
the names decide (``lm_config.json``'s ``model_name``, :func:`names_match`). Each refusal is a
:class:`~..errors.TranscoderMismatchError` naming the file and the field, so the command line
prints it as one ``error:`` line."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..errors import TranscoderMismatchError
from ..fingerprint import model_fingerprint
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


def fitted_on(folder: Path, layer: int) -> dict | None:
    """What ``fit.json`` beside Lorsa directory ``folder`` (in the set's directory) records of
    the model layer ``layer`` was fitted on: ``{"fingerprint", "dtype" (None in a record older
    than it), "file"}``; None without a Lorsa fit's record naming the layer. A ``fit.json``
    that is not JSON is refused naming it."""
    file = folder.parent / FIT_RECORD
    if not file.is_file():
        return None
    record = read_json_object(file)
    settings = record.get("settings")
    if not isinstance(settings, dict) or not isinstance(settings.get("model_fingerprint"), str) \
            or not isinstance(settings.get("layers"), list) or layer not in settings["layers"]:
        return None
    return {"fingerprint": settings["model_fingerprint"], "dtype": record.get("model_dtype"),
            "file": str(file)}


def same_weights(bound, fitted: dict | None) -> bool | None:
    """Whether ``bound``'s model is the one ``fitted`` (:func:`fitted_on`) records: True when
    the fingerprints match; refused when they differ and the dtype is the fit's (other weights:
    another model); None when nothing is recorded or the dtype differs (the names decide)."""
    if fitted is None:
        return None
    have = model_fingerprint(bound.model)
    if have == fitted["fingerprint"]:
        return True
    dtype = str(next(bound.model.parameters()).dtype).removeprefix("torch.")
    if fitted["dtype"] != dtype:
        return None
    raise TranscoderMismatchError(
        f"{fitted['file']}: model_fingerprint is {fitted['fingerprint']}; the model's is {have} "
        f"({dtype}, as the fit's): the Lorsa was fitted on other weights, a Lorsa of another "
        "model (run it on the model it was fitted on)")


def check_lorsa_model(bound, lorsa) -> None:
    """Refuse a Lorsa set made for another model (module docstring): ``fit.json`` records
    other weights, or (nothing better recorded) ``lm_config.json`` names another model, or a
    QK head's width (``d_qk_head``) is not the model's head width (a Lorsa's QK heads are the
    shape of its model's: llamascopium starts them from the model's heads, as our fit does)."""
    name = model_name(bound.model)
    same = same_weights(bound, lorsa.fitted_on)
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


__all__ = ["check_lorsa_model", "fitted_on", "names_match", "same_weights"]
