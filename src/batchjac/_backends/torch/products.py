"""Products with the per-instance Jacobians that never form them (:mod:`batchjac._products`):
``J v`` pushed forward and ``c^T J`` pulled back, for the whole chunk at once.

Rows are independent (the probes check it), so ``torch.func.jvp`` of the chunk along per-row
tangents holds each instance's ``J_i v_i``, and the pullback of ``torch.func.vjp`` applied to
per-row cotangents each instance's ``c_i^T J_i``; several directions per instance are
``vmap``-ed over (the reverse pass shares one forward pass). A model torch.func refuses (an
``autograd.Function`` in the old style) is pulled back with plain autograd; pushed forward it
is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..._errors import BatchJacError, ModelError
from .errors import _explain_model_failure, _first_sentence
from .state import _FORWARD_AD, _load_forward_ad
from .tensors import _to_numpy, _to_torch, _unknowns_require_grad

if TYPE_CHECKING:
    from . import TorchBound


def product(bound: TorchBound, kind: str, u: np.ndarray, ctx: tuple[np.ndarray, ...],
            t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(y, p)``: the outputs and, for each of the ``d`` directions of ``t`` (rows, d, ...),
    ``J v`` (``kind="jvp"``, (rows, d, *out)) or ``c^T J`` (``"vjp"``, (rows, d, *unknown))."""
    bound.refresh()  # (cast copies of the weights follow the module)
    ut, ct = bound.tensors(u, ctx)
    tt = _to_torch(t, bound.device)

    def f(a: torch.Tensor) -> torch.Tensor:
        return bound.apply(a, ct)

    with bound.calling():
        try:
            y, p = _pull(f, ut, tt) if kind == "vjp" else _push(f, ut, tt)
        except BatchJacError:
            raise
        except Exception as e:
            raise _explain_model_failure(e, bound.signature) from e
    return _to_numpy(y), _to_numpy(p)


def _push(f: object, ut: torch.Tensor, tt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs and the tangents ``tt`` (rows, d, *unknown) pushed forward: torch.func's
    ``jvp``; where it fails (an operation without a forward derivative, such as the CPU's
    LSTM, or a Function torch.func refuses), the pullback differentiated once more in its
    cotangent, which is linear in it (``J v`` as the gradient of ``w -> (J^T w) . v``, as
    ``torch.autograd.functional.jvp`` computes it), on plain autograd."""
    assert callable(f)
    try:
        _load_forward_ad()
        with _FORWARD_AD:
            y = f(ut)
            return y, torch.func.vmap(lambda v: torch.func.jvp(f, (ut,), (v,))[1],
                                      in_dims=1, out_dims=1)(tt)
    except (RuntimeError, NotImplementedError) as e:
        failed = e
    with torch.enable_grad(), _unknowns_require_grad():
        x = ut.detach().requires_grad_(True)
        y = f(x)
        if not y.requires_grad:  # no path from the unknowns: zeros
            return y.detach(), y.new_zeros((y.shape[0], tt.shape[1], *y.shape[1:]))
        w = torch.zeros_like(y, requires_grad=True)
        (g,) = torch.autograd.grad(y, x, w, create_graph=True, allow_unused=True,
                                   materialize_grads=True)
        if not g.requires_grad:
            raise ModelError(
                f"batchjac.jvp could not push tangents through this model: torch.func failed "
                f"({_first_sentence(failed)}) and its backward cannot be differentiated in its "
                f"cotangent (a @once_differentiable Function?). Pull cotangents back with "
                f"batchjac.vjp, or compute the Jacobian with mode='reverse' and multiply.")
        (p,) = torch.autograd.grad(g, w, tt.movedim(1, 0), is_grads_batched=True,
                                   allow_unused=True, materialize_grads=True)
    return y.detach(), p.movedim(0, 1)


def _pull(f: object, ut: torch.Tensor, tt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs and the cotangents ``tt`` (rows, d, *out) pulled back: torch.func's
    ``vjp``, else (a Function it refuses) plain autograd, one forward pass either way."""
    assert callable(f)
    try:
        y, pull = torch.func.vjp(f, ut)[:2]
        return y, torch.func.vmap(lambda c: pull(c)[0], in_dims=1, out_dims=1)(tt)
    except (RuntimeError, NotImplementedError):
        pass
    with torch.enable_grad(), _unknowns_require_grad():
        x = ut.detach().requires_grad_(True)
        y = f(x)
        if not y.requires_grad:  # no path from the unknowns: zeros
            return y.detach(), x.new_zeros((x.shape[0], tt.shape[1], *x.shape[1:]))
        (p,) = torch.autograd.grad(y, x, tt.movedim(1, 0), is_grads_batched=True,
                                   allow_unused=True, materialize_grads=True)
    return y.detach(), p.movedim(0, 1)
