"""batchjac: per-instance Jacobians of neural networks over large batches.

``import batchjac`` needs only numpy; TensorFlow, PyTorch and JAX are imported when a model of
that kind is first used.
"""

from . import _backends
from ._api.solve import solve as solve
from ._backends.numpy import ClosedForm as ClosedForm
from ._check import CheckReport as CheckReport, check as check
from ._check_hessian import HessianCheckReport as HessianCheckReport, check_hessian as check_hessian
from ._errors import (
    BackendNotAvailableError as BackendNotAvailableError,
    BatchJacError as BatchJacError,
    BatchJacWarning as BatchJacWarning,
    ChunkMemoryWarning as ChunkMemoryWarning,
    CovarianceClippedWarning as CovarianceClippedWarning,
    ForwardModeFallbackWarning as ForwardModeFallbackWarning,
    InputError as InputError,
    InputFileError as InputFileError,
    InputTypeError as InputTypeError,
    ModelError as ModelError,
    ModelLoadError as ModelLoadError,
    NotConnectedError as NotConnectedError,
    RebindWarning as RebindWarning,
    ReverseModeFallbackWarning as ReverseModeFallbackWarning,
    RowInteractionError as RowInteractionError,
    StoreBusyError as StoreBusyError,
    StoreError as StoreError,
    StoreExistsError as StoreExistsError,
    StoreMismatchError as StoreMismatchError,
    StoreRecomputeWarning as StoreRecomputeWarning,
    StoreWriteError as StoreWriteError,
    TrainingModeWarning as TrainingModeWarning,
    TuneCacheWarning as TuneCacheWarning,
    UnwatchedValuesWarning as UnwatchedValuesWarning,
    VectorizationFallbackWarning as VectorizationFallbackWarning,
    XLAFallbackWarning as XLAFallbackWarning,
    ZeroJacobianWarning as ZeroJacobianWarning,
)
from ._estimators import DiagonalEstimate as DiagonalEstimate, TraceEstimate as TraceEstimate
from ._hessian import hessian as hessian, hvp as hvp, laplacian as laplacian
from ._jacobian import jacobian as jacobian
from ._products import divergence as divergence, jvp as jvp, vjp as vjp
from ._propagate import Propagation as Propagation, propagate as propagate
from ._report import write_report as write_report
from ._sensitivity import Sensitivity as Sensitivity, elasticities as elasticities, sensitivity as sensitivity
from ._solve import SolveResult as SolveResult, Status as Status
from ._solve_store import SolveStoreResult as SolveStoreResult
from ._stores import (
    Store as Store,
    StoreResult as StoreResult,
    open_store as open_store,
    read_manifest as read_manifest,
)
from ._version import __version__ as __version__

# (the verbs a training step calls inside a tf.function: run as written, not AutoGraph-converted)
_backends.not_converted(jacobian, hessian, laplacian, hvp)

__all__ = [
    "jacobian",
    "hessian",
    "laplacian",
    "hvp",
    "jvp",
    "vjp",
    "divergence",
    "TraceEstimate",
    "DiagonalEstimate",
    "ClosedForm",
    "check",
    "CheckReport",
    "check_hessian",
    "HessianCheckReport",
    "propagate",
    "Propagation",
    "CovarianceClippedWarning",
    "sensitivity",
    "elasticities",
    "Sensitivity",
    "write_report",
    "solve",
    "SolveResult",
    "SolveStoreResult",
    "Status",
    "Store",
    "StoreResult",
    "open_store",
    "read_manifest",
    "BatchJacError",
    "InputError",
    "InputFileError",
    "InputTypeError",
    "ModelError",
    "ModelLoadError",
    "NotConnectedError",
    "RowInteractionError",
    "BackendNotAvailableError",
    "StoreError",
    "StoreExistsError",
    "StoreMismatchError",
    "StoreBusyError",
    "StoreWriteError",
    "BatchJacWarning",
    "ForwardModeFallbackWarning",
    "ReverseModeFallbackWarning",
    "VectorizationFallbackWarning",
    "TrainingModeWarning",
    "RebindWarning",
    "TuneCacheWarning",
    "UnwatchedValuesWarning",
    "StoreRecomputeWarning",
    "ChunkMemoryWarning",
    "XLAFallbackWarning",
    "ZeroJacobianWarning",
    "__version__",
]
