"""Second-order TensorFlow builds: :class:`TFSecondKernel`, the Hessians, their diagonals, the
Laplacians and Hessian-vector products by tiled tapes (under XLA or as a plain graph), nested
``batch_jacobian`` tapes, or the forward rules of :mod:`.laplacian`; and the check that a
model's gradient can be differentiated again."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from ..._errors import BatchJacError, ModelError, XLAFallbackWarning
from .._base import (
    SECOND_RESULT,
    UNTUNED,
    CallBudget,
    Kernel,
    Order,
    SecondKind,
    user_stacklevel,
)
from . import compat
from .builds import _XLA_ERRORS, _evened, _is_tensor, _map_blocks, _out_of_memory

if TYPE_CHECKING:
    from . import TFBound


#: the builds of :mod:`.laplacian`'s rule set, by what they push forward
_FORWARD_RULES = {"forward-laplacian": "forward Laplacian", "forward-hessian": "forward Hessian"}


class TFSecondKernel(Kernel):
    """A second-order kernel (:data:`~batchjac._backends._base.SecondKind`) in one compiled
    function (XLA; a plain graph where XLA cannot compile the model, with the warning of
    :class:`TFKernel`).

    The chunk is repeated once per pair of basis vectors the result needs (rows are
    independent, which the probes check), so that one pass of plain tapes computes them all,
    without ``pfor`` (which nested tapes defeat) and without the ``None`` gradients of nested
    ``batch_jacobian`` tapes:

    - forward over reverse: block ``(a, j)`` is seeded with the cotangent ``e_a`` (a
      ``GradientTape`` inside a ``ForwardAccumulator``) and the tangent ``e_j``: the
      accumulator's ``jvp`` of the gradient is ``H[:, a, :, j]``; ``m k`` blocks, or ``m`` with
      the caller's tangents ``v`` (``hvp``);
    - forward over forward: two nested ``ForwardAccumulator`` s, block ``(i, j)`` pushed along
      ``e_i`` inside and ``e_j`` outside (``k^2`` blocks), or along ``e_j`` twice for the
      diagonal and the Laplacian (``k`` blocks, no ``k x k`` block per output).

    The tiled blocks repeat the model's forward and reverse pass once per block. Where the
    Hessian is taken over the reverse-mode Jacobian (forward over reverse, not ``hvp``), a
    third build, ``"tapes"``, is TensorFlow's own answer: ``batch_jacobian`` of
    ``batch_jacobian`` in a plain graph, whose vectoriser (pfor) runs the forward pass once
    and batches the derivatives: it wins for one output, the tiled builds for several
    (measured: docs/thresholds.md, "TensorFlow's second-order builds"). So an untimed first
    call takes the tapes for one output (every block of the tiled builds is a repeated
    forward and reverse pass there) and the tiled graph otherwise; a race (the
    tuning policy's, where the work repays it) times all three. Not under XLA: the nested
    tapes compile once per input *value* there (see :mod:`batchjac._bench.second`).

    A Laplacian kernel has a fourth build, ``"forward-laplacian"`` (:mod:`.laplacian`: one
    pass over the model's graph carrying the tangents and the summed second derivatives, under
    XLA, in blocks of :attr:`LAPLACIAN_BLOCK_ROWS`), its untimed first choice; where the model
    has an operation without a rule (or XLA cannot compile it) the next build. A Hessian
    kernel's fourth build, ``"forward-hessian"``, carries the second derivatives along every
    pair of unit tangents instead (blocks of :attr:`HESSIAN_BLOCK_ROWS`): the untimed first
    choice for at most 8 unknowns an output (:meth:`forward_hessian_first`; measured:
    docs/thresholds.md), else raced only.
    """

    def __init__(self, bound: TFBound, kind: SecondKind, order: Order, chunk_size: int,
                 with_outputs: bool, with_jacobian: bool) -> None:
        self.mode = "forward"  # the outer differentiation, in both orders
        self.kind, self.order = kind, order
        self.chunk_size, self.with_outputs, self.with_jacobian = chunk_size, with_outputs, with_jacobian
        self._bound = bound
        specs = bound._specs(chunk_size)
        if kind == "hvp":
            specs.append(specs[0])  # the tangents follow the model's arrays
        self._specs = specs
        self._fns: dict[str, Any] = {}
        self._n_ctx = len(specs) - 1
        self._seed_arrays = self._seed_values()
        self._specs += [tf.TensorSpec(a.shape, bound.tf_dtype) for a in self._seed_arrays]
        self._seed_inputs: dict[tuple[Any, ...], tf.Tensor] = {}
        self.variants = ("graph", "xla")
        if order == "forward-over-reverse" and kind != "hvp":
            one_output = int(np.prod(bound.output_shape or ())) == 1
            self.variants = ("tapes", "graph", "xla") if one_output else ("graph", "xla", "tapes")
        if kind == "laplacian":
            # the untimed first too: under XLA in blocks it is built quicker than the nested
            # tapes and runs faster (docs/thresholds.md); where it cannot be built, the next build
            self.variants = ("forward-laplacian", *self.variants)
        if kind == "hessian" and self.forward_hessian_first(bound):
            self.variants = ("forward-hessian", *self.variants)  # the untimed first (see the class)
        elif kind == "hessian":
            self.variants = (*self.variants, "forward-hessian")  # (raced)
        #: why the nested tapes or the forward Laplacian could not be built for this model
        #: (they were dropped)
        self.tapes_failed = ""
        self.variant = None
        self.note = ""

    #: the forward Hessian is the untimed first build for at most this many unknowns an output
    FORWARD_HESSIAN_UNKNOWNS_PER_OUTPUT = 8

    @classmethod
    def forward_hessian_first(cls, bound: TFBound) -> bool:
        """Whether the forward Hessian is the first build: its second-order terms grow as
        ``k^2`` a row for all outputs at once, the other builds' as ``k`` per output (``m k``
        tiled blocks, or the tapes' ``k`` reverse passes of one output). Raced against the
        best other build it wins where ``k <= 8 m`` (measured: docs/thresholds.md,
        ``FORWARD_HESSIAN_UNKNOWNS_PER_OUTPUT``)."""
        k = int(np.prod(bound.signature.unknown_shape or (), dtype=np.int64))
        m = int(np.prod(bound.output_shape or (), dtype=np.int64))
        return k <= cls.FORWARD_HESSIAN_UNKNOWNS_PER_OUTPUT * m

    def _fn(self, variant: str) -> Any:
        if variant not in self._fns:
            def traced(u: tf.Tensor, *rest: tf.Tensor) -> dict[str, tf.Tensor]:
                self._bound.trace_count += 1
                ctx, seeds = rest[:self._n_ctx], rest[self._n_ctx:]
                self._seed_inputs = dict(zip(self._seed_keys(), seeds))
                return self._body(u, ctx, tapes=variant == "tapes",
                                  forward=variant in _FORWARD_RULES)

            with compat.quiet_pfor():  # (the tapes: pfor logs pages where it cannot vectorise)
                self._fns[variant] = tf.function(
                    traced, jit_compile=variant == "xla" or variant in _FORWARD_RULES,
                    autograph=False).get_concrete_function(*self._specs)
        return self._fns[variant]

    def _tapes_work(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], variant: str = "tapes"
                    ) -> bool:
        """Whether the nested tapes (or the forward Laplacian) build and run for this model;
        if not, they are dropped from the variants (the tiled builds compute the same)."""
        if variant not in self.variants:
            return False
        try:
            # the result kept: a first call that takes this build returns it, not a second run
            self._tried = (variant, u, self._run(variant, u, ctx))
        except (BatchJacError, Warning):
            raise
        except Exception as e:
            if _out_of_memory(e):
                raise
            self._fns.pop(variant, None)
            self.variants = tuple(v for v in self.variants if v != variant)
            text = str(getattr(e, "message", e)).strip().splitlines()
            what = "nested tapes" if variant == "tapes" else _FORWARD_RULES[variant]
            why = f"{what} failed: {text[0][:200] if text else type(e).__name__}"
            self.tapes_failed = f"{self.tapes_failed}; {why}" if self.tapes_failed else why
            return False
        return True

    # a mapping of named arrays, which the runner takes as it takes a Jacobian kernel's pair
    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...],  # type: ignore[override]
             budget: CallBudget = UNTUNED) -> dict[str, np.ndarray]:
        if self.variant is None:
            with self.building:  # (threads sharing the kernel: one chooses its build)
                if self.variant is None:
                    self.choose(u, ctx, budget)
        assert self.variant is not None
        tried, self._tried = self._tried, None
        try:
            if tried is not None and tried[0] == self.variant and tried[1] is u:
                out = tried[2]  # (computed on these rows by the check that the build works)
            else:
                out = self._fn(self.variant)(u, *ctx, *self._seed_arrays)
        except (*_XLA_ERRORS, *compat.XLA_GRADIENT_GAP) as e:
            if self.variant != "xla" or _out_of_memory(e):
                raise
            self._fallback(e)
            out = self._fn("graph")(u, *ctx, *self._seed_arrays)
        if not self._twice_checked:
            self._check_twice(u, ctx, out)  # (raises on every call of a kernel that fails it)
            self._twice_checked = True
        if _is_tensor(u):  # tensors in, tensors out, where TensorFlow computed them
            return dict(out)
        return {name: np.asarray(a) for name, a in out.items()}

    #: whether the first chunk's result was checked for second derivatives lost to a
    #: gradient TensorFlow cannot differentiate (:meth:`_check_twice`)
    _twice_checked = False
    #: rows of the check's eager tapes
    TWICE_CHECK_ROWS = 4

    def _check_twice(self, u: Any, ctx: tuple[Any, ...], out: Any) -> None:
        """Every build reads a second derivative TensorFlow finds no path for as zero (what a
        constant gradient gives). So does a gradient that changes with the inputs but that
        TensorFlow cannot differentiate: a ``tf.custom_gradient`` whose gradient function stops
        the gradient or computes with numpy (``tf.numpy_function``). For an output whose
        second derivatives are all zero on the first chunk, eager tapes on a few of its rows
        tell the two apart: its gradient has no path back to the inputs, yet its values at
        other inputs differ. Then a ModelError, not zeros."""
        bound = self._bound
        m = int(np.prod(bound.output_shape or (), dtype=np.int64))
        second = tf.convert_to_tensor(out[SECOND_RESULT[self.kind]])
        rows = int(second.shape[0])
        if rows == 0 or m == 0:
            return
        nonzero = tf.reduce_any(tf.not_equal(tf.reshape(second, (rows, m, -1)), 0), axis=(0, 2))
        zero = [int(o) for o in np.flatnonzero(~np.asarray(nonzero))]
        if not zero:
            return
        if self.kind == "hvp":
            ctx = ctx[:-1]  # (the tangents)
        try:
            lost = self._lost_second(u, ctx, zero, m)
        except (BatchJacError, Warning):
            raise
        except Exception:  # (the model does not run eagerly: the check cannot tell)
            return
        if lost:
            shown = ", ".join(str(o) for o in lost[:5]) + (" ..." if len(lost) > 5 else "")
            raise ModelError(
                f"The model is not twice differentiable: the gradient of output "
                f"{'(flat index) ' if m > 1 else ''}{shown} changes with the inputs, but "
                f"TensorFlow finds no path from it back to them, so its second derivatives "
                f"would come out as zeros. Usual cause: a tf.custom_gradient whose gradient "
                f"function is not differentiable (it uses tf.stop_gradient, numpy or "
                f"tf.numpy_function). Write the gradient function with TensorFlow operations "
                f"of the inputs it depends on; batchjac.jacobian (first derivatives) works with "
                f"the model as it is.")

    def _lost_second(self, u: Any, ctx: tuple[Any, ...], outputs: list[int], m: int
                     ) -> list[int]:
        """The ``outputs`` whose gradient TensorFlow cannot differentiate though it varies
        (see :meth:`_check_twice`), on the first :attr:`TWICE_CHECK_ROWS` rows."""
        bound = self._bound
        n = min(self.TWICE_CHECK_ROWS, int(u.shape[0]))
        x = tf.cast(tf.convert_to_tensor(u[:n]), bound.tf_dtype)
        c = tuple(tf.convert_to_tensor(a[:n]) for a in ctx)
        # a tf.function's Python function (no trace of the model for these shapes)
        python = getattr(bound.model, "python_function", None)
        own = python if python is not None and not bound.is_keras else None

        def gradients(at: tf.Tensor, outer: Any = None) -> dict[int, Any]:
            with tf.GradientTape(persistent=True) as inner:
                inner.watch(at)
                y = tf.reshape(bound.apply(at, c, model=own), (n, m))
            return {o: inner.gradient(y, at, output_gradients=tf.one_hot(
                tf.fill((n,), o), m, dtype=y.dtype)) for o in outputs}

        with tf.GradientTape(persistent=True) as outer:
            outer.watch(x)
            grads = gradients(x)
        unconnected = [o for o, g in grads.items()
                       if g is not None and outer.gradient(g, x) is None]
        if not unconnected:
            return []
        elsewhere = gradients(x * 1.5 + 0.25)
        lost = []
        for o in unconnected:
            a, b = np.asarray(grads[o]), elsewhere[o]
            b = np.zeros_like(a) if b is None else np.asarray(b)
            scale = max(float(np.max(np.abs(a), initial=0.0)), 1.0)
            if not np.allclose(a, b, rtol=1e-5, atol=1e-6 * scale):
                lost.append(o)
        return lost

    def _run(self, variant: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
        out = self._fn(variant)(u, *ctx, *self._seed_arrays)
        np.asarray(next(iter(out.values())))
        return out

    #: (build, rows, result) of the last check that a build works (see :meth:`_tapes_work`)
    _tried: tuple[str, Any, Any] | None = None

    def _select(self, variant: str, note: str) -> None:
        if variant == "tapes":
            note = f"{note}: nested batch_jacobian tapes"
        elif variant in _FORWARD_RULES:
            note = f"{note}: a {_FORWARD_RULES[variant]} (one pass)"
        if self.tapes_failed and variant not in _FORWARD_RULES:  # (why not the other builds)
            note = f"{note}; {self.tapes_failed}"
        self.variant, self.note = variant, f"{self.kind}: {self.order}, {note}"

    # -- the builds as the chooser (:mod:`batchjac._tune.chooser`) sees them: the plain graph,
    # untimed, unless the work at hand repays compiling XLA too and timing both (the tuning
    # policy, :mod:`batchjac._tune.policy`). XLA may take far longer to build than the graph
    # (constant folding of the tangents' zero products) for a small gain a chunk
    # (docs/thresholds.md)

    @property
    def known(self) -> str | None:
        # the ladder of chunk sizes compares sizes on one build, and each size's race would
        # compile every build
        return self._bound.tuning.builds.get((self.kind, self.order))

    def take(self, name: str, why: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if name in ("tapes", *_FORWARD_RULES) and not self._tapes_work(u, ctx, name):
            name = "graph"  # the same values without pfor, on a machine where it failed
        self._select(name, f"{name} ({why})")

    def untimed_first(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget
                      ) -> tuple[str, str, bool]:
        from .._base import untimed_note

        # the first build that works (the tapes and the forward Laplacian may not)
        first = next((v for v in self.variants
                      if v not in ("tapes", *_FORWARD_RULES) or self._tapes_work(u, ctx, v)),
                     "graph")
        return first, f"{first} ({untimed_note()})", True

    @property
    def retunable(self) -> bool:
        return "xla" in self.variants

    #: builds slower than the fastest by this factor at their first timed run are not raced
    #: further (each run is a whole chunk: the nested tapes and the tiled builds take several
    #: times the forward rules' time on a large one)
    PRUNE = 1.3
    race_options = {"prune": PRUNE}  # noqa: RUF012 - read only

    def contenders(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[str, ...]:
        # each made and run once before the race times it (the race prunes on one run)
        self._tapes_work(u, ctx)
        self._tapes_work(u, ctx, "forward-laplacian")
        self._tapes_work(u, ctx, "forward-hessian")
        if "xla" in self.variants:
            try:
                self._run("xla", u, ctx)
            except Exception as e:
                if isinstance(e, Warning) or _out_of_memory(e):
                    raise
                self._fallback(e)
        if len(self.variants) < 2:  # (XLA failed and the tapes too: the graph, said so)
            return ()
        if "graph" not in self._fns:
            self._run("graph", u, ctx)
        return tuple(sorted(self.variants, key=("graph", "xla", "tapes", *_FORWARD_RULES).index))

    def run_build(self, name: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        self._run(name, u, ctx)

    def raced_to(self, best: str, times: dict[str, float], u: Any) -> None:
        timed = ", ".join(f"{v} {t * 1e3:.1f} ms" for v, t in times.items())
        self._select(best, f"{best} (timed one chunk: {timed})")
        self._bound.tuning.builds[(self.kind, self.order)] = best

    def _fallback(self, xla_error: Exception) -> None:
        bound = self._bound
        if not bound._xla_warned:
            bound._xla_warned = True
            text = str(getattr(xla_error, "message", xla_error)).strip().splitlines()[0][:300]
            warnings.warn(f"XLA could not compile this model ({text}); batchjac runs it as a "
                          f"plain TensorFlow graph instead, which is correct but can be slower.",
                          XLAFallbackWarning, stacklevel=user_stacklevel())
        self.variants = tuple(v for v in self.variants if v != "xla")
        self.variant = "graph" if self.variant in (None, "xla") else self.variant
        self.note = f"{self.kind}: {self.order}, {self.variant} (XLA could not compile the model)"

    # -- the computations (traced) -----------------------------------------------------------
    def graph_body(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], tapes: bool = False,
                   forward: bool = False) -> dict[str, tf.Tensor]:
        """:meth:`_body` traced into another function's graph (a differentiable call's,
        :mod:`.differentiable`): its seeds as constants there, the forward rules' chunk whole
        (see :attr:`in_blocks`)."""
        self.in_blocks = False
        self._seed_inputs = {key: tf.constant(a) for key, a in
                             zip(self._seed_keys(), self._seed_values())}
        return self._body(u, ctx, tapes=tapes, forward=forward)

    def _body(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], tapes: bool = False,
              forward: bool = False) -> dict[str, tf.Tensor]:
        bound = self._bound
        assert bound.output_shape is not None
        out_shape, ushape = bound.output_shape, bound.signature.unknown_shape
        m, k, rows = int(np.prod(out_shape)), int(np.prod(ushape)), self.chunk_size
        v = None
        if self.kind == "hvp":
            ctx, v = ctx[:-1], ctx[-1]
        if forward:
            y, jac, second = self._forward_rules(u, ctx, m, k, rows)
        elif tapes:
            y, jac, second = self._nested_tapes(u, ctx, m, k, rows)
        elif self.order == "forward-over-reverse":
            y, jac, second = self._over_reverse(u, ctx, v, m, k, rows)
        else:
            y, jac, second = self._over_forward(u, ctx, v, m, k, rows)
        # second: (rows, m, k) for diagonal/hvp, (rows, m, k, k) for the Hessian
        if self.kind == "laplacian":
            if not forward:  # (the forward Laplacian's is the sum already)
                second = tf.reduce_sum(second if len(second.shape) == 3 else
                                       tf.linalg.diag_part(second), -1)
            second = tf.reshape(second, (rows, *out_shape))
        elif self.kind == "hessian":
            second = tf.reshape(second, (rows, *out_shape, *ushape, *ushape))
        else:
            if len(second.shape) == 4:
                second = tf.linalg.diag_part(second)
            second = tf.reshape(second, (rows, *out_shape, *ushape))
        out = {SECOND_RESULT[self.kind]: second}
        if self.with_outputs:
            out["outputs"] = tf.reshape(y, (rows, *out_shape))
        if self.with_jacobian:
            out["jacobians"] = tf.reshape(jac, (rows, *out_shape, *ushape))
        return out

    def _nested_tapes(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], m: int, k: int, rows: int
                      ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``batch_jacobian`` of ``batch_jacobian`` (pfor): ``(y, J (rows, m, k), H (rows, m,
        k, k))``. Unconnected gradients are zeros, not the ``None`` of the plain tapes."""
        flat_u = tf.reshape(u, (rows, k))
        zero = tf.UnconnectedGradients.ZERO
        with tf.GradientTape() as outer:
            outer.watch(flat_u)
            with tf.GradientTape() as inner:
                inner.watch(flat_u)
                y = self._bound.apply(tf.reshape(flat_u, tf.shape(u)), ctx)
                flat_y = tf.reshape(y, (rows, m))
            jac = inner.batch_jacobian(flat_y, flat_u, unconnected_gradients=zero)
        hess = outer.batch_jacobian(jac, flat_u, unconnected_gradients=zero)
        return y, jac, hess

    #: whether the forward rules run a large chunk in blocks (below); not in a differentiable
    #: call, whose gradient keeps every block's values anyway and whose while loop's gradient
    #: TensorFlow builds and runs slowly
    in_blocks = True
    #: rows of a block of the forward Laplacian, for chunks at least twice as large: the chunk
    #: in a ``tf.map_fn`` of blocks under XLA, whose temporaries ((k + 2) values per activation)
    #: stay in cache (measured: docs/thresholds.md)
    LAPLACIAN_BLOCK_ROWS = 2048
    #: the same for the forward Hessian, whose activations carry ``1 + k + k(k+1)/2`` values
    #: (docs/thresholds.md)
    HESSIAN_BLOCK_ROWS = 512

    def _forward_rules(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], m: int, k: int,
                       rows: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``(y, J (rows, m, k), Laplacian (rows, m))``, or the Hessian ``(rows, m, k, k)``
        for a Hessian kernel, in one pass (:mod:`.laplacian`) over the model's own graph,
        traced here for the chunk's shapes."""
        from . import laplacian

        bound = self._bound
        ushape = tuple(bound.signature.unknown_shape)
        model = bound.model
        # a plain callable is wrapped in a tf.function, whose graph would hold one call op:
        # trace its Python function, so that the graph holds the model's own operations
        inner = getattr(model, "python_function", None)

        own = inner if inner is not None and not bound.is_keras else None

        flat = tf.reshape(u, (rows, k))
        hessian = self.kind == "hessian"
        limit = self.HESSIAN_BLOCK_ROWS if hessian else self.LAPLACIAN_BLOCK_ROWS
        block = _evened(rows, limit) if rows >= 2 * limit and self.in_blocks else rows
        specs = [tf.TensorSpec((block, k), bound.tf_dtype),
                 *(tf.TensorSpec((block, *s.shape[1:]), s.dtype) for s in self._specs[1:1 + len(ctx)])]

        def apply(flat_u: tf.Tensor, *c: tf.Tensor) -> tf.Tensor:
            y = bound.apply(tf.reshape(flat_u, (block, *ushape)), c, model=own)
            return tf.reshape(y, (block, m))

        concrete = laplacian.traced_model(apply, specs)
        push = laplacian.run_hessian if hessian else laplacian.run

        def one_pass(flat_u: tf.Tensor, c: tuple[tf.Tensor, ...]
                     ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            y, d, second = push(concrete, flat_u, c)
            if hessian:  # (k, k, rows, m) -> (rows, m, k, k)
                second = tf.transpose(second, (2, 3, 0, 1))
            return y, tf.transpose(d, (1, 2, 0)), second

        if block == rows:
            return one_pass(flat, ctx)
        dtype = bound.tf_dtype
        y, jac, lap = _map_blocks(lambda fu, *c: one_pass(fu, c), (flat, *ctx), block,
                                  (tf.TensorSpec((block, m), dtype),
                                   tf.TensorSpec((block, m, k), dtype),
                                   tf.TensorSpec((block, m, k, k) if hessian else (block, m),
                                                 dtype)))
        return y, jac, lap

    def _tiled(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], blocks: int
               ) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
        def tile(a: tf.Tensor) -> tf.Tensor:
            return tf.tile(a, [blocks] + [1] * (len(a.shape) - 1))
        return tile(u), tuple(tile(c) for c in ctx)

    def _seed_keys(self) -> list[tuple[Any, ...]]:
        """The unit-vector seeds the body uses (see :meth:`_seeds`): ``(index, width, shape)``,
        block ``b`` seeded with ``e_{index[b]}`` of ``shape``."""
        bound = self._bound
        assert bound.output_shape is not None
        out_shape, ushape = tuple(bound.output_shape), tuple(bound.signature.unknown_shape)
        m, k = int(np.prod(out_shape)), int(np.prod(ushape))
        if self.order == "forward-over-reverse":
            per = 1 if self.kind == "hvp" else k
            keys = [(tuple(np.repeat(np.arange(m), per).tolist()), m, out_shape)]
            if self.kind != "hvp":
                keys.append((tuple(np.tile(np.arange(k), m).tolist()), k, ushape))
            return keys
        full = self.kind == "hessian"
        inner = np.repeat(np.arange(k), k) if full else np.arange(k)
        keys = [(tuple(inner.tolist()), k, ushape)]
        if self.kind != "hvp":
            outer = np.tile(np.arange(k), k) if full else np.arange(k)
            keys.append((tuple(outer.tolist()), k, ushape))
        return keys

    def _seed_values(self) -> list[np.ndarray]:
        rows, dtype = self.chunk_size, self._bound.signature.dtype
        values = []
        for index, width, shape in self._seed_keys():
            eye = np.eye(width, dtype=dtype)[list(index)]  # (blocks, width)
            values.append(np.repeat(eye, rows, axis=0).reshape((len(index) * rows, *shape)))
        return values

    def _seeds(self, index: np.ndarray, width: int, rows: int, shape: tuple[int, ...]) -> tf.Tensor:
        """Block ``b`` (``rows`` rows) holds the unit vector ``e_{index[b]}`` of ``shape``.

        The seeds are arguments of the compiled function, not constants: XLA constant-folds
        the products of the weights with constant seeds (each ``(blocks * rows, width)``),
        which took most of a first call (docs/thresholds.md), and it folded them read from a
        variable too."""
        return self._seed_inputs[(tuple(int(i) for i in index), width, tuple(shape))]

    def _over_reverse(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: tf.Tensor | None,
                      m: int, k: int, rows: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        bound = self._bound
        out_shape, ushape = bound.output_shape or (), bound.signature.unknown_shape
        tangents_per = 1 if v is not None else k
        blocks = m * tangents_per
        uu, cc = self._tiled(u, ctx, blocks)
        cot = self._seeds(np.repeat(np.arange(m), tangents_per), m, rows, tuple(out_shape))
        if v is None:
            tan = self._seeds(np.tile(np.arange(k), m), k, rows, tuple(ushape))
        else:
            tan = tf.tile(v, [m] + [1] * (len(v.shape) - 1))
        with tf.autodiff.ForwardAccumulator(uu, tan) as acc:
            with tf.GradientTape() as tape:
                tape.watch(uu)
                y = bound.apply(uu, cc, twice=True)
            grad = tape.gradient(y, uu, output_gradients=cot,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        dgrad = acc.jvp(grad, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # grad, dgrad: (m, tangents, rows, k): block (a, j) holds J[:, a, :] and H[:, a, :, j]
        jac = tf.transpose(tf.reshape(grad, (m, tangents_per, rows, k))[:, 0], (1, 0, 2))
        d = tf.reshape(dgrad, (m, tangents_per, rows, k))
        second = tf.transpose(d[:, 0], (1, 0, 2)) if v is not None else tf.transpose(d, (2, 0, 3, 1))
        return y[:rows], jac, second

    def _over_forward(self, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], v: tf.Tensor | None,
                      m: int, k: int, rows: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        bound = self._bound
        ushape = tuple(bound.signature.unknown_shape)
        full = self.kind == "hessian"
        blocks = k * k if full else k
        uu, cc = self._tiled(u, ctx, blocks)
        inner_i = np.repeat(np.arange(k), k) if full else np.arange(k)
        outer_j = np.tile(np.arange(k), k) if full else np.arange(k)
        # hvp: block i pushed along e_i inside and v outside, (H v)_i
        outer_t = self._seeds(outer_j, k, rows, ushape) if v is None else \
            tf.tile(v, [k] + [1] * (len(v.shape) - 1))
        with tf.autodiff.ForwardAccumulator(uu, outer_t) as outer:
            with tf.autodiff.ForwardAccumulator(uu, self._seeds(inner_i, k, rows, ushape)) as inner:
                y = bound.apply(uu, cc, twice=True)
            dy = inner.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        d2y = outer.jvp(dy, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        if full:  # block (i, j): dy = J[:, :, i], d2y = H[:, :, i, j]
            jac = tf.transpose(tf.reshape(dy, (k, k, rows, m))[:, 0], (1, 2, 0))
            return y[:rows], jac, tf.transpose(tf.reshape(d2y, (k, k, rows, m)), (2, 3, 0, 1))
        jac = tf.transpose(tf.reshape(dy, (k, rows, m)), (1, 2, 0))
        return y[:rows], jac, tf.transpose(tf.reshape(d2y, (k, rows, m)), (1, 2, 0))
