"""The first-order JAX kernel: ``jit(vmap(jacfwd | jacrev))`` over the rows of a chunk,
compiled ahead of time in the builds :class:`JaxKernel` chooses between."""

from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._chain import SURE_GAIN
from ..._errors import (
    ForwardModeFallbackWarning,
    InputError,
    ModelError,
    ReverseModeFallbackWarning,
)
from ..._tune.chooser import Build, timings
from .._base import (
    BESIDE,
    FIRST_VARIANT,
    UNTUNED,
    CallBudget,
    Kernel,
    Mode,
    asked_mode_failed,
    fallback_message,
    first_line,
    idle_core,
    other_mode,
    untimed_note,
    user_stacklevel,
)
from . import compat

if TYPE_CHECKING:
    from . import JaxBound
    from .executables import Options

#: the build that accumulates in mixed mode along the model's chain (:mod:`.chain`)
MIXED = "mixed"

#: why a mode fails in JAX, for the fallback's warning and error
_CAUSES: dict[Mode, str] = {
    "forward": "Usual cause: a jax.custom_vjp function, which has no forward-mode rule.",
    "reverse": ("Usual cause: lax.while_loop (or fori_loop with traced bounds), which has no "
                "reverse-mode rule."),
}


class JaxKernel(Kernel):
    """The compiled chunk kernel, in one of several builds of the same computation.

    *Builds*: "default", whose matrix products are YNNPACK library calls on the CPU, or XLA's
    own dot emitter ("no-ynnpack", the ``xla_cpu_experimental_ynn_fusion_type`` option
    emptied); on the CPU both at XLA's optimisation level 1 without its fusion emitters
    (:data:`~batchjac._backends.jax.compat.CPU_STEADY`: half the compilation, the same speed),
    elsewhere at XLA's defaults. Neither always wins on the CPU: wide products favour the
    second, small chunks neither (measured: docs/thresholds.md, "JAX's builds").

    *Blocks* ("default/125": that build, the chunk computed 125 rows at a time in a
    ``lax.map`` inside the one compiled call). XLA's CPU runtime splits each large operation
    of a chunk over its thread pool, and for small chunks the hand-offs cost more than they
    save. In blocks of a hundred or two rows no operation is large enough to be split, and
    the chunk runs faster; in larger blocks the gain is gone, and convolutions and wide
    forward mode lose. So only :data:`BLOCK_ROWS` are tried, on chunks at least twice as
    large (measured: docs/thresholds.md, ``JaxKernel.BLOCK_ROWS``).

    The first call compiles every variant and times them in one
    :func:`~batchjac._tune.chooser.race` of interleaved rounds (those clearly slower in a
    first timing left out): "no-ynnpack" must beat "default" by the chooser's margin, blocks
    the faster of those by it too. Unless a variant was fixed with :meth:`use` (stores,
    reproducible solves) or ``BATCHJAC_AUTOTUNE=off``: then "default". On a GPU, or a JAX
    without that option, there is only "default".

    *The quick build* ("quick": XLA at optimization level 0 without its fusion emitters, on
    the CPU) is a first call's build when the chunk's elementwise work is at most
    :data:`QUICK_ELEMENTS` (counted from the traced equations, :mod:`batchjac._backends.jax.cost`):
    it compiles in a fraction of the time and runs XLA's own loops slower (matrix products
    are library calls either way), so it pays while the call's elementwise work is small
    (measured: docs/thresholds.md, ``JaxKernel.QUICK_ELEMENTS``). It is never raced and never a store's
    build. Where a second core is free, the build that would otherwise have come first (the
    steady one: "default", or "no-ynnpack" for wide products) is compiled beside it from the
    start, on a thread (XLA compiles outside Python's lock), and replaces it from the second
    call on: the quick build answers the first call early, and the later calls run
    as fast as the native code's, the second call waiting for what is left of that
    compilation (the tier-up; measured: BENCHMARKS.md, time to the K-th answer). Then, or
    without a free core, the race
    the first call skipped, once the work repays it (:mod:`batchjac._tune.policy`), replaces it
    with the fastest of the others. Chunks with wide matrix products
    (:data:`WIDE_PRODUCTS`) take "no-ynnpack" as their first build, untimed, for the same
    reason: the cost model's choice beats a race the first call cannot repay.
    """

    @property
    def _options(self) -> dict[str, Options]:
        """Each build's XLA options on this device (:func:`~batchjac._backends.jax.compat.builds`)."""
        return compat.builds(jax.default_backend())

    #: calls whose equations other than matrix products and convolutions write at most
    #: this many elements (in all their chunks) compile "quick" first: below it the quick
    #: build's slower loops cost less than its compilation saves (docs/thresholds.md)
    QUICK_ELEMENTS = 4e7
    #: chunks of at least this many floating-point operations in matrix products compile
    #: "no-ynnpack" first, where XLA's own emitter was the faster (docs/thresholds.md)
    WIDE_PRODUCTS = 1e10
    #: below this ratio of times, "no-ynnpack" is chosen
    #: block sizes tried (each made even over the chunk: 1,000 rows in blocks of 125)
    BLOCK_ROWS = (128,)
    #: variants slower than the fastest by this factor in a first timing are not raced
    PRUNE = 1.3
    #: blocks are tried where their temporary arrays take at most this many bytes
    BLOCK_MAX_BYTES = 4 << 20

    asynchronous = True

    def __init__(self, bound: JaxBound, mode: Mode, chunk_size: int, with_outputs: bool,
                 budget: CallBudget = UNTUNED) -> None:
        self.mode, self.chunk_size, self.with_outputs = mode, chunk_size, with_outputs
        self._bound = bound
        #: (block rows (the chunk size: no blocks), whether mixed) -> lowering
        self._lowered: dict[tuple[int, bool], Any] = {}
        #: the model's chain and bracketing where the "mixed" build is offered
        #: (:meth:`~batchjac._backends.jax.JaxBound.accumulation`): not where the call asked
        #: for a pure mode
        self._accumulation = None if budget.mode_asked else bound.accumulation()
        self._compiled: dict[str, Any] = {}
        #: the mode computed: ``mode``, or the other one where ``mode`` fails for this model
        #: and the call did not ask for it (see :meth:`_compile_default`)
        self._computes: Mode = mode
        self.failure = ""  # why ``mode`` failed, when ``computes`` is the other mode
        self._jaxpr: Any = None  # the chunk's traced equations (the quick build's count)
        #: the variant compiled first: "quick" for a small chunk on the CPU, else "default",
        #: or the one an earlier race chose, loaded from the disk (:meth:`_load_recalled`)
        self._first = "default"
        #: builds being compiled on the tier-up thread: their futures
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        #: the build the quick one gives way to (the tier-up), where it has one
        self._steady: str | None = None
        self._compile_default(budget)
        self._builds: tuple[str, ...] = ("default",)
        if jax.default_backend() == "cpu":
            self._builds = ("default", "no-ynnpack")
        self._variants: tuple[str, ...] | None = None
        if self._first == MIXED and self._accumulation is not None:
            # (the pure builds raced only where the count is unsure)
            self._variants = (MIXED,) if self._accumulation[1].sure else (MIXED, *self._builds)
        self._fn = self._compiled[self._first]
        self.variant, self.note = None, ""

    @property
    def computes(self) -> Mode:
        return self._computes

    @property  # type: ignore[override]
    def variants(self) -> tuple[str, ...]:
        """The builds, then each in blocks where :meth:`_block_sizes` allows: read when first
        asked (a race, a remembered blocked build), since the block sizes need the default
        build's memory analysis, which costs milliseconds that a first call that races nothing
        would spend for nothing (measured: docs/thresholds.md)."""
        if self._variants is None:
            self._variants = self._builds + tuple(f"{b}/{rows}" for b in self._builds
                                                  for rows in self._block_sizes())
        return self._variants

    @variants.setter
    def variants(self, value: tuple[str, ...]) -> None:
        self._variants = tuple(value)

    def _hinted(self, build: str, blocked: bool) -> str:
        """The variant of a hint: ``build``, in blocks if this chunk has them and the hint
        was blocked."""
        if not blocked:
            return build
        return next((v for v in self.variants if v.startswith(build + "/")), build)

    def _compile_default(self, budget: CallBudget) -> None:
        """Trace and compile the default build of ``mode``. Where that fails (JAX has no
        reverse mode for ``lax.while_loop`` with traced bounds, no forward mode for
        ``custom_vjp``) and the other mode works, the kernel computes the other mode, with one
        warning, unless the call asked for the mode: that call gets a ModelError naming the
        other mode. Where both fail, the model's error for ``mode`` is raised."""
        bound = self._bound
        if budget.mode_asked and self.mode in bound.failed:  # a kernel of another size
            raise asked_mode_failed(self.mode, bound.failed[self.mode], _CAUSES[self.mode])
        failed: Exception | None = None
        for mode in (self.mode, other_mode(self.mode)):
            if mode in bound.failed:  # the other mode worked for a kernel of another size
                self.failure = bound.failed[mode]
                continue
            self._computes = mode
            self._lowered.clear()
            try:  # each build of one blocking compiles the same lowering
                recalled = self._load_recalled(budget)
                if recalled is not None:
                    self._first, compiled = recalled
                else:
                    compiled = self._first_mixed(budget)
                    if compiled is not None:
                        self._first = MIXED
                        self._compiled[MIXED] = compiled
                        return
                    lowered = self._lowering(self.chunk_size)
                    self._first = self._first_build(budget)
                    try:
                        compiled = self._load_or_compile(lowered, self._options[self._first])
                    except Exception:  # an XLA without that option: its defaults (a model's
                        if not self._options[self._first]:  # failure fails those too)
                            raise
                        self._first = "default"
                        compiled = self._load_or_compile(lowered, {})
                    # (after the quick build: compiling both at once slowed the first call)
                    self._tier_up(budget)
                self._compiled[self._first] = compiled
            except InputError:
                raise
            except Exception as e:
                if isinstance(e, Warning):  # warnings as errors: not the model's failure
                    raise
                error = e if isinstance(e, ModelError) else bound._explain(e)
                if error is not e:
                    error.__cause__ = e
                failed = failed or error
                continue
            if mode != self.mode:  # the failure is the mode's, not the model's
                if failed is not None:
                    self.failure = bound.failed[self.mode] = first_line(failed)
                if budget.mode_asked:
                    raise asked_mode_failed(self.mode, self.failure, _CAUSES[self.mode]) from failed
                self._warn_fallback(budget)
            return
        assert failed is not None
        raise failed

    def _load_recalled(self, budget: CallBudget) -> tuple[str, Any] | None:
        """The variant an earlier process's race chose (:attr:`~batchjac._backends._base.CallBudget.recalled`)
        and its executable, where that process left it on disk: loading it is cheaper than
        compiling even the quick build, and it is the faster build. A variant in blocks
        ("default/125") is traced in its blocks only, not first as a whole chunk too (a warm
        first call that traced both was slower than a cold one). None
        where no race is remembered, the caller fixed the build (a store), or the executable
        is not on disk (the first build is then chosen as usual)."""
        from ..._config import autotune_enabled
        from . import executables as jax_executables

        recalled = budget.recalled
        if recalled is None or budget.variant is not None or not autotune_enabled():
            return None
        build, blocked, rows = recalled.partition("/")
        if build not in self._options or build == "quick" or self._accumulation is not None:
            return None
        block = int(rows) if rows.isdigit() else 0
        if blocked and not 0 < block < self.chunk_size:
            return None  # (not a variant this chunk has)
        lowered = self._lowering(block if blocked else self.chunk_size)
        loaded = None
        # (XLA's defaults where the build's own options are not on disk: what an XLA that
        # refused them compiled instead, or an executable from before they were added)
        own, defaults = self._options[build], compat.BUILDS[build]
        for options in (own, defaults) if own != defaults else (own,):
            if loaded is None:
                loaded = jax_executables.load(lowered, options, starting=self._bound.compiling.set)
        return None if loaded is None else (recalled, loaded)

    def _first_build(self, budget: CallBudget) -> str:
        """The build compiled first, on the CPU with tuning on (``BATCHJAC_AUTOTUNE=off`` and
        other devices: "default"): "quick" where the call's elementwise work (the chunk's,
        times the chunks of the call's rows, :attr:`~batchjac._backends._base.CallBudget.rows`) is
        too small to repay XLA's full optimisation (:data:`QUICK_ELEMENTS`; it waits for the race that
        replaces it), "no-ynnpack" where its matrix products are wide
        (:data:`WIDE_PRODUCTS`), else "default"."""
        from ..._config import autotune_enabled
        from . import cost as jax_cost

        wanted = budget.variant
        if wanted == FIRST_VARIANT:
            return "default"  # (variants[0])
        if wanted is not None and wanted.split("/")[0] in self._options:
            return wanted.split("/")[0]  # the build the caller fixes (a store's): compiled once
        if jax.default_backend() != "cpu" or not autotune_enabled() or self._jaxpr is None:
            return "default"
        self.work = jax_cost.work(self._jaxpr)
        if self.work is None:  # a jaxpr the count cannot read: no estimate
            return "default"
        # the quick build's cost is per element of every chunk of the call (docs/thresholds.md,
        # QUICK_ELEMENTS); never in
        # a mode race, which times full builds (provisional): a quick one would be compiled
        # for nothing
        chunks = max(1, -(-budget.rows // self.chunk_size))
        steady = "no-ynnpack" if self.work.products >= self.WIDE_PRODUCTS else "default"
        if self.work.elements * chunks <= self.QUICK_ELEMENTS and not budget.plan_race:
            self._steady = steady
            return "quick"
        return steady

    def _tier_up(self, budget: CallBudget) -> None:
        """For a quick first build, with a core free: compile the steady build beside it."""
        steady = self._steady
        if self._first != "quick" or steady is None or budget.variant is not None or \
                not idle_core():
            self._steady = None
            return
        self._beside(steady)

    def _beside(self, variant: str) -> None:
        """Compile ``variant`` on the tier-up thread, unless it is compiled or compiling:
        :meth:`_compile` takes the result. Traced there too, where not yet and where that
        thread traces as this one would (:func:`.compat.trace_settings`); where it would not,
        the task leaves it (None) to :meth:`_compile`, in the calling thread."""
        if variant in self._compiled or variant in self._pending:
            return
        build, _, rows = variant.partition("/")
        size = int(rows) if rows else self.chunk_size
        settings = compat.trace_settings()

        def make() -> Any:
            lowered = self._lowered.get((size, False))
            if lowered is None:
                if settings is None or compat.trace_settings() != settings:
                    return None
                lowered = self._lowering(size)
            return self._load_or_compile(lowered, self._options[build], True)

        self._pending[variant] = BESIDE.submit(make)

    def _first_mixed(self, budget: CallBudget) -> Any:
        """The "mixed" build compiled, where it is the first build: offered for the model
        (:attr:`_accumulation`) and not replaced by a build the caller fixed (a new store
        takes it: the kernel's first); None where it
        is not, or where the model's equations cannot be evaluated piece by piece (a pure
        build then computes, and the mixed one is offered no more)."""
        wanted = budget.variant
        if self._accumulation is None or wanted not in (None, MIXED, FIRST_VARIANT):
            return None
        try:
            return self._load_or_compile(self._lowering(self.chunk_size, True), {})
        except Exception as e:
            if isinstance(e, (Warning, InputError)):
                raise
            self.mixed_failure = first_line(e)
            self._accumulation = None
            return None

    def _mixed_note(self) -> str:
        """The "mixed" build's note, the bracketing being the plan's (said there)."""
        assert self._accumulation is not None
        plan = self._accumulation[1]
        if plan.sure:
            return (f"{MIXED} (the model's chain as the plan says; counted {plan.gain:.1f}x ahead "
                    f"of the better pure mode, at least {SURE_GAIN:g}x: the pure builds are not "
                    f"raced)")
        return (f"{MIXED} (the model's chain as the plan says; counted {plan.gain:.1f}x ahead of "
                f"the better pure mode: the pure builds race it once the work repays it; "
                f"{untimed_note()})")

    #: why the "mixed" build could not be made for this model, where it could not
    mixed_failure = ""

    def _tiered(self) -> None:
        """At a call on the quick build: take the steady one, waiting for it where it is
        still compiling. The quick build answers the first call only: a call on it while the
        steady one compiles is slowed by it (the two share the cores) and is several times
        the steady one's, so such calls cost more than the wait they spare (measured:
        docs/thresholds.md, "JAX's tier-up")."""
        steady = self._steady
        future = self._pending.get(steady) if steady is not None else None
        if steady is None or future is None or self.variant != "quick":
            return
        with self.building:
            if self.variant != "quick":
                return
            try:
                self._compile(steady, strict=True)  # (the future's result)
            except Exception:  # an XLA that refuses its options: the quick build stays
                self._steady = None
                return
            self._select(steady, f"{steady} (compiled beside the quick first build, which it "
                                 f"replaces; not timed)")

    #: the chunk's estimated work, where counted
    work: Any = None

    @property
    def cheap_first(self) -> str | None:
        return "quick" if self._first == "quick" else None

    def _warn_fallback(self, budget: CallBudget) -> None:
        bound = self._bound
        kind: type[Warning] = ForwardModeFallbackWarning if self.mode == "forward" \
            else ReverseModeFallbackWarning
        if kind not in bound.warned and not budget.plan_race:
            bound.warned.add(kind)
            warnings.warn(fallback_message(self.mode, self.failure, _CAUSES[self.mode]), kind,
                          stacklevel=user_stacklevel())

    def _check_asked(self, budget: CallBudget) -> None:
        """A kernel that fell back, called by a call that asks for its mode: refuse."""
        if self._computes != self.mode and budget.mode_asked:
            raise asked_mode_failed(self.mode, self.failure, _CAUSES[self.mode])

    def _block_sizes(self) -> list[int]:
        """Rows a block for each of BLOCK_ROWS, evened over the chunk: for chunks at least
        twice as large, on the CPU, where a block's temporary arrays take at most
        BLOCK_MAX_BYTES (W1: 0.3 MB, W2: 2.8 MB; W4's convolutions: 29 MB, not tried)."""
        if jax.default_backend() != "cpu":
            return []
        # (the quick build's, before the default build exists)
        temp = compat.temp_bytes(self._compiled.get("default", self._compiled[self._first]))
        if temp is None:  # no memory analysis in this JAX: no blocks
            return []
        sizes = []
        for rows in self.BLOCK_ROWS:
            if self.chunk_size >= 2 * rows and temp / self.chunk_size * rows <= self.BLOCK_MAX_BYTES:
                sizes.append(-(-self.chunk_size // -(-self.chunk_size // rows)))
        return sizes

    def _mixed_body(self, args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
        """The Jacobians (and outputs) of the rows of ``u`` accumulated along the model's
        chain (:func:`batchjac._backends.jax.chain.instance_jacobian`), ``vmap``-ed."""
        from . import chain as jax_chain

        assert self._accumulation is not None
        read, plan = self._accumulation
        weights = jax.tree_util.tree_leaves(args)

        def row(u_i: Any, c_i: tuple[Any, ...]) -> tuple[Any, Any]:
            y, j = jax_chain.instance_jacobian(
                read, plan, [*weights, u_i, *jax.tree_util.tree_leaves(c_i)])
            return y, j.reshape((*y.shape, *u_i.shape))

        y, j = jax.vmap(row)(u, ctx)
        return (y, j) if self.with_outputs else j

    def _body(self, args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
        """The Jacobians (and outputs) of the rows of ``u``: ``vmap(jacfwd|jacrev)``."""
        one = self._bound._instance_fn(args)
        jac = jax.jacfwd if self._computes == "forward" else jax.jacrev
        if self.with_outputs:
            j, y = jax.vmap(jac(lambda u_i, c_i: (one(u_i, c_i),) * 2, has_aux=True))(u, ctx)
            return y, j
        return jax.vmap(jac(one))(u, ctx)

    def _lowering(self, rows: int, mixed: bool = False) -> Any:
        """The traced kernel computing the chunk ``rows`` rows at a time (the last block
        padded with copies of the chunk's last row, whose results are dropped); ``mixed``:
        in mixed mode (:meth:`_mixed_body`), the chunk at once."""
        if (rows, mixed) in self._lowered:
            return self._lowered[rows, mixed]
        bound, size = self._bound, self.chunk_size
        body = self._mixed_body if mixed else self._body

        def traced(args: Any, u: Any, ctx: tuple[Any, ...]) -> Any:
            bound.trace_count += 1
            if rows >= size:
                return body(args, u, ctx)
            return in_blocks(lambda b_u, b_c: body(args, b_u, b_c), rows, u, ctx)

        u_spec, ctx_spec = bound._specs(size)
        jaxpr, self._lowered[rows, mixed] = compat.stage(traced, bound.args, u_spec, ctx_spec)
        if rows >= size and not mixed:
            self._jaxpr = jaxpr
        return self._lowered[rows, mixed]

    def _compile(self, variant: str, *, strict: bool = False) -> Any:
        """The executable of ``variant``. Where XLA refuses its build's options (a release
        that renamed one, :mod:`.compat`), XLA's defaults: a fixed or remembered variant
        then runs as "default" does, unless ``strict`` (the race: it leaves the build out)."""
        if variant not in self._compiled:
            build, _, rows = variant.partition("/")
            if build == MIXED:  # (compiled first, where offered: only the store's fixed one)
                self._compiled[variant] = self._load_or_compile(
                    self._lowering(self.chunk_size, True), {})
                return self._compiled[variant]
            size = int(rows) if rows else self.chunk_size
            pending = self._pending.pop(variant, None)  # compiling on the tier-up thread
            try:
                compiled = pending.result() if pending is not None else None
                if compiled is None:  # (none there, or not traced there: _beside)
                    compiled = self._load_or_compile(self._lowering(size), self._options[build])
            except Exception:
                if strict or not self._options[build]:  # (the defaults: the model's failure)
                    raise
                compiled = self._load_or_compile(self._lowering(size), {})
            self._compiled[variant] = compiled
        return self._compiled[variant]

    def _load_or_compile(self, lowered: Any, options: Options, beside: bool = False) -> Any:
        """XLA's compilation, or the executable an earlier process compiled for the same
        lowered module (:mod:`batchjac._backends.jax.executables`); ``beside``: on the
        tier-up thread."""
        from . import executables as jax_executables

        # the probes beside this first kernel may trace once XLA holds the CPU, not Python
        compiled, loaded = jax_executables.compile(lowered, options,
                                                   starting=self._bound.compiling.set,
                                                   beside=beside)
        self._bound.compile_count += not loaded
        return compiled

    def _select(self, variant: str, note: str) -> None:
        self._fn = self._compile(variant)
        if variant == MIXED and self._accumulation is not None and not note:  # (its only build)
            note = self._mixed_note()
        if self._computes != self.mode:
            note = f"{note}; computed in {self._computes} mode ({self.failure})"
        self.variant, self.note = variant, note

    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
             ) -> tuple[np.ndarray | None, np.ndarray]:
        return self.launch(u, ctx, budget)()

    @property
    def provisional_builds(self) -> int:
        """A quick first build that :meth:`provisional` replaces by a full one: 1."""
        return int(set(self._compiled) == {"quick"})

    def provisional(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
                    ) -> tuple[np.ndarray | None, np.ndarray]:
        """Before the first call has chosen: what the last kernel of this model chose (its
        build, in blocks if this chunk has them), else the default; nothing is timed. Never
        the quick build: the races that call this (the modes, the chunk sizes) compare full
        builds, since the quick one's slow loops favour whichever mode has fewer of them
        (docs/thresholds.md, "JAX's builds")."""
        self._check_asked(budget)
        fn = self._fn
        if self._first == MIXED:  # (a ladder of chunk sizes compares them in it)
            fn = self._compile(MIXED)
        elif self.variant is None or self.variant == "quick":
            first = "default" if self._first == "quick" else self._first
            fn = self._compile(self._hinted(*(self._bound.hint or (first, False))))
        return self._result(fn(self._bound.args, u, tuple(ctx)), isinstance(u, jax.Array))()

    def launch(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
               ) -> Callable[[], tuple[np.ndarray | None, np.ndarray]]:
        from .executables import used

        self._check_asked(budget)
        if self.variant is None:
            with self.building:  # (threads sharing the kernel: one chooses its build)
                if self.variant is None:
                    self.choose(u, ctx, budget)
        elif self._pending:
            self._tiered()
        used()
        return self._result(self._fn(self._bound.args, u, tuple(ctx)),  # runs in the background
                            isinstance(u, jax.Array))

    def _result(self, out: Any, native: bool = False
                ) -> Callable[[], tuple[np.ndarray | None, np.ndarray]]:
        """The wait for ``out``: numpy views of its buffers, or (``native``: JAX arrays in)
        the JAX arrays themselves, left on their device."""
        from .executables import release

        def wait() -> tuple[Any, Any]:
            if native:  # (waited for as numpy results are: the tuning times these calls)
                res = (tuple(jax.block_until_ready(out)) if self.with_outputs
                       else (None, jax.block_until_ready(out)))
            elif self.with_outputs:
                res = (np.asarray(out[0]), np.asarray(out[1]))
            else:
                res = (None, np.asarray(out))
            release()  # the executables this call compiled are written now, after its result
            return res
        return wait

    # -- the builds as the chooser (:mod:`batchjac._tune.chooser`) sees them: "default" runs
    # without a race, "no-ynnpack" challenges it, then each build in blocks the one kept

    def build(self, name: str) -> Build:
        if self._first == MIXED:  # the pure builds challenge the mixed one alike
            return Build(name, int(name != MIXED))
        return Build(name, 2 if "/" in name else int(name != "default"))

    race_options = {"prune": PRUNE}  # noqa: RUF012 - read only
    races_on_calls = True

    def untimed_first(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget
                      ) -> tuple[str, str, bool]:
        from ..._config import autotune_enabled

        if self._first == MIXED:
            return MIXED, self._mixed_note(), True
        if self._first == "quick":
            return "quick", (f"quick (XLA at optimization level 0, no fusion emitters: "
                             f"{self.work.elements:.2g} elements of elementwise work a chunk, "
                             f"too few to repay a full build; {untimed_note()})"), True
        # what an earlier kernel of this model chose by timing (none with autotune off)
        hint = self._hinted(*(self._bound.hint or (self._first, False)) if autotune_enabled()
                            else ("default", False))
        return hint, f"{hint} ({untimed_note()})", True

    def contenders_beside(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]
                          ) -> tuple[str, ...] | None:
        """With a core free: the builds traced here and compiled on the tier-up thread while
        the calls go on; the race on the calls starts once all are ready. (XLA is asked
        first whether it knows the options: a refusal found beside the calls would leave a
        copy of the default build in the race.)"""
        if not idle_core() or not compat.xla_accepts(self._options["no-ynnpack"]):
            return None
        for v in self.variants:
            self._beside(v)
        return self.variants

    def contenders(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[str, ...]:
        try:
            self._compile("no-ynnpack", strict=True)
        except Exception:  # e.g. a JAX whose XLA has no such option: one build only
            self.variants = tuple(v for v in self.variants if v.split("/")[0] == "default")
        for v in self.variants:
            self._compile(v)
        # one race of all: a second race, minutes later on a shared machine, compared the
        # winner of the first with itself at another load and once took blocks for it
        return self.variants

    def ready(self, name: str) -> bool:
        pending = self._pending.get(name)
        return name in self._compiled or (pending is not None and pending.done())

    def run_build(self, name: str, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> None:
        jax.block_until_ready(self._compiled[name](self._bound.args, u, tuple(ctx)))

    def raced_to(self, best: str, times: dict[str, float], u: Any) -> None:
        from .executables import release

        if best != MIXED:  # (a build of the model's chain is no hint for a pure kernel)
            self._bound.hint = (best.split("/")[0], "/" in best)
        self._select(best, f"{best} (timed one chunk: {timings(times)})")
        # the race's executables are written now: a process that stops calling after its
        # race (the bench's settle loop) left them unwritten, and the warm process compiled
        release()


def in_blocks(body: Callable[[Any, tuple[Any, ...]], Any], rows: int, u: Any,
              ctx: tuple[Any, ...]) -> Any:
    """``body(u, ctx)`` (traced) computed ``rows`` rows at a time in a ``lax.map`` inside the
    one compiled call, the last block padded with copies of the chunk's last row, whose
    results are dropped."""
    size = int(u.shape[0])
    blocks = -(-size // rows)
    padded = blocks * rows

    def split(a: Any) -> Any:
        if padded > size:
            a = jnp.concatenate([a, jnp.broadcast_to(a[-1:], (padded - size, *a.shape[1:]))])
        return a.reshape((blocks, rows, *a.shape[1:]))

    out = jax.lax.map(lambda b: body(b[0], b[1]), (split(u), tuple(split(c) for c in ctx)))
    return jax.tree_util.tree_map(lambda o: o.reshape((padded, *o.shape[2:]))[:size], out)
