"""The pyvene boundary: what pyvene 0.1.8 needs around it on transformers 5, one job a module.

- :mod:`.quiet_import`: ``import_pyvene`` (no import-time print; Qwen3 and Gemma-3 text taught).
- :mod:`.calls`: what pyvene's setter hook knows about a call and does not hand the
  intervention (``pyvene_call``), announced by a wrapper of the setter; ``apply_like_pyvene``.
- :mod:`.intervenable`: our ``IntervenableModel`` (removes only its own hooks, keeps the model's
  flags); ``preserve_hooks`` for a user's plain one; the gradient-flag blocks.
- :mod:`.user_edits`: a user's ``pv.IntervenableModel`` applied to our runs, or refused.
- :mod:`.steering`: a user edit's constant part as a gradient leaf (the graph's steering nodes).
"""
