"""The second-order JAX kernel: Hessians, their diagonals, Laplacians and Hessian-vector
products, forward over reverse or forward over forward (:mod:`.laplacian`'s rule set)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..._errors import BatchJacError, ModelError, OrderFailedError
from .._base import SECOND_RESULT, UNTUNED, CallBudget, Kernel, Order, SecondKind, first_line
from . import compat
from .ops import JaxOps

if TYPE_CHECKING:
    from . import JaxBound

#: the second-order kinds forward over forward pushes through :mod:`.laplacian`'s rule
#: set (value, ``k`` tangents and the second-order terms in one pass), with their names
FORWARD_RULES = {"laplacian": "a forward Laplacian", "diagonal": "a forward Hessian diagonal",
                 "hessian": "a forward Hessian"}


def failure(e: Exception, how: str, bound: JaxBound) -> BaseException:
    """What a build's failure raises (the kernels', and a differentiable call's traced into
    the caller's trace): an :class:`OrderFailedError` where JAX refused forward mode through a
    ``jax.custom_vjp`` function (``mode="auto"`` then takes the other order), the error itself
    where batchjac raised it, else the model's failure explained."""
    # (the model's call: _call; older JAX chains its traceback filtering in between)
    cause = compat.unwrapped(e.__cause__) if isinstance(e, ModelError) else e
    if how in ("forward", "forward-over-forward") and isinstance(cause, Exception) and \
            not isinstance(cause, BatchJacError) and compat.no_forward_rule(cause):
        other = "reverse" if how == "forward" else "forward-over-reverse"
        what = "Jacobians" if how == "forward" else "Second derivatives"
        return OrderFailedError(
            f"{what} cannot be computed with mode={how!r} for this model: it calls a "
            f"jax.custom_vjp function, which has no forward-mode rule "
            f"({first_line(cause)[:200]}). Pass mode={other!r} (or 'auto'), which "
            f"differentiates its vjp rule in forward mode, or define the function with "
            f"jax.custom_jvp.")
    if isinstance(e, (BatchJacError, Warning)):
        return e
    return bound._explain(e)


