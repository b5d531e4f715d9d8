"""The pyvene boundary: what pyvene 0.1.8 needs around it on transformers 5, one job a module
(quiet_import, calls, intervenable, user_edits, steering; each: docs/layout.md)."""
