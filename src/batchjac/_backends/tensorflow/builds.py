"""First-order TensorFlow builds: the Jacobians in forward and reverse mode, vectorised by pfor
or in a while loop (:data:`PATHS`), and :class:`TFKernel`, which compiles them with XLA and
as a plain graph and keeps the faster."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from ..._errors import (
    ForwardModeFallbackWarning,
    ModelError,
    ReverseModeFallbackWarning,
    VectorizationFallbackWarning,
    XLAFallbackWarning,
)
from ..._tune.chooser import Build
from .._base import (
    BESIDE,
    UNTUNED,
    CallBudget,
    Kernel,
    Mode,
    asked_mode_failed,
    fallback_message,
    first_line,
    idle_core,
    other_mode,
    user_stacklevel,
)
from . import compat

if TYPE_CHECKING:
    from . import TFBound


#: the ways a kernel can compute the Jacobians: a mode, vectorised by pfor (vectorized_map,
#: batch_jacobian), or in a while loop over the basis where pfor cannot vectorise the model
PATHS = ("forward", "reverse", "forward-loop", "reverse-loop")


_PATH_NAMES = {"forward": "forward mode", "reverse": "reverse mode",
               "forward-loop": "forward mode in a loop", "reverse-loop": "reverse mode in a loop",
               "mixed": "mixed mode"}
#: the path that accumulates in mixed mode along a Keras model's chain (:mod:`.chain`): not
#: one of PATHS, which a kernel falls back along; taken first where the model offers it
MIXED = "mixed"


def _path_mode(path: str) -> Mode:
    return "forward" if path.startswith("forward") else "reverse"


#: why forward mode fails in TensorFlow, for the fallback's warning and error
_FORWARD_CAUSE = ("Usual cause: control flow (while loops, tf.foldl, tf.map_fn, tf.cond) or "
                  "variables read inside it, which TensorFlow's forward-mode accumulator cannot "
                  "trace, or an output that is not a plain tensor.")
_REVERSE_CAUSE = "Usual cause: an operation without a registered gradient."
_PFOR_CAUSE = ("Usual cause: control flow (tf.map_fn, while loops, tf.cond) that TensorFlow's "
               "vectoriser, pfor, has no rule for.")


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, tf.errors.ResourceExhaustedError))


def _at_run_time(e: BaseException | None) -> bool:
    """Whether a failure happened while the graph ran (an op's error, which may depend on the
    values), not while it was built (the same for any rows)."""
    while e is not None:
        if isinstance(e, tf.errors.OpError):
            return True
        e = e.__cause__
    return False


#: what a model XLA cannot compile raises when its XLA build first runs
_XLA_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError)


def jac_reverse(bound: TFBound, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], pfor: bool = True
                ) -> tuple[tf.Tensor, tf.Tensor]:
    """``pfor=False``: batch_jacobian's while loop over the outputs, for models whose
    gradient pfor cannot vectorise."""
    # batch_jacobian wants a target and a source of rank >= 2: a scalar output per
    # instance, (N,), is exactly where mode="auto" picks reverse mode. Both are flattened
    # to (N, m) and (N, k) (reshapes, which change no value) and J is shaped back.
    ushape = bound.signature.unknown_shape
    k = int(np.prod(ushape, dtype=np.int64))
    rows = tf.shape(u)[0]
    flat_u = tf.reshape(u, (-1, k))
    with tf.GradientTape() as tape:
        tape.watch(flat_u)
        y = bound.apply(tf.reshape(flat_u, tf.shape(u)), ctx)
        m = y.shape[1:].num_elements()
        flat_y = tf.reshape(y, (rows, -1 if m is None else m))
    jac = compat.batch_jacobian(tape, flat_y, flat_u, pfor=pfor)
    if jac is None:  # (a TensorFlow whose batch_jacobian cannot be told to loop)
        jac = _looped_reverse(bound, u, ctx, flat_u, tf.shape(flat_y)[1])
    return y, tf.reshape(jac, tf.concat([tf.shape(y), list(ushape)], axis=0))


def _looped_reverse(bound: TFBound, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], flat_u: tf.Tensor,
                    m: tf.Tensor) -> tf.Tensor:
    """``(rows, m, k)``: batch_jacobian's while loop over the outputs with public calls only, a
    pass of the model and one of its gradient per output."""
    rows = tf.shape(u)[0]

    def one(i: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(flat_u)
            y = bound.apply(tf.reshape(flat_u, tf.shape(u)), ctx)
            column = tf.gather(tf.reshape(y, (rows, -1)), i, axis=1)
        return tape.gradient(column, flat_u, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    return tf.transpose(tf.map_fn(one, tf.range(m), fn_output_signature=bound.tf_dtype), (1, 0, 2))


def jac_forward(bound: TFBound, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], pfor: bool = True
                ) -> tuple[tf.Tensor, tf.Tensor]:
    """``pfor=False``: a ``tf.map_fn`` (while loop) over the tangents instead of
    ``tf.vectorized_map``, for models whose forward mode pfor cannot vectorise."""
    ushape = bound.signature.unknown_shape
    k = int(np.prod(ushape, dtype=np.int64))
    if k == 0:  # no unknown feature: no tangent to push (vectorized_map of none fails)
        y = bound.apply(u, ctx)
        return y, tf.zeros(tf.concat([tf.shape(y), list(ushape)], axis=0), bound.tf_dtype)
    basis = tf.reshape(tf.eye(k, dtype=bound.tf_dtype), (k, *ushape))
    y, jvps = pushed(bound, u, ctx, basis, pfor)  # (k, B, *out)
    rows = tf.shape(u)[0]
    out_shape = tf.shape(y)[1:]
    jac = tf.transpose(tf.reshape(jvps, (k, rows, -1)), (1, 2, 0))
    jac = tf.reshape(jac, tf.concat([[rows], out_shape, list(ushape)], axis=0))
    return y, jac


def pushed(bound: TFBound, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], tangents: tf.Tensor,
           pfor: bool = True) -> tuple[tf.Tensor, tf.Tensor]:
    """``(y, J v)`` for ``d`` directions at once: ``tangents`` ``(d, *unknown)`` (shared by the
    rows: a basis) or ``(d, rows, *unknown)`` (a direction per row), ``J v`` ``(d, rows, *out)``.
    One forward-mode pass vectorised over the directions by pfor, or (``pfor=False``) a
    ``tf.map_fn`` loop over them for models pfor cannot vectorise."""

    def one(tangent: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.autodiff.ForwardAccumulator(u, tf.broadcast_to(tangent, tf.shape(u))) as acc:
            y = bound.apply(u, ctx)
        return y, acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    if pfor:
        ys, jvps = tf.vectorized_map(one, tangents)
    else:
        ys, jvps = tf.map_fn(one, tangents, fn_output_signature=(bound.tf_dtype, bound.tf_dtype))
    return ys[0], jvps


def pulled(bound: TFBound, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], cotangents: tf.Tensor,
           pfor: bool = True) -> tuple[tf.Tensor, tf.Tensor]:
    """``(y, c^T J)`` for ``d`` directions ``cotangents`` ``(d, rows, *out)`` at once, ``c^T J``
    ``(d, rows, *unknown)``: one forward pass on a persistent tape, its gradients vectorised
    over the directions by pfor, or (``pfor=False``) one gradient per direction."""
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(u)
        y = bound.apply(u, ctx)

    def one(c: tf.Tensor) -> tf.Tensor:
        return tape.gradient(y, u, output_gradients=c,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

    if pfor:
        return y, tf.vectorized_map(one, cotangents)
    return y, tf.stack([one(cotangents[i]) for i in range(int(cotangents.shape[0]))])


def jacobian_fn(bound: TFBound, path: str) -> Callable[[tf.Tensor, tuple[tf.Tensor, ...]],
                                                     tuple[tf.Tensor, tf.Tensor]]:
    """``(u, ctx) -> (y, J)`` for one of :data:`PATHS`, or :data:`MIXED`."""
    if path == MIXED:
        from . import chain

        return lambda u, ctx: chain.jacobians(bound, u, ctx, forward=jac_forward,
                                              reverse=jac_reverse)
    jac = jac_forward if _path_mode(path) == "forward" else jac_reverse
    pfor = not path.endswith("-loop")
    return lambda u, ctx: jac(bound, u, ctx, pfor)


class TFKernel(Kernel):
    """XLA (``jit_compile=True``) or a plain TensorFlow graph, whichever is faster here.

    Neither always wins on a CPU: XLA removes per-op dispatch, which dominates small chunks,
    while TensorFlow's own (oneDNN) kernels for large matrix products and convolutions beat
    XLA's (measured: docs/thresholds.md, "TensorFlow's builds"). So the first call compiles
    both and times one chunk in each (interleaved, the minimum of a few), unless a variant
    was fixed with :meth:`use`.

    Where a core is free, the later race's XLA builds (and an XLA build an earlier process
    chose) are compiled on the thread beside the calls, which go on in the plain graph until
    they are made (:meth:`contenders_beside`, :meth:`make`): the calls wait for no XLA
    compilation (measured on W1: BENCHMARKS.md, time to the K-th answer).

    A chunk of at least :data:`BLOCKED_CHUNK` rows has a third build, ``"xla/blocks"``: XLA
    over blocks of about :data:`BLOCK_ROWS` rows in a ``tf.map_fn``, whose temporaries stay
    in cache. Raced only, never the untimed first: it wins on large chunks of small rows and
    loses on small chunks and wide rows (measured: docs/thresholds.md, ``TFKernel.BLOCK_ROWS``).
    """

    variants: tuple[str, ...] = ("xla", "graph")
    @property
    def cheap_first(self) -> str | None:
        return "graph"  # built sooner than XLA compiles (see untimed_first)
    #: rows of a block of "xla/blocks" (evened over the chunk), and the least chunk that has it
    BLOCK_ROWS, BLOCKED_CHUNK = 4096, 16384

    def __init__(self, bound: TFBound, mode: Mode, chunk_size: int, with_outputs: bool,
                 budget: CallBudget = UNTUNED) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        self._bound = bound
        self._specs = bound._specs(chunk_size)
        #: how the Jacobians are computed (one of PATHS), chosen by the first call: ``mode``,
        #: unless it fails for this model (see :meth:`_establish`)
        self.path: str | None = None
        #: why the paths before ``path`` failed (empty when ``path`` is ``mode``)
        self.failures: list[tuple[str, str]] = []
        self._fns: dict[str, Any] = {}
        self.variants = self._builds()
        self.variant = None
        self.note = ""
        #: ``(variant, result)`` of the first call's run, its answer (:meth:`_kept_result`)
        self._kept: tuple[str, Any] | None = None
        #: XLA builds being made beside the calls (:meth:`contenders_beside`)
        self._making: dict[str, concurrent.futures.Future[Any]] = {}

    def _builds(self) -> tuple[str, ...]:
        """XLA and the graph, and on the CPU XLA in blocks for a chunk of :data:`BLOCKED_CHUNK`
        rows (a GPU's memory is not a CPU's cache: not offered there)."""
        blocked = ("xla/blocks",) if self.chunk_size >= self.BLOCKED_CHUNK and \
            not tf.config.list_logical_devices("GPU") else ()
        return (*type(self).variants, *blocked)

    @property
    def computes(self) -> Mode:
        """The kernel's mode, or the other where it fell back (a mixed path is neither: the
        kernel's own, for the checks of a mode asked for)."""
        return self.mode if self.path in (None, MIXED) else _path_mode(self.path)

    def _enter(self, path: str) -> None:
        """Compute by ``path`` from now on; nothing is traced until it is used (the untimed
        first call traces the plain graph only)."""
        bound, with_outputs = self._bound, self.with_outputs
        jac = jacobian_fn(bound, path)

        def traced(u: tf.Tensor, *ctx: tf.Tensor) -> Any:
            bound.trace_count += 1
            y, j = jac(u, ctx)
            return (y, j) if with_outputs else j

        self._traced = traced
        self.path = path
        self._fns, self._making = {}, {}
        self.variants = self._builds()  # (a path XLA failed for had the graph only)
        self.variant, self.note, self.untimed = None, "", False

    def _fn(self, variant: str) -> Any:
        if variant not in self._fns:
            making = self._making.pop(variant, None)
            made = None
            if making is not None:
                with contextlib.suppress(Exception):  # (a failure to trace: again, here)
                    made = making.result()
            self._fns[variant] = made if made is not None else self._concrete(variant)
        return self._fns[variant]

    def _concrete(self, variant: str) -> Any:
        """Build ``variant``'s concrete function (traced, not yet compiled by XLA)."""
        graph = self._fns.get("graph")
        if variant == "xla" and graph is not None:
            # XLA of a call of the plain graph traced already: the model and its Jacobian
            # are not traced again, XLA compiles the called graph whole (the race's XLA
            # build costs its compilation only: docs/thresholds.md, "TensorFlow's builds")
            fn = tf.function(lambda *args: graph(*args), jit_compile=True, autograph=False)
        else:
            traced = self._in_blocks() if variant == "xla/blocks" else self._traced
            fn = tf.function(traced, jit_compile=variant.startswith("xla"), autograph=False)
        return fn.get_concrete_function(*self._specs)

    def _make_beside(self, variant: str, u: Any, ctx: tuple[Any, ...]) -> None:
        """Trace ``variant`` and compile it by XLA on the thread beside the calls, on a copy
        of a chunk (XLA compiles on a build's first run; that run's result is dropped): the
        calls go on in the build in use meanwhile, and :meth:`_fn` takes the result."""
        if variant in self._fns or variant in self._making:
            return
        u, ctx = _copied(u), tuple(_copied(c) for c in ctx)

        def make() -> Any:
            fn = self._concrete(variant)
            with contextlib.suppress(Exception):  # (XLA refuses the model: the race's call
                _wait(fn(u, *ctx), self.with_outputs)  # of it says so, on the user's call)
            return fn

        self._making[variant] = BESIDE.submit(make)

    def _in_blocks(self) -> Callable[..., Any]:
        """The traced Jacobians over blocks of the chunk (:data:`BLOCK_ROWS`, evened), in a
        ``tf.map_fn`` (:func:`_map_blocks`)."""
        bound, traced = self._bound, self._traced
        assert bound.output_shape is not None
        block = _evened(self.chunk_size, self.BLOCK_ROWS)
        out_shape, ushape = tuple(bound.output_shape), tuple(bound.signature.unknown_shape)
        jac = tf.TensorSpec((block, *out_shape, *ushape), bound.tf_dtype)
        signature = (tf.TensorSpec((block, *out_shape), bound.tf_dtype), jac) \
            if self.with_outputs else jac
        return lambda u, *ctx: _map_blocks(traced, (u, *ctx), block, signature)

    def _select(self, variant: str, note: str) -> None:
        # the concrete function's flat call, which skips re-binding the arguments to the
        # signature (a quarter of a small chunk); the public call where this TensorFlow has none
        self._call = compat.fast_call(self._fn(variant))
        if self.failures and self.path is not None:
            note = f"{note}; computed in {_PATH_NAMES[self.path]} ({self._why()})"
        self.variant, self.note = variant, note

    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
             ) -> tuple[np.ndarray | None, np.ndarray]:
        established = None
        if self.variant is None:
            with self._bound.tracing, self.building:  # (threads: one establishes it)
                if self.variant is None:
                    established = (self._establish(u, ctx, budget),)
        if established is not None:
            out = established[0]
        else:
            if self.path is not None and self.computes != self.mode and \
                    budget.mode_asked:  # an earlier call fell back; this one asks the mode
                raise self._asked_failed()
            out = self._call_selected(u, ctx)
        if _is_tensor(u):  # tensors in, tensors out, where TensorFlow computed them
            return (out[0], out[1]) if self.with_outputs else (None, out)
        # The Jacobians as a read-only view of TensorFlow's buffer: ``.numpy()`` would copy
        # them (a fifth of a large call's time, docs/thresholds.md). Read-only because
        # TensorFlow may hand out one buffer twice (a constant-folded Jacobian); the runner
        # copies chunks into the result anyway.
        if self.with_outputs:
            return out[0].numpy(), np.asarray(out[1])
        return None, np.asarray(out)

    def _call_selected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
        try:
            return self._call(u, *ctx)
        except _XLA_ERRORS as e:
            if not str(self.variant).startswith("xla") or "graph" not in self.variants:
                raise
            self._xla_failed(e)  # XLA fixed (use) on a kernel that ran the graph until then
            return self._call(u, *ctx)

    def _paths(self) -> list[str]:
        """The paths to try, best first: the kernel's mode, vectorised, then in a loop (which
        runs min(k, m) passes, the number the mode was chosen for), then the other mode
        likewise."""
        other = other_mode(self.mode)
        return [self.mode, f"{self.mode}-loop", other, f"{other}-loop"]

    def _establish(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget) -> Any:
        """The first call: build and run the first path of :meth:`_paths` that works for this
        model (one warning if it is not the first), and keep it. Where only the other mode
        works and the call asked for this one, it raises a ModelError naming the other mode;
        where every path fails, the error of the first (the model's failure, not a mode's).
        Nothing of a path that failed is kept; a failure to build where a later path worked is
        remembered by the bound model (it is the same for every chunk size), one while running
        is not (it may depend on the rows, e.g. an assertion in the model)."""
        bound = self._bound
        own = [self.mode, f"{self.mode}-loop"]
        if budget.mode_asked and all(p in bound.failed for p in own):
            self.failures = [(p, bound.failed[p]) for p in own]
            raise self._asked_failed()
        failures: list[tuple[str, str]] = []
        errors: list[tuple[str, Exception]] = []  # the paths tried by this call that failed
        found = None if budget.mode_asked else bound.accumulation()
        mixed = [MIXED] if found is not None and found[1].sure else []
        for path in [*mixed, *self._paths()]:
            if path in bound.failed:
                failures.append((path, bound.failed[path]))
                continue
            self._enter(path)
            try:
                with compat.quiet_pfor():
                    self.choose(u, ctx, budget)
                    out = self._kept_result()
                    if out is None:
                        out = self._call_selected(u, ctx)
            except Exception as e:
                if isinstance(e, Warning) or _out_of_memory(e):  # warnings as errors, OOM
                    self._reset()
                    raise
                if path == MIXED:  # a piece the reader could not make: the pure paths, silently
                    bound.drop_accumulation(first_line(e))
                    continue
                failures.append((path, first_line(e)))
                errors.append((path, e))
                continue
            for failed, error in errors:
                if not _at_run_time(error):
                    bound.failed[failed] = first_line(error)
            self.failures = failures
            if path == MIXED:
                plan = found[1]  # type: ignore[index]
                self.note = (f"{self.note}; {MIXED} (the model's chain as the plan says; counted "
                             f"{plan.gain:.1f}x ahead of the better pure mode: the pure paths "
                             f"are not tried)")
            if self.computes != self.mode and budget.mode_asked:
                self._reset()  # (the other mode only showed that the failure is the mode's)
                raise self._asked_failed() from (errors[0][1] if errors else None)
            self._warn_fallback(budget)
            return out
        self._reset()
        if errors:
            raise errors[0][1]
        raise ModelError(f"Every way of computing the Jacobians failed for this model: "
                         f"{self._why(failures)}.")

    def _reset(self) -> None:
        """Back to the state before the first call (the next call tries again)."""
        self.path, self._fns, self.variant, self.note, self._kept = None, {}, None, "", None
        self._making = {}
        self.variants = self._builds()

    def _why(self, failures: list[tuple[str, str]] | None = None) -> str:
        failures = self.failures if failures is None else failures
        merged: list[tuple[list[str], str]] = []  # one entry for paths that failed alike
        for path, why in failures:
            if merged and merged[-1][1] == why:
                merged[-1][0].append(_PATH_NAMES[path])
            else:
                merged.append(([_PATH_NAMES[path]], why))
        return "; ".join(f"{' and '.join(names)}: {why}" for names, why in merged)

    def _asked_failed(self) -> Exception:
        cause = _FORWARD_CAUSE if self.mode == "forward" else _REVERSE_CAUSE
        why = self._why([(p, w) for p, w in self.failures if _path_mode(p) == self.mode])
        return asked_mode_failed(self.mode, why, cause)

    def _warn_fallback(self, budget: CallBudget) -> None:
        """One warning per bound model and kind when the path in use is not the first."""
        if not self.failures or self.path is None or budget.plan_race:
            return
        bound = self._bound
        used = _path_mode(self.path)
        loop = " (unvectorised: in a while loop)" if self.path.endswith("-loop") else ""
        if used != self.mode:
            kind: type[Warning] = ForwardModeFallbackWarning if self.mode == "forward" \
                else ReverseModeFallbackWarning
            cause = _FORWARD_CAUSE if self.mode == "forward" else _REVERSE_CAUSE
            text = fallback_message(self.mode, self._why(), cause)
            text = text.replace(f"in {used} mode instead", f"in {used} mode{loop} instead")
        else:
            kind = VectorizationFallbackWarning
            over = "unknowns" if used == "forward" else "outputs"
            text = (f"TensorFlow could not vectorise the {used}-mode Jacobians of this model "
                    f"({self._why()}); batchjac computes them in a while loop over the {over} "
                    f"instead, which gives the same values but is slower. {_PFOR_CAUSE}")
        if kind in bound.warned:
            return
        bound.warned.add(kind)
        warnings.warn(text, kind, stacklevel=user_stacklevel())

    def _run(self, variant: str, u: np.ndarray, ctx: tuple[np.ndarray, ...], *,
             keep: bool = False) -> float:
        """Seconds of one call of ``variant`` on the chunk; with ``keep``, its result is kept
        for :meth:`_kept_result` (the first call's answer, which was otherwise computed twice;
        docs/thresholds.md)."""
        self._kept = None  # (a race's calls keep none: their results would double the peak)
        start = time.perf_counter()
        out = self._fn(variant)(u, *ctx)
        _wait(out, self.with_outputs, copy=not _is_tensor(u))
        if keep:
            self._kept = (variant, out)
        return time.perf_counter() - start

    def _kept_result(self) -> Any:
        """The result :meth:`_run` kept, if it came from the variant now selected (once)."""
        kept, self._kept = self._kept, None
        return kept[1] if kept is not None and kept[0] == self.variant else None

    # -- the builds as the chooser (:mod:`batchjac._tune.chooser`) sees them: XLA runs
    # without a race, the plain graph challenges it, then XLA in blocks the one kept

    def build(self, name: str) -> Build:
        return Build(name, {"xla": 0, "graph": 1}.get(name, 2))

    def take(self, name: str, why: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        if name == "graph":  # no need to compile XLA at all
            self._select("graph", f"graph ({why})")
        elif self._xla_runs(name, u, ctx):
            self._select(name, f"{name} ({why})")

    def untimed_first(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget
                      ) -> tuple[str, str, bool] | None:
        from ..._config import autotune_enabled
        from .._base import untimed_note

        # (with BATCHJAC_AUTOTUNE=off, the first implementation, XLA, as stores use)
        if autotune_enabled():
            # untimed: the plain graph, which is built sooner than XLA compiles (measured:
            # docs/thresholds.md, "TensorFlow's builds"); XLA is tried against it once the
            # work repays a race (retune)
            try:
                self._run("graph", u, ctx, keep=True)
            except tf.errors.OpError:
                pass  # the graph fails where XLA may not: take XLA, untimed
            else:
                return "graph", f"graph ({untimed_note()})", True
        if not self._xla_runs("xla", u, ctx):
            return None
        return "xla", f"xla ({untimed_note()})", False

    def _xla_runs(self, build: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """Run XLA ``build`` on the first call's chunk, keeping the result; where XLA fails
        for the model, the plain graph from now on (False)."""
        try:
            self._run(build, u, ctx, keep=True)
        except Exception as xla_error:  # (a trace-time failure fails the graph below as well)
            if isinstance(xla_error, Warning) or _out_of_memory(xla_error):
                raise
            try:
                self._fn("graph")
                self._run("graph", u, ctx, keep=True)
            except tf.errors.OpError as e:
                raise ModelError(f"The model failed while computing the Jacobian: {e.message}") from e
            self._xla_failed(xla_error)
            return False
        return True

    def _xla_failed(self, xla_error: Exception) -> None:
        """XLA cannot compile this model: the plain graph from now on, with one warning."""
        if not self._bound._xla_warned:
            self._bound._xla_warned = True
            text = str(getattr(xla_error, "message", xla_error)).strip().splitlines()[0][:300]
            warnings.warn(
                f"XLA could not compile this model ({text}); batchjac runs it as a plain "
                f"TensorFlow graph instead, which is correct but can be slower.",
                XLAFallbackWarning, stacklevel=user_stacklevel(),
            )
        self.variants = ("graph",)
        self._select("graph", "graph (XLA could not compile the model)")

    @property
    def retunable(self) -> bool:
        return "xla" in self.variants

    #: the later race runs on the user's calls, its results theirs (:class:`~batchjac._tune.chooser.CallRace`)
    races_on_calls = True

    def contenders_beside(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[str, ...]:
        """The later race's builds. With a core free, XLA's are compiled on the thread beside
        the calls (:meth:`_make_beside`), and the race starts once they are :meth:`ready`;
        without, XLA compiles on its first call of the race (a user's call, its result kept,
        its time not counted). A build that fails on its call leaves the race, the call
        answered again by the plain graph in use (``chooser.failed_call``). A first call's
        race takes :meth:`contenders`."""
        names = tuple(v for v in ("xla", "graph", "xla/blocks") if v in self.variants)
        if idle_core():
            for name in names:
                if name.startswith("xla"):
                    self._make_beside(name, u, ctx)
        return names

    def make(self, name: str, rows: Callable[[], tuple[Any, tuple[Any, ...]]]) -> bool:
        if not name.startswith("xla") or not idle_core() or name in self._fns:
            return True
        if name not in self._making:
            self._make_beside(name, *rows())
        return self.ready(name)

    def ready(self, name: str) -> bool:
        making = self._making.get(name)
        return making is None or making.done()

    @property
    def race_compilations(self) -> int:
        """None that the calls wait for, with a core free: XLA compiles beside them."""
        return 0 if idle_core() else super().race_compilations

    def left_race(self, name: str, error: BaseException) -> None:
        if name.startswith("xla") and isinstance(error, Exception) and not _out_of_memory(error):
            self._xla_failed(error)  # (the plain graph from now on, with the one warning)

    def contenders(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[str, ...]:
        """A first call's race (a later one rides on the calls: :meth:`contenders_beside`):
        XLA's result is the call's answer."""
        if not self._xla_runs("xla", u, ctx):
            return ()
        try:
            self._run("graph", u, ctx)  # trace and warm up
        except Exception as e:  # XLA runs it but the graph does not: keep XLA
            if isinstance(e, Warning):
                raise
            self._select("xla", "xla (the plain graph failed)")
            return ()
        names = ["xla", "graph"]
        if "xla/blocks" in self.variants:
            try:
                self._run("xla/blocks", u, ctx)  # trace, compile and warm up
            except Exception as e:  # (XLA ran the chunk whole: the blocks are optional)
                if isinstance(e, Warning) or _out_of_memory(e):
                    raise
                self.variants = tuple(v for v in self.variants if v != "xla/blocks")
            else:
                names.append("xla/blocks")
        # the shared race (interleaved rounds of back-to-back calls, medians): two single calls
        # each, as this timed before, once kept the slower build just after XLA's compilation
        # (docs/thresholds.md, "TensorFlow's builds")
        return tuple(names)

    def run_build(self, name: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        self._run(name, u, ctx)

    def raced_to(self, best: str, times: dict[str, float], u: Any) -> None:
        names = {"xla": "XLA", "graph": "graph", "xla/blocks": "XLA in blocks"}
        timed = ", ".join(f"{names[v]} {times[v] * 1e3:.1f} ms" for v in names if v in times)
        self._select(best, f"{best} (timed one chunk: {timed or 'the others failed'})")


def _evened(rows: int, limit: int) -> int:
    """Rows of each block when ``rows`` are cut into blocks of at most ``limit``, evened."""
    return -(-rows // -(-rows // limit))


def _map_blocks(fn: Callable[..., Any], arrays: tuple[tf.Tensor, ...], block: int,
                signature: Any) -> Any:
    """``fn`` over blocks of ``block`` rows of ``arrays`` (cut alike) in a ``tf.map_fn``,
    whose results (``signature``: one block's) are joined and cut back to the rows; the last
    block is padded with copies of the last row."""
    rows = int(arrays[0].shape[0])
    blocks = -(-rows // block)
    padded = blocks * block

    def split(a: tf.Tensor) -> tf.Tensor:
        if padded > rows:
            a = tf.concat([a, tf.repeat(a[-1:], padded - rows, axis=0)], 0)
        return tf.reshape(a, (blocks, block, *a.shape[1:]))

    outs = tf.map_fn(lambda args: fn(*args), tuple(split(a) for a in arrays),
                     fn_output_signature=signature)
    return tf.nest.map_structure(lambda o: tf.reshape(o, (padded, *o.shape[2:]))[:rows], outs)


def _copied(a: Any) -> Any:
    """A numpy chunk copied (the runner may fill its buffer again while a build made beside
    the calls runs on it); a tensor as it is."""
    return np.array(a, copy=True) if isinstance(a, np.ndarray) else a


def _wait(out: Any, with_outputs: bool, *, copy: bool = False) -> None:
    """Return once a build's call ``out`` is computed: its Jacobians copied to the host with
    ``copy`` (numpy in, as the calls return them), else one number of them."""
    jac = out[1] if with_outputs else out
    if copy:
        np.asarray(jac)
    else:
        tf.reduce_sum(jac[:1]).numpy()


def _is_tensor(a: Any) -> bool:
    """``tf.is_tensor``, answered at once for a numpy array: ``tf.is_tensor`` checks a
    runtime Protocol, three times a call of a kernel on numpy chunks: about a tenth of a small
    steady call (docs/thresholds.md)."""
    return not isinstance(a, np.ndarray) and tf.is_tensor(a)