class JaxSecondKernel(Kernel):
    """A second-order kernel (:data:`~batchjac._backends._base.SecondKind`), compiled ahead of
    time for its chunk shape as :class:`JaxKernel` is (for the forward rules on the CPU, for
    one block of rows, :meth:`_block_rows`), per instance under ``vmap``:

    - forward over reverse: ``jacfwd(jacrev(f))``, the native ``jax.hessian``; ``hvp`` is
      ``jvp(jacrev(f), (x,), (v,))`` (one tangent, no Hessian formed);
    - forward over forward: the rule set of :mod:`.laplacian`, one pass of the value,
      its ``k`` tangents and the second-order terms, the primal and first-order work done
      once: one summed term for the Laplacian (``k + 2`` matrix products a layer against
      ``2k + 1`` for ``jvp`` of ``jvp``), ``k`` for the diagonal, the ``k(k+1)/2`` pairs of
      the upper triangle for the full Hessian (fewer terms than ``jacfwd(jacrev)`` pushes;
      measured: docs/thresholds.md, "JAX's second-order kernels"). Where the
      model has a primitive without a rule there (the note names it): ``jvp`` of ``jvp``
      along each unit tangent ``e_j``, ``vmap``-ed over the ``k`` tangents (the diagonal,
      summed for the Laplacian), ``jacfwd(jacfwd(f))`` (the full Hessian). No race between
      them: the rule set does a subset of the other's work.

    One build, no race (on the CPU without XLA's fusion emitters, and the forward Laplacian
    without YNNPACK's fusions too, :meth:`_compile`). The executable is remembered on disk
    (:mod:`batchjac._backends.jax.executables`).
    """

    def __init__(self, bound: JaxBound, kind: SecondKind, order: Order, chunk_size: int,
                 with_outputs: bool, with_jacobian: bool) -> None:
        self._configure(bound, kind, order, chunk_size, with_outputs, with_jacobian)
        u_spec, ctx_spec = bound._specs(self.block_rows)
        if kind == "hvp":
            ctx_spec = (*ctx_spec, u_spec)  # the tangents follow the model's arrays

        def traced(args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
            bound.trace_count += 1
            return self._body(args, u, ctx)

        try:
            lowered = jax.jit(traced).lower(bound.args, u_spec, ctx_spec)
            # remembered on disk as the first-order kernels are (a warm process loads it)
            self._fn, loaded = self._compile(lowered)
            bound.compile_count += not loaded
        except Exception as e:
            err = failure(e, order, bound)
            if err is e:
                raise
            raise err from e
        self.note = f"{kind}: {order}"
        if kind in FORWARD_RULES and order == "forward-over-forward":
            other = "jacfwd of jacfwd" if kind == "hessian" else "jvp of jvp along each unknown"
            self.note += (f", {other} ({self.forward_rules_failed})" if self.forward_rules_failed
                          else f", {FORWARD_RULES[kind]} (one pass)")

    def _configure(self, bound: JaxBound, kind: SecondKind, order: Order, chunk_size: int,
                   with_outputs: bool, with_jacobian: bool) -> None:
        self.mode = "forward"  # the outer differentiation, in both orders
        self.kind, self.order = kind, order
        self.chunk_size, self.with_outputs, self.with_jacobian = chunk_size, with_outputs, with_jacobian
        self._bound = bound
        #: why the forward rule set (Laplacian, diagonal or Hessian) could not be used (its
        #: primitive): ``jvp`` of ``jvp`` (the diagonal, the Laplacian) or ``jacfwd(jacfwd)``
        #: (the Hessian) instead
        self.forward_rules_failed = ""
        #: rows of each call of the executable (the chunk's, or a block's: :meth:`__call__`)
        self.block_rows = self._block_rows(kind, order, chunk_size)

    @classmethod
    def body_of(cls, bound: JaxBound, kind: SecondKind, order: Order
                ) -> Callable[[Any, Any, tuple[Any, ...]], dict[str, Any]]:
        """The kernel's function ``(args, u, ctx) -> {name: array}`` (outputs and Jacobians
        included), uncompiled: traced into the caller's own trace by a differentiable call
        (:mod:`batchjac._differentiable`), whose gradient then flows through it."""
        kernel = cls.__new__(cls)
        kernel._configure(bound, kind, order, 1, True, True)
        return kernel._body

    #: second-order kernels on the CPU compile without XLA's fusion emitters (the older
    #: loop emitter): they compile sooner and run as fast (measured: docs/thresholds.md)
    CPU_OPTIONS: ClassVar[dict[str, str | bool]] = compat.SECOND_CPU_OPTIONS
    #: the forward Laplacian's matrix products, each alone in a YNNPACK call, on the CPU; then,
    #: where an XLA does not know that fusion type, no YNNPACK fusions at all
    LAPLACIAN_YNN: ClassVar[tuple[str, ...]] = compat.LAPLACIAN_YNN

    def _options(self) -> list[dict[str, str | bool]]:
        """XLA's options for this kernel, the first an XLA accepts: see :meth:`_compile`."""
        if jax.default_backend() != "cpu":
            return [{}]
        if not (self.uses_forward_rules and self.kind == "laplacian"):
            return [dict(self.CPU_OPTIONS), {}]
        return [{**self.CPU_OPTIONS, compat.YNN_FUSION_TYPE: ynn}
                for ynn in self.LAPLACIAN_YNN] + [{}]

    def _compile(self, lowered: Any) -> tuple[Any, bool]:
        """The executable (loaded from the disk cache, or compiled) and whether it was loaded.
        On the CPU without the fusion emitters (:data:`CPU_OPTIONS`). The forward Laplacian
        also without XLA's YNNPACK fusions, which fold its elementwise terms into the matrix
        products badly. Its matrix products each alone in a YNNPACK call
        (:data:`LAPLACIAN_YNN`) start sooner than XLA's own, whose first run generates oneDNN's
        matrix kernels. The forward Hessian keeps the fusions, faster there (all measured:
        docs/thresholds.md, "JAX's second-order kernels"). An XLA that refuses an option set compiles with
        the next (:meth:`_options`), the last its defaults."""
        from . import executables as jax_executables

        starting = self._bound.compiling.set
        *preferred, last = self._options()
        for options in preferred:
            try:
                return jax_executables.compile(lowered, options, starting=starting)
            except Exception:  # an XLA without these options: the next ones
                pass
        return jax_executables.compile(lowered, last, starting=starting)

    @property
    def uses_forward_rules(self) -> bool:
        """Whether the kernel pushes the second-order terms forward (:mod:`.laplacian`)."""
        return self.kind in FORWARD_RULES and self.order == "forward-over-forward" and \
            not self.forward_rules_failed

    def _body(self, args: Any, u: Any, ctx: tuple[Any, ...]) -> dict[str, Any]:
        one = self._bound._instance_fn(args)
        ushape = tuple(u.shape[1:])
        k = int(np.prod(ushape, dtype=np.int64))
        kind, order = self.kind, self.order
        found = None
        if kind in FORWARD_RULES and order == "forward-over-forward":
            found = self._forward_rules(one, u, ctx)

        def per_instance(u_i: Any, c_i: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            """``(y, J, result)`` of one instance."""
            if kind == "hvp":
                c_i, v_i = c_i[:-1], c_i[-1]
            f = functools.partial(lambda c, a: one(a, c), c_i)
            if kind in ("diagonal", "laplacian", "hvp") and order == "forward-over-forward":
                basis = jnp.eye(k, dtype=u_i.dtype).reshape((k, *ushape))

                def along(t: Any) -> tuple[Any, Any, Any]:
                    # along e_j twice (diagonal), or along e_j then v: (H v)_j
                    second = v_i if kind == "hvp" else t
                    (y, dy), (_, d2y) = jax.jvp(lambda a: jax.jvp(f, (a,), (t,)), (u_i,), (second,))
                    return y, dy, d2y

                y, dys, d2s = jax.vmap(along, out_axes=(None, 0, 0))(basis)  # (k, *out)
                jac = jnp.moveaxis(dys, 0, -1)
                diag = jnp.moveaxis(d2s, 0, -1)
                if kind == "laplacian":
                    return y, jac.reshape((*y.shape, *ushape)), diag.sum(-1)
                return y, jac.reshape((*y.shape, *ushape)), diag.reshape((*y.shape, *ushape))
            inner = jax.jacrev if order == "forward-over-reverse" else jax.jacfwd

            def jac_y(a: Any) -> tuple[Any, tuple[Any, Any]]:
                j, y = inner(lambda b: (f(b),) * 2, has_aux=True)(a)
                return j, (j, y)

            if kind == "hvp":
                jac, hv, (_, y) = jax.jvp(jac_y, (u_i,), (v_i,), has_aux=True)
                return y, jac, hv
            h, (jac, y) = jax.jacfwd(jac_y, has_aux=True)(u_i)
            if kind == "hessian":
                return y, jac, h
            flat = h.reshape((*y.shape, k, k))
            diag = jnp.diagonal(flat, axis1=-2, axis2=-1)
            if kind == "laplacian":
                return y, jac, diag.sum(-1)
            return y, jac, diag.reshape((*y.shape, *ushape))

        y, jac, second = jax.vmap(per_instance)(u, ctx) if found is None else found
        out = {SECOND_RESULT[kind]: second}
        if self.with_outputs:
            out["outputs"] = y
        if self.with_jacobian:
            out["jacobians"] = jac
        return out

    #: rows of a block of the forward rules' kernels, for chunks at least twice as large:
    #: their temporaries ((k + 2) values per activation for the Laplacian) then stay in
    #: cache (measured: docs/thresholds.md). On the CPU only (as :class:`JaxKernel`'s
    #: blocks): a GPU's cache is not what a block of rows would be sized for (unmeasured).
    LAPLACIAN_BLOCK_ROWS = 4096
    #: the same for the diagonal and the Hessian, whose activations carry more values
    #: (docs/thresholds.md)
    HESSIAN_BLOCK_ROWS = 2048

    @classmethod
    def _block_rows(cls, kind: SecondKind, order: Order, chunk_size: int) -> int:
        """Rows of one call of the executable: the chunk's, or for the forward rules on the
        CPU a block of about :attr:`LAPLACIAN_BLOCK_ROWS` (:attr:`HESSIAN_BLOCK_ROWS` for the
        diagonal and the Hessian) evened over the chunk, which
        :meth:`__call__` loops over. The executable is then compiled for one block, not for a
        ``lax.map`` over the blocks inside one call: it compiles sooner and runs as fast
        (docs/thresholds.md, "JAX's second-order kernels")."""
        limit = cls.LAPLACIAN_BLOCK_ROWS if kind == "laplacian" else cls.HESSIAN_BLOCK_ROWS
        blocked = kind in FORWARD_RULES and order == "forward-over-forward" and \
            chunk_size >= 2 * limit and jax.default_backend() == "cpu"
        if not blocked:
            return chunk_size
        return -(-chunk_size // -(-chunk_size // limit))

    def _forward_rules(self, one: Callable[[Any, tuple[Any, ...]], Any], u: Any,
                       ctx: tuple[Any, ...]) -> tuple[Any, Any, Any] | None:
        """``(y, J, result)`` of the chunk in one pass per instance (:mod:`.laplacian`,
        over the jaxpr of one instance's function, ``vmap``-ed over the rows), or None where
        that jaxpr has a primitive without a rule (``self.forward_rules_failed`` names it; the
        body then computes the same values the other way). Decided here, once, while the
        kernel is traced."""
        from . import laplacian as jax_laplacian

        ushape = tuple(u.shape[1:])
        kind = self.kind
        specs = (jax.ShapeDtypeStruct(ushape, u.dtype),
                 tuple(jax.ShapeDtypeStruct(tuple(c.shape[1:]), c.dtype) for c in ctx))
        closed = jax_laplacian.trace(one, *specs)
        push = {"laplacian": jax_laplacian.run, "diagonal": jax_laplacian.run_diagonal,
                "hessian": jax_laplacian.run_hessian}[kind]

        def per_instance(u_i: Any, c_i: tuple[Any, ...]) -> tuple[Any, Any, Any]:
            y, d, second = push(closed, u_i, *jax.tree_util.tree_leaves(c_i))
            jac = jnp.moveaxis(d, 0, -1).reshape((*y.shape, *ushape))
            if kind == "diagonal":
                second = jnp.moveaxis(second, 0, -1).reshape((*y.shape, *ushape))
            elif kind == "hessian":
                second = jnp.moveaxis(second, (0, 1), (-2, -1)).reshape(
                    (*y.shape, *ushape, *ushape))
            return y, jac, second

        try:
            # the rules' jax.numpy calls inlined into this trace, not each traced as a jit of
            # its own first (the model's jaxpr is walked, not called: its own jits stay): a
            # quicker trace (docs/thresholds.md, "JAX's second-order kernels")
            with compat.inline_jits():
                return jax.vmap(per_instance)(u, ctx)  # type: ignore[no-any-return]
        except jax_laplacian.Unsupported as e:
            self.forward_rules_failed = str(e)
            return None

    # a mapping of named arrays, which the runner takes as it takes a Jacobian kernel's pair
    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...],  # type: ignore[override]
             budget: CallBudget = UNTUNED) -> dict[str, np.ndarray]:
        from .executables import release, used

        used()
        size, rows = int(u.shape[0]), self.block_rows
        on_device = isinstance(u, jax.Array)  # JAX arrays in: left on their device
        if rows == size:
            out = self._fn(self._bound.args, u, tuple(ctx))
            res = dict(out) if on_device else {name: np.asarray(a) for name, a in out.items()}
        else:  # block by block (all queued before the first is read), the last one padded
            from ..._xp import NUMPY

            xp = JaxOps() if on_device else NUMPY

            def block(a: Any, lo: int) -> Any:
                part = a[lo:lo + rows]
                return part if part.shape[0] == rows else xp.pad_rows(part, rows)

            outs = [self._fn(self._bound.args, block(u, lo), tuple(block(c, lo) for c in ctx))
                    for lo in range(0, size, rows)]
            res = {name: xp.concat([o[name] if on_device else np.asarray(o[name])
                                    for o in outs])[:size] for name in outs[0]}
        release()  # the executable this call compiled is written now, after its result
        return res
