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


class OrderFailedError(ModelError):
    """A second-order call's order of differentiation cannot differentiate this model twice
    (forward over forward through a custom rule: a JAX ``custom_vjp``, a PyTorch
    ``autograd.Function``); the other order may. ``mode="auto"`` then takes the other order;
    a call that asked for this one gets this error."""


class RowInteractionError(ModelError):
    """The output of one instance depends on the inputs of another instance."""


class ModelLoadError(ModelError):
    """The model file exists but cannot be loaded (or is unsafe to load without trust)."""


class BackendNotAvailableError(BatchJacError, ImportError):
    """The framework a model needs is not installed (also an ``ImportError``)."""


class StoreError(BatchJacError):
    """A problem with the output store rather than with the model or the inputs."""


class StoreExistsError(StoreError):
    """The output exists (and is not this job's), or is in use; nothing was written."""


class StoreMismatchError(StoreExistsError):
    """The output, or its unfinished store, was made by a different job."""


class StoreBusyError(StoreExistsError):
    """Another process is writing this store."""


class StoreWriteError(StoreError):
    """Writing the store failed (full disk, permissions, I/O error). Finished chunks are kept:
    run the same call again to continue."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class InputFileError(InputError):
    """An input or model file is missing, unreadable, or of a format batchjac does not read."""


# -- warnings: one root, so that ``warnings.filterwarnings("ignore", category=BatchJacWarning)``
# silences batchjac without silencing anything else


class BatchJacWarning(UserWarning):
    """Root of the warnings batchjac issues."""


class CovarianceClippedWarning(BatchJacWarning):
    """The unscented transform gave covariances that were not positive semi-definite."""


class ForwardModeFallbackWarning(BatchJacWarning):
    """Forward mode failed for this model (an operator without a forward-mode rule);
    batchjac computes the Jacobians in reverse mode instead."""


class ReverseModeFallbackWarning(BatchJacWarning):
    """Reverse mode failed for this model (JAX's ``lax.while_loop`` has no reverse-mode rule);
    batchjac computes the Jacobians in forward mode instead."""


class VectorizationFallbackWarning(BatchJacWarning):
    """TensorFlow could not vectorise the Jacobian computation of this model (``pfor`` has no
    rule for some control flow in it); batchjac computes it in a while loop instead."""


class TrainingModeWarning(BatchJacWarning):
    """The model was in training mode with layers that behave differently in eval mode;
    batchjac evaluates it in eval mode."""


class RebindWarning(BatchJacWarning):
    """New function objects with the same code, one per call: each is traced and compiled
    again. Define the function once and pass what changes as arguments."""


class UnwatchedValuesWarning(BatchJacWarning):
    """A JAX function closes over more values than batchjac watches for changes between calls
    (a container of more than 256 items, more than 2,000 objects, or containers nested more
    than 64 deep): values past that limit are baked into the compiled kernel, and if they are
    rebound or changed in place, later results would be stale. Pass them as an argument
    (``f(params, x)`` with ``backend_options={"params": params}``): arguments are never baked in."""


class StoreRecomputeWarning(BatchJacWarning):
    """A chunk recorded as done no longer matched the digest recorded when it was written
    (its stored bytes changed since); it is computed again."""


class ChunkMemoryWarning(BatchJacWarning):
    """The chunk size asked for needs more memory than the budget (``max_memory``)."""


class XLAFallbackWarning(BatchJacWarning):
    """XLA could not compile the model; batchjac runs it as a plain TensorFlow graph."""


class ZeroJacobianWarning(BatchJacWarning):
    """The Jacobians of a model's first chunk are all zero: its output likely does not depend
    on the unknowns (a model that reads only the known inputs). Where the framework can tell
    that no path leads from the unknowns to the output at all, batchjac raises
    :class:`NotConnectedError` instead."""


class TuneCacheWarning(BatchJacWarning):
    """The on-disk cache of tuning decisions could not be read or written (a corrupt or foreign
    file, an unwritable directory). batchjac carries on without it: it times the alternatives
    again, and the results are the same, only the first call is slower."""


def add_context(err: BatchJacError, context: str) -> BatchJacError:
    """Return a copy of ``err`` of the same class whose message ends with ``context``."""
    new = type(err)(f"{err}\n  [{context}]")
    new.__cause__ = err.__cause__
    return new
