"""Is a Lorsa set the model's? What :func:`~.lorsa.check_lorsa_fits` reads beside the width
and the layers: the model the set names (``lm_config.json``'s ``model_name``) and the shape of
its QK heads. Each refusal is a :class:`~..errors.TranscoderMismatchError` naming the file and
the field, so the command line prints it as one ``error:`` line."""

from __future__ import annotations

from pathlib import PurePosixPath

from ..errors import TranscoderMismatchError
from ..models import model_name


def _short(name: str) -> str:
    """A model's name as compared: the last part of a hub id or path, lower case."""
    return PurePosixPath(name.strip().rstrip("/")).name.lower()


def names_match(lorsa_name: str, model: str) -> bool:
    """Whether the model a Lorsa was made for is ``model``: the last part of each name, case
    aside, one the start of the other (``smollm2-135m`` is ``HuggingFaceTB/SmolLM2-135M-
    Instruct``); unknown names (empty) match anything."""
    a, b = _short(lorsa_name), _short(model)
    return not a or not b or a.startswith(b) or b.startswith(a)


def check_lorsa_model(bound, lorsa) -> None:
    """Refuse a Lorsa set made for another model: ``lm_config.json`` names another model, or a
    QK head's width (``d_qk_head``) is not the model's head width (a Lorsa's QK heads are the
    shape of its model's: llamascopium starts them from the model's heads, as our fit does)."""
    name = model_name(bound.model)
    for layer, one in lorsa.layers.items():
        folder = one.path.parent if one.path is not None else None
        if lorsa.model_name and not names_match(lorsa.model_name, name):
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


__all__ = ["check_lorsa_model", "names_match"]
