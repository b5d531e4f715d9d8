"""Every error this package raises for a user's mistake, or for a state it refuses to measure in.

All derive from :class:`CausalTraceError`; each also derives from the built-in exception its
callers would expect (``ValueError``, ``OSError``, …), so ``except ValueError`` keeps working.
The command line catches :class:`CausalTraceError` (and ``OSError``) and prints one ``error:``
line; anything else is a bug and keeps its traceback. docs/errors.md says what each one means.

This module imports nothing from the package: every other module may import it.
"""

from __future__ import annotations


class CausalTraceError(Exception):
    """Base: a user's mistake (argument, flag, file, spec field) or a state we will not measure
    in. The message names the culprit and what to do."""


# -- arguments, flags, spec fields -------------------------------------------------------------

class InputError(CausalTraceError, ValueError):
    """A value we refuse: out of range, non-finite, of the wrong kind, or that does not fit the
    model, prompt or data it is used with."""


class SpecError(InputError):
    """A spec is malformed; ``path`` is the JSON path of the offending field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class SubjectNotFoundError(InputError):
    """The subject string does not occur in the prompt (as often as asked)."""


class MultiTokenAnswerError(InputError):
    """The answer is several tokens where exactly one is needed."""


class UndefinedCurveError(InputError):
    """A faithfulness curve is undefined here: the empty circuit scores as the model does (or
    the noise barely moves P(answer)) up to rounding, so every point would be rounding over
    rounding. A dataset run records the fact without a curve and goes on."""


class NonFiniteError(InputError):
    """NaN or inf where a number was needed."""


class UnknownInterventionError(CausalTraceError, KeyError):
    """No intervention type is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class PluginError(CausalTraceError, ImportError):
    """A plugin module named by ``--plugins`` or ``$PVCT_PLUGINS`` failed to import."""


# -- models and transcoders ---------------------------------------------------------------------

class UnsupportedModelError(InputError):
    """The model's architecture has no adapter."""


class PyveneModelError(CausalTraceError, TypeError):
    """A pyvene setup we cannot reproduce exactly (or an ``IntervenableModel`` where the plain
    model belongs)."""


class TranscoderFormatError(InputError):
    """A transcoder's files are missing, incomplete, corrupted or inconsistent."""


class TranscoderMismatchError(InputError):
    """A transcoder's shape or hooks do not fit the model it is used with."""


# -- results that would not be right ------------------------------------------------------------

class ClosureError(InputError):
    """An attribution graph whose edges and constants do not add up to its target: the forward
    holds something the graph has no node for. Not returned as if it were fine."""


class MemoryCapError(CausalTraceError, MemoryError):
    """What was asked does not fit the memory cap (or the machine): refused before allocating."""


# -- files and run directories ------------------------------------------------------------------

class DamagedFileError(InputError):
    """A file this package wrote (or reads) is truncated, corrupt or inconsistent; the message
    names the path and what to remove or redo."""


class GraphFileError(DamagedFileError):
    """A file is not a graph this package wrote (or one of an unsupported schema version)."""


class CheckpointMismatchError(DamagedFileError):
    """A checkpoint directory holds rows of another graph, or a damaged or missing shard."""


class ManifestMismatchError(DamagedFileError):
    """An output directory holds a run with other settings, or rows whose settings cannot be
    proven (no manifest)."""


class OutputLockedError(CausalTraceError, RuntimeError):
    """Another live run is writing the same output directory."""


class DatasetUnavailableError(CausalTraceError, OSError):
    """A named dataset could not be fetched or failed its checksum."""


class DistributedError(CausalTraceError, RuntimeError):
    """Ranks of one distributed run disagree (another model, transcoder, prompt or setting), or
    a collective failed: a rank died, hung past the timeout or left early."""


__all__ = [name for name, value in dict(globals()).items()
           if isinstance(value, type) and issubclass(value, CausalTraceError)]
