"""The tensors the PyTorch kernels make and convert: host arrays to torch and back, unit bases
broadcast over a chunk's rows, and the scope in which the unknowns require grad. Shared by the
adapter (:mod:`batchjac._backends.torch`), the first-order builds (:mod:`.builds`) and the
second-order kernel (:mod:`.second`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from .state import _silenced


@contextlib.contextmanager
def _unknowns_require_grad() -> Iterator[None]:
    """Plain autograd needs ``requires_grad`` on the unknowns; a model that branches on their
    values (``float(x.max())``) then gets torch's warning about converting such a tensor to a
    number. The flag is batchjac's doing, not the user's, so that one warning is silenced."""
    with _silenced("Converting a tensor with requires_grad=True", UserWarning):
        yield


def _to_torch(a: np.ndarray, device: torch.device) -> torch.Tensor:
    if isinstance(a, torch.Tensor):  # a native chunk (see batchjac._arrays): no host copy
        return a.detach().to(device)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    # torch.from_numpy shares memory and warns on read-only arrays (memmaps opened 'r').
    t = torch.from_numpy(a if a.flags.writeable else a.copy())
    return t if t.device == device else t.to(device)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _basis(n: int, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
           ) -> torch.Tensor:
    """``(n, rows, *shape)``: the unit vectors of ``shape``, broadcast over the rows (a view,
    no copy)."""
    eye = torch.eye(n, dtype=dtype, device=device).reshape(n, 1, *shape)
    return eye.expand(n, rows, *shape)
