"""PyTorch derivatives that carry gradients (:mod:`batchjac._differentiable`): the backend's own
builds, run outside ``no_grad`` on the caller's tensors (never detached copies), so that a loss
on the result backpropagates to the module's parameters and to inputs that require grad.

The builds are those whose operations autograd records: torch.func's ``jvp``/``vjp`` passes
(:func:`~.builds.jac_forward`, :func:`~.builds.jac_reverse`, the second-order kernel's "plain"
build) and the forward Laplacian (:mod:`.laplacian`, whose rule set is torch operations on the
module's own weight tensors). The kernels' plain-autograd builds differentiate detached copies
of the unknowns and are never taken here. A chunk of a budgeted call is recomputed in the
backward pass by ``torch.utils.checkpoint`` (non-reentrant: it takes torch.func's forward
passes inside, and refuses its reverse ones: a recomputed reverse-mode Jacobian is plain
autograd's, :func:`~.builds._jac_looped` in the caller's graph).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..._errors import BatchJacError, InputError, ModelError
from .._base import SECOND_RESULT
from . import compat
from .builds import _jac_looped, jac_forward, jac_reverse
from .errors import _explain_model_failure
from .state import _FORWARD_AD, _load_forward_ad
from .tensors import _basis

if TYPE_CHECKING:
    from . import TorchBound

Compute = Callable[[torch.Tensor, tuple[torch.Tensor, ...], Any], dict[str, torch.Tensor]]


def derivatives(bound: TorchBound, kind: str, how: str, with_outputs: bool,
                with_jacobian: bool, recomputed: bool = False) -> Compute:
    """``(u, ctx, v) -> {name: tensor}`` in autograd's graph (see the module's docstring)."""
    if bound._cast:
        theirs = next(iter(bound._cast))
        raise InputError(
            f"differentiable=True computes in the module's own dtype, so that the gradient "
            f"reaches its parameters; the inputs ask for {bound.dtype} but the module holds "
            f"other dtypes (e.g. `{theirs}`). Pass dtype= the module's dtype, or convert the "
            f"module (module.to(torch.{str(bound.dtype).split('.')[-1]})).")
    if bound.train_mode and bound.module is not None:
        layers = compat.mode_dependent_layers()
        found = sorted({type(m).__name__ for m in bound.module.modules()
                        if m.training and isinstance(m, layers)})
        if found:
            raise ModelError(
                f"backend_options={{'train_mode': True}} keeps the module's {', '.join(found)} "
                f"layers in training mode, whose random masks or batch statistics make each "
                f"call differentiate another draw (or mix the rows): a loss on these "
                f"derivatives would train on noise. Drop train_mode (batchjac then evaluates "
                f"them in eval mode, the module's own mode restored after the call), or "
                f"compute the derivatives of a module without them.")
    second: Any = None
    if kind != "jacobian":
        from .second import TorchSecondKernel

        # (a kernel of its own: the builds a race chose for the compiled calls stay theirs;
        # kept on the bound model, whose next training step reuses its traced tapes)
        second = bound.differentiable_kernels.get((kind, how))
        if second is None:
            second = TorchSecondKernel(bound, kind, how, 1, True, True)  # type: ignore[arg-type]
            second.variant = "forward-laplacian" if "forward-laplacian" in second.variants \
                else "plain"
            # (its tapes hold the parameters themselves: an optimizer's step needs no trace)
            second.tapes_by_identity = True
            second.in_blocks = False  # (see the attribute)
            bound.differentiable_kernels[(kind, how)] = second

    def run(u: torch.Tensor, ctx: tuple[torch.Tensor, ...], v: Any) -> dict[str, torch.Tensor]:
        if second is not None:
            prepare(u, ctx)
        with bound.calling(grad=True), _FORWARD_AD:
            try:
                if second is None:
                    return _jacobian(bound, how, u, ctx, recomputed)
                y, jac, result = second._compute(u, ctx, v)
            except (BatchJacError, Warning):
                raise
            except Exception as e:
                raise _explain_model_failure(e, bound.signature) from e
        if second.variant == "autograd":  # (torch.func refused a custom Function of the model)
            raise ModelError(
                f"Second derivatives of this model cannot carry gradients: torch.func cannot "
                f"differentiate its custom torch.autograd.Function twice, and plain autograd's "
                f"build differentiates a detached copy ({second.note}). Give the Function "
                f"torch.func's form (setup_context and jvp staticmethods), or compute without "
                f"differentiable=True.")
        return {SECOND_RESULT[kind]: result, "outputs": y, "jacobians": jac}

    def prepare(u: torch.Tensor, ctx: tuple[torch.Tensor, ...]) -> None:
        """What the second-order builds find out once about the model (its custom Functions,
        on one row, with a graph), before a checkpointed chunk: its recomputation must save
        the tensors its first run saved, and this runs once."""
        with bound.calling(grad=True):
            second._custom(u, ctx)

    if second is not None:
        run.prepare = prepare  # type: ignore[attr-defined]
    return run


def _jacobian(bound: TorchBound, how: str, u: torch.Tensor, ctx: tuple[torch.Tensor, ...],
              recomputed: bool) -> dict[str, torch.Tensor]:
    if how == "reverse" and recomputed:  # (torch.func's vjp refuses the checkpoint's hooks)
        y, jac = _jac_looped(bound, u, ctx, graph=True)
        return {"jacobians": jac, "outputs": y}
    if how == "forward":
        _load_forward_ad()  # (torch.func's forward mode only: they load slowly)
        ushape = tuple(u.shape[1:])
        y, jac = jac_forward(bound, u, ctx, _basis(math.prod(ushape), u.shape[0], ushape,
                                                   u.dtype, u.device))
    else:
        y, jac = jac_reverse(bound, u, ctx, None, "func")
    return {"jacobians": jac, "outputs": y}


def checkpointed(fn: Compute) -> Compute:
    """``fn`` recomputed in the backward pass (``torch.utils.checkpoint``, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    prepare = getattr(fn, "prepare", None)

    def run(u: torch.Tensor, ctx: tuple[torch.Tensor, ...], v: Any) -> dict[str, torch.Tensor]:
        if prepare is not None:  # (outside the checkpoint: see derivatives)
            prepare(u, ctx)
        # (recomputed to the end: an early stop is an exception raised through the model's
        # call, which would read as the model's failure)
        with set_checkpoint_early_stop(False):
            return checkpoint(fn, u, ctx, v, use_reentrant=False)  # type: ignore[no-any-return]

    return run
