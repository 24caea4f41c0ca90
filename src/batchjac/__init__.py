"""batchjac: per-instance Jacobians of neural networks over large batches.

``import batchjac`` needs only numpy; TensorFlow, PyTorch and JAX are imported when a model of
that kind is first used.
"""

from ._errors import (
    BackendNotAvailableError as BackendNotAvailableError,
)
from ._errors import (
    BatchJacError as BatchJacError,
)
from ._errors import (
    InputError as InputError,
)
from ._errors import (
    InputTypeError as InputTypeError,
)
from ._errors import (
    ModelError as ModelError,
)
from ._errors import (
    NotConnectedError as NotConnectedError,
)
from ._errors import (
    RowInteractionError as RowInteractionError,
)
from ._jacobian import jacobian as jacobian
from ._version import __version__ as __version__

__all__ = [
    "jacobian",
    "BatchJacError",
    "InputError",
    "InputTypeError",
    "ModelError",
    "NotConnectedError",
    "RowInteractionError",
    "BackendNotAvailableError",
    "__version__",
]
