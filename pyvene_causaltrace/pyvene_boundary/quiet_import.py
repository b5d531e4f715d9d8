"""pyvene imported without its import-time ``print`` (:func:`import_pyvene`) and taught the
architectures its 0.1.8 wheel lacks, Qwen3 and Gemma-3 text (:func:`register_architectures`).
"""

from __future__ import annotations

import contextlib
import functools
import io


def import_pyvene():
    """``import pyvene`` with its import-time print about nnsight swallowed; no attribute of a
    pyvene class is changed (``tests/test_pyvene_untouched.py``)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import pyvene  # pyvene prints on import: only import_pyvene() imports it, quietly
    register_architectures()
    return pyvene


@functools.cache
def register_architectures() -> None:
    """Teach pyvene the architectures its 0.1.8 wheel does not know (once)."""
    import transformers.models as hf  # transformers is slow to import: it loads when a model does

    with contextlib.redirect_stdout(io.StringIO()):
        # pyvene prints on import: loaded here, its output swallowed
        from pyvene.models import intervenable_modelcard as card
    # (module, our class, pyvene-known relative class) -- same module layout and dimensions
    pairs = [
        ("qwen3", "Qwen3ForCausalLM", "qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3Model", "qwen2", "Qwen2Model"),
        ("gemma3", "Gemma3ForCausalLM", "gemma2", "Gemma2ForCausalLM"),
        ("gemma3", "Gemma3TextModel", "gemma2", "Gemma2Model"),
    ]
    for module, name, relative_module, relative_name in pairs:
        ours = getattr(getattr(getattr(hf, module, None), f"modeling_{module}", None), name, None)
        theirs = getattr(getattr(hf, relative_module), f"modeling_{relative_module}")
        theirs = getattr(theirs, relative_name)
        if ours is None:  # an older transformers without this architecture
            continue
        card.type_to_module_mapping.setdefault(ours, card.type_to_module_mapping[theirs])
        card.type_to_dimension_mapping.setdefault(ours, card.type_to_dimension_mapping[theirs])
