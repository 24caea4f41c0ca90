"""batchjac: per-instance Jacobians of neural networks over large batches.

``import batchjac`` needs only numpy; TensorFlow, PyTorch and JAX are imported when a model of
that kind is first used.
"""

from ._check import CheckReport as CheckReport, check as check
from ._errors import (
    BackendNotAvailableError as BackendNotAvailableError,
    BatchJacError as BatchJacError,
    InputError as InputError,
    InputTypeError as InputTypeError,
    ModelError as ModelError,
    NotConnectedError as NotConnectedError,
    RowInteractionError as RowInteractionError,
)
from ._jacobian import jacobian as jacobian
from ._propagate import (
    CovarianceClippedWarning as CovarianceClippedWarning,
    Propagation as Propagation,
    propagate as propagate,
)
from ._report import write_report as write_report
from ._sensitivity import Sensitivity as Sensitivity, elasticities as elasticities, sensitivity as sensitivity
from ._solve import SolveResult as SolveResult, Status as Status, solve as solve
from ._version import __version__ as __version__

__all__ = [
    "jacobian",
    "check",
    "CheckReport",
    "propagate",
    "Propagation",
    "CovarianceClippedWarning",
    "sensitivity",
    "elasticities",
    "Sensitivity",
    "write_report",
    "solve",
    "SolveResult",
    "Status",
    "BatchJacError",
    "InputError",
    "InputTypeError",
    "ModelError",
    "NotConnectedError",
    "RowInteractionError",
    "BackendNotAvailableError",
    "__version__",
]
