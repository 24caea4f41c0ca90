"""The exception family of batchjac.

Every error batchjac raises on purpose derives from :class:`BatchJacError`, itself a
``ValueError``, so ``except ValueError`` keeps working for callers that do not know batchjac.
Messages say what was wrong, what was received, and how to fix it.
"""

from __future__ import annotations


class BatchJacError(ValueError):
    """Root of all batchjac errors."""


class InputError(BatchJacError):
    """The inputs, ``wrt`` or an option are malformed (shape, dtype, values, range)."""


class InputTypeError(InputError, TypeError):
    """An argument has the wrong type (also a ``TypeError``)."""


class ModelError(BatchJacError):
    """The model cannot be differentiated as asked (disconnected output, rows that interact,
    an output batchjac cannot handle, or a failure inside the model)."""


class NotConnectedError(ModelError):
    """The model's output does not depend on the unknown inputs at all."""


class RowInteractionError(ModelError):
    """The output of one instance depends on the inputs of another instance."""


class ModelLoadError(ModelError):
    """The model file exists but cannot be loaded (or is unsafe to load without trust)."""


class BackendNotAvailableError(BatchJacError, ImportError):
    """The framework a model needs is not installed (also an ``ImportError``)."""


def add_context(err: BatchJacError, context: str) -> BatchJacError:
    """Return a copy of ``err`` of the same class whose message ends with ``context``."""
    new = type(err)(f"{err}\n  [{context}]")
    new.__cause__ = err.__cause__
    return new
