"""The small interface every framework backend implements.

A backend *binds* a model to a batch signature (layout, compute dtype, per-row shapes of the
unknowns and of the other inputs) and returns a :class:`BoundModel`. A bound model offers
numpy-in/numpy-out primitives: ``forward`` and ``connected`` for the one-off probes, and
compiled :class:`Kernel` objects that map one fixed-size chunk to ``(y, J)``.
Nothing outside ``batchjac._backends`` imports a framework.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import sys
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import numpy as np

from .._config import autotune_enabled
from .._spec import Layout
from .._tune import chooser
from .._tune.chooser import Build, timings
from .._tune.state import TuningState

if TYPE_CHECKING:
    from .._chain import Accumulation

#: the thread that makes builds beside the calls (JAX: a kernel's steady build beside its quick
#: first one; a race's contenders, where a core is free), one at a time: the other cores run the
#: user's calls. Its work is joined at exit, as the native code's compilation would have been
#: waited for
BESIDE = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchjac-tier-up")


def idle_core() -> bool:
    """Whether this process may use more than one core (a second one makes builds beside)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except AttributeError:  # (not on Linux)
        return (os.cpu_count() or 1) > 1


def made_beside(timeout: float | None = None) -> None:
    """Wait until the builds queued on :data:`BESIDE` so far are made (tests, exits)."""
    BESIDE.submit(lambda: None).result(timeout)


Mode = Literal["forward", "reverse"]
#: what a second-order kernel computes per instance (see :meth:`BoundModel.second_kernel`)
SecondKind = Literal["hessian", "diagonal", "laplacian", "hvp"]
#: the order of the two differentiations: the outer one first (forward over reverse mode is
#: ``jacfwd(jacrev(f))``, forward over forward ``jacfwd(jacfwd(f))``)
Order = Literal["forward-over-reverse", "forward-over-forward"]
#: the name of each kind's per-instance result in a kernel's mapping of named arrays
SECOND_RESULT: dict[str, str] = {"hessian": "hessians", "diagonal": "diagonals",
                                 "laplacian": "laplacians", "hvp": "hvps"}


@dataclass(frozen=True)
class CallBudget:
    """What the call at hand lets a kernel spend on choosing its build, and what it knows:
    passed to a kernel's construction (:meth:`BoundModel.kernel`) and to its calls
    (:meth:`Kernel.call`, or :meth:`Kernel.under` for the runner), never set around them.
    The tuning policy (:mod:`batchjac._tune.policy`) makes it; kernels read it."""

    #: the rows of the call at hand (0: not known): a kernel's first build weighs what its
    #: compilation saves against the work of these rows, all its chunks
    rows: int = 0
    #: whether a kernel meeting its first call may race its builds now
    race: bool = False
    #: whether the call runs a contender of a race between plans (the modes timed against each
    #: other, :func:`batchjac._tune.races.time_modes`; the chunk sizes of the ladder racing on
    #: the calls, :class:`batchjac._tune.races.RowsRace`): a kernel builds what such a race
    #: compares (no quick build), and a mode that fails there falls back or loses the race
    #: without a warning, which is for the plans the calls settle on
    plan_race: bool = False
    #: the variant the kernel being built is fixed to (a store's recorded build, or
    #: :data:`FIRST_VARIANT`, a new store's): a kernel that compiles in its constructor
    #: compiles that build first, not the one it would choose for a first call and then
    #: replace (JAX's quick build, then a store's default: two)
    variant: str | None = None
    #: the variant an earlier process's race chose (read from the tuning cache): a hint, not
    #: a constraint. A kernel that keeps its builds on disk (JAX's executables) loads that
    #: build first where it finds it there, instead of compiling its cheap first build
    recalled: str | None = None
    #: whether the call asked for the kernel's mode (``mode="forward"`` or ``"reverse"``): a
    #: kernel whose mode fails for the model then says so (a ModelError naming the other
    #: mode), instead of computing the other mode with a warning as it does for
    #: ``mode="auto"`` (and for callers that do not say: stores' recorded plans, probes)
    mode_asked: bool = False

    @property
    def may_race(self) -> bool:
        """Asked by a kernel on its first call: may it time its builds now?"""
        return self.race and autotune_enabled()


#: a call that says nothing: no rows known, no race (stores, repeated calls, direct calls)
UNTUNED = CallBudget()


def asking(mode: str) -> CallBudget:
    """The budget of a call that says nothing of tuning, with ``mode`` as the user gave it:
    :attr:`CallBudget.mode_asked` unless it is "auto"."""
    return UNTUNED if mode == "auto" else CallBudget(mode_asked=True)


def untimed_note() -> str:
    """Why a kernel's build was not timed, for ``explain=True``."""
    if not autotune_enabled():
        return "BATCHJAC_AUTOTUNE=off: not timed"
    return "not timed: the work seen so far does not repay a race"


#: ``BoundModel.kernel(..., variant=FIRST_VARIANT)``: fixed to the kernel's first variant
#: (``variants[0]``), the one a new store records, never a timed choice
FIRST_VARIANT = "(first)"


def other_mode(mode: Mode) -> Mode:
    return "reverse" if mode == "forward" else "forward"


_PASSES = {"forward": "one pass per unknown", "reverse": "one backward pass per output"}


def fallback_message(failed: Mode, why: str, cause: str) -> str:
    """The warning of a kernel whose mode failed and which computes the other mode instead;
    ``cause`` names the framework's usual cause."""
    used = other_mode(failed)
    return (f"{failed.capitalize()} mode failed for this model ({why}); batchjac computes the "
            f"Jacobians in {used} mode instead, which gives the same values but takes "
            f"{_PASSES[used]} rather than {_PASSES[failed]}. {cause} Pass mode='{used}' to skip "
            f"the attempt.")


def asked_mode_failed(failed: Mode, why: str, cause: str) -> Exception:
    """The error of a call that asked for a mode which fails for this model."""
    from .._errors import ModelError

    used = other_mode(failed)
    return ModelError(f"{failed.capitalize()} mode failed for this model ({why}). {cause} Pass "
                      f"mode='{used}' (or mode='auto', which falls back to {used} mode by "
                      f"itself).")


_BOILERPLATE = re.compile(r"^(in user code:|File \"|Exception encountered when calling|Arguments "
                         r"received by|Calling the model failed: \w+: Exception encountered)")


def first_line(e: BaseException, limit: int = 300) -> str:
    """``Type: the line that says what failed``, for warnings and errors that name a
    framework's error: the innermost cause (what batchjac wrapped), the last ``...Error: ...``
    line of a traceback TensorFlow quotes ("in user code: ... ValueError: ..."), else the first
    line that is not a frame of one or a Keras preamble; terminal colour codes removed."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    quoted = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)]
    line = quoted[-1] if quoted else next(
        (line for line in lines if not _BOILERPLATE.match(line)), "")
    if quoted:
        return line[:limit]
    return f"{type(e).__name__}: {line}"[:limit] if line else type(e).__name__


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside batchjac (and
    contextlib), i.e. at the user's call, from the function that calls ``warnings.warn``."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                                        or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
        level += 1
    return level


@dataclass(frozen=True)
class Signature:
    """What a compiled function depends on, besides the chunk size and the mode."""

    layout: Layout
    dtype: np.dtype
    unknown_shape: tuple[int, ...]
    ctx: tuple[tuple[tuple[int, ...], np.dtype], ...]  # per-row shape and dtype of ctx arrays


class Kernel(ABC):
    """One compiled, pure function over chunks of exactly ``chunk_size`` rows.

    A backend may compile a kernel in more than one way (``variants``, e.g. TensorFlow with
    and without XLA). Such a kernel declares its builds (:meth:`build`: a
    :class:`~batchjac._tune.chooser.Build` record each) and how to make, run and select one
    (the hooks below :meth:`retune`); the chooser (:mod:`batchjac._tune.chooser`) runs the
    first call's choice (:meth:`choose`) and the later race (:meth:`retune`), the same for
    every kernel, unless a variant was set with :meth:`use` (resumable stores record the
    variant, so that a resumed run computes the same bits); ``variant`` and ``note`` then say
    which and why.
    """

    mode: Mode
    chunk_size: int
    with_outputs: bool
    variants: tuple[str, ...] = ("default",)
    #: the implementation in use; None until the first call has chosen one
    variant: str | None = "default"
    #: why that variant (for explain=True), empty when there was no choice
    note: str = ""

    #: whether :meth:`launch` returns before the computation ends (JAX dispatches
    #: asynchronously): the caller's checks can then run while it computes
    asynchronous: bool = False

    @property
    def tune_name(self) -> str:
        """The name its decisions are kept under (the tuning tables, the disk cache): a
        Jacobian kernel's mode; a second-order kernel's kind, order and whether it carries the
        Jacobians (see ``batchjac._compute.Derivative.name``)."""
        kind = getattr(self, "kind", None)
        if kind is None:
            return self.mode
        return f"{kind}:{getattr(self, 'order', '')}:{int(getattr(self, 'with_jacobian', False))}"

    @property
    def computes(self) -> Mode:
        """The mode the kernel computes: its own, or the other one where its own fails for the
        model and the call let it fall back (known once built, or after its first call)."""
        return self.mode

    def launch(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
               ) -> Callable[[], tuple[np.ndarray | None, np.ndarray]]:
        """Start the computation; the returned function waits for it and gives ``(y, J)``."""
        result = self.call(u, ctx, budget)
        return lambda: result

    def under(self, budget: CallBudget) -> Budgeted:
        """This kernel as the call with ``budget`` sees it: its calls carry the budget (the
        runner calls ``kernel(u, ctx)`` and knows nothing of tuning)."""
        return Budgeted(self, budget)

    #: the variant fixed with :meth:`use`, which the first call then takes without timing
    _forced: str | None = None

    @property
    def fixed(self) -> str | None:
        """The variant fixed with :meth:`use` (a store's record, a remembered decision), if any."""
        return self._forced

    @property
    def provisional_builds(self) -> int:
        """Builds :meth:`provisional` would compile before it runs (JAX: the full build beside
        a quick first one), which a mode race on this kernel costs on top of the other mode's."""
        return 0

    def provisional(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED
                    ) -> tuple[np.ndarray | None, np.ndarray]:
        """Like a call, for timing the kernel against other modes and chunk sizes: a kernel
        that has not chosen its variant yet may run a default one without choosing (JAX:
        choosing compiles and times several builds, worth it only for the size kept)."""
        return self.call(u, ctx, budget)

    @property
    def building(self) -> threading.RLock:
        """Held while the kernel chooses or changes its build (its first call, :meth:`use`,
        :meth:`retune`): threads sharing a kernel establish it once, and the others wait, then
        run its choice. Without it, TensorFlow's first call in one thread reset the paths
        another thread was building on the same kernel, which then fell back to a slower path
        as if the model could not be vectorised. Calls of the chosen build take no lock."""
        return self.__dict__.setdefault("_building", threading.RLock())  # (atomic: one lock)

    def use(self, variant: str, why: str = "fixed") -> None:
        """Run as ``variant`` from now on (one of ``variants``); ``why`` goes into the note."""
        if variant not in self.variants:
            from .._errors import InputError

            raise InputError(f"This kernel has no variant {variant!r}; it has {self.variants}.")
        with self.building:
            self._forced = variant
            self._forced_why = why
            if self.variant is not None:  # already running: switch now
                self._select(variant, f"{variant} ({why})")

    #: why the variant was fixed (a store's record, a decision remembered on disk)
    _forced_why: str = "fixed"

    def _select(self, variant: str, note: str) -> None:
        """Make ``variant`` the implementation in use (backends with variants extend this)."""
        self.variant, self.note = variant, note

    #: whether the implementation in use was chosen without timing the others (the call that
    #: met the kernel first was too small to repay a race); :meth:`retune` may time them later
    untimed: bool = False
    #: whether the implementation in use was chosen by a race here (the decision to remember)
    raced: bool = False
    #: whether the later race rides on the user's calls (:class:`batchjac._tune.chooser.CallRace`)
    #: rather than timing rows whose results are thrown away
    races_on_calls: bool = False
    #: that race, while it runs
    call_race: chooser.CallRace | None = None
    @property
    def cheap_first(self) -> str | None:
        """The build a first call takes untimed because it is the cheapest to make, if there
        is one (TensorFlow: the plain graph; PyTorch: plain autograd before torch._dynamo is
        loaded); a remembered build other than it waits for the work to repay its making
        (see ``batchjac._tune.policy.recall_variant``)."""
        return None

    #: that remembered build and why, until it is taken
    remembered: tuple[str, str] | None = None

    def choose(self, u: Any, ctx: tuple[Any, ...], budget: CallBudget) -> None:
        """The first call's choice of build, on its rows: :func:`batchjac._tune.chooser.first_call`."""
        chooser.first_call(self, u, ctx, budget)

    def retune(self, u: Any, ctx: tuple[Any, ...]) -> None:
        """The race the first call skipped, on ``(u, ctx)``, once the work seen repays it (see
        :mod:`batchjac._tune.policy`): :func:`batchjac._tune.chooser.retune`."""
        chooser.retune(self, u, ctx)

    # -- what the chooser (:mod:`batchjac._tune.chooser`) asks of a kernel with several builds:
    # it runs the state machine of the first call and of the later race; a kernel only
    # declares its builds and makes, runs and selects one

    #: extra arguments of the race (:func:`batchjac._tune.chooser.race`) for this kernel's builds
    race_options: dict[str, Any] = {}  # noqa: RUF012 - read only

    def build(self, name: str) -> Build:
        """The record of build ``name``: its stage in a race (default: all challenge alike)."""
        return Build(name)

    @property
    def known(self) -> str | None:
        """The build a race chose for another chunk size of this model, taken untimed."""
        return None

    def take(self, name: str, why: str, u: Any, ctx: tuple[Any, ...]) -> None:
        """Select build ``name``, fixed or known, untimed (``why``: for the note), for the
        first call on ``(u, ctx)``."""
        self._select(name, f"{name} ({why})")

    def untimed_first(self, u: Any, ctx: tuple[Any, ...], budget: CallBudget
                      ) -> tuple[str, str, bool] | None:
        """The build a first call takes where no race is repaid: ``(name, note, later)``,
        ``later`` whether a race should replace it once the work repays one; None where the
        kernel selected one itself."""
        return self.variants[0], untimed_note(), True

    @property
    def retunable(self) -> bool:
        """Whether a race can still change the untimed build in use."""
        return len(self.variants) > 1

    @property
    def race_compilations(self) -> int:
        """The builds the later race makes while the calls wait (its cost, with its timed
        runs: :func:`batchjac._tune.policy.settle`): each but the one in use."""
        return max(1, len(self.variants) - 1)

    @property
    def race_setup_seconds(self) -> float:
        """Seconds the later race's contenders spend once, beyond their compilations, before
        they can run (an import a build needs that the process has not made), for its price."""
        return 0.0

    @contextlib.contextmanager
    def timing(self, u: Any, ctx: tuple[Any, ...]) -> Iterator[tuple[Any, tuple[Any, ...]]]:
        """The rows of a later race as the builds take them (PyTorch: tensors, in its mode)."""
        yield u, ctx

    def race_inputs(self, u: Any, ctx: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        """The rows a race times the builds on (default: the chunk's)."""
        return u, ctx

    @property
    def race_rows(self) -> int | None:
        """The most rows :meth:`race_inputs` keeps (None: the chunk's), for the race's price."""
        return None

    def contenders(self, u: Any, ctx: tuple[Any, ...]) -> tuple[str, ...]:
        """The builds to race, made and warmed up on ``(u, ctx)``, those that fail for the
        model left out; with fewer than two, the kernel selects the one left (or its only
        working build) and says why."""
        return self.variants

    def contenders_beside(self, u: Any, ctx: tuple[Any, ...]) -> tuple[str, ...] | None:
        """For a race on the calls: the builds to race, made beside the calls (the race
        starts once each is :meth:`ready`); None where the kernel makes them now
        (:meth:`contenders`)."""
        return None

    def make(self, name: str, rows: Callable[[], tuple[Any, tuple[Any, ...]]]) -> bool:
        """Make build ``name`` ahead of its use, on a chunk ``rows()``: beside the calls where
        the kernel can (False until it is made), else when it is selected (True)."""
        return True

    def ready(self, name: str) -> bool:
        """Whether build ``name`` is made (a kernel that makes its contenders beside the calls
        starts their race once all are)."""
        return True

    def left_race(self, name: str, error: BaseException) -> None:
        """Build ``name`` failed with ``error`` on a user's call of a race on the calls and
        left the race (the build in use before answers the call): nothing to do, or what the
        kernel says of such a failure (TensorFlow: XLA cannot compile the model)."""
        return

    def run_build(self, name: str, u: Any, ctx: tuple[Any, ...]) -> None:
        """Run build ``name`` on ``(u, ctx)`` once, for the race: returns when it is done."""
        raise NotImplementedError(f"{type(self).__name__} has no builds to race")

    def incumbent(self, names: tuple[str, ...]) -> str:
        """The build a race's challengers must beat: the stage-0 build, else the untimed one in
        use, else the cheap first one, else the first."""
        zero = [n for n in names if self.build(n).stage == 0]
        if zero:
            return zero[0]
        if self.variant in names:
            return self.variant  # type: ignore[return-value]
        cheap = self.cheap_first
        return cheap if cheap in names else names[0]  # type: ignore[return-value]

    def raced_to(self, best: str, times: dict[str, float], u: Any) -> None:
        """Select ``best``, the race's choice on the rows ``u``, with its timings in the note."""
        self._select(best, f"{best} (timed one chunk: {timings(times)})")

    def __call__(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> Any:
        """A call that says nothing of tuning (:data:`UNTUNED`): see :meth:`call`."""
        return self.call(u, ctx, UNTUNED)

    @abstractmethod
    def call(self, u: np.ndarray, ctx: tuple[np.ndarray, ...], budget: CallBudget = UNTUNED) -> Any:
        """One chunk; ``budget`` is what the call at hand lets a first call spend on
        choosing the build. ``u`` is ``(chunk_size, *unknown_shape)``; returns ``(y or None,
        J)`` with ``J`` of shape ``(chunk_size, *output_shape, *unknown_shape)``, as numpy
        arrays; or, when ``u`` and ``ctx`` are the framework's own arrays (``jacobian`` with tensors in and
        out, see :mod:`batchjac._arrays`), as the framework's arrays, on the device, with no
        copy to the host."""


class Budgeted:
    """A kernel seen by one call (:meth:`Kernel.under`): its calls carry that call's budget;
    everything else is the kernel's."""

    __slots__ = ("budget", "kernel")

    def __init__(self, kernel: Kernel, budget: CallBudget) -> None:
        self.kernel, self.budget = kernel, budget

    def __call__(self, u: Any, ctx: tuple[Any, ...]) -> Any:
        return self.kernel.call(u, ctx, self.budget)

    def launch(self, u: Any, ctx: tuple[Any, ...]) -> Callable[[], Any]:
        return self.kernel.launch(u, ctx, self.budget)

    def provisional(self, u: Any, ctx: tuple[Any, ...]) -> Any:
        return self.kernel.provisional(u, ctx, self.budget)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def under(kernel: Any, budget: CallBudget) -> Any:
    """``kernel.under(budget)``; the kernel as it is for :data:`UNTUNED` (what its calls carry
    anyway) and for a duck-typed kernel (a test's)."""
    return kernel.under(budget) if isinstance(kernel, Kernel) and budget != UNTUNED else kernel


class LinearHead(Protocol):
    """A model's linear head (:meth:`BoundModel.linear_head`): ``width`` the size ``w`` of its
    result ``z``; numpy in and out."""

    width: int

    def matrix(self, u: Any, ctx: tuple[Any, ...]) -> np.ndarray:
        """``A = dz/dx``, ``(w, k)`` in float64, from rows of the batch (``A`` is the same for
        every row)."""

    def jacobians(self, u: Any, ctx: tuple[Any, ...]) -> tuple[Any, np.ndarray]:
        """``(y, J_z)`` of a block of rows, ``J_z = dy/dz`` as ``(rows, m, w)``."""


class BoundModel(ABC):
    """A model tied to one :class:`Signature`; caches its kernels and probe results."""

    #: how many times a function was traced/compiled (tests count this)
    trace_count: int = 0
    #: whether a kernel for a new chunk size costs a compilation (XLA, a traced graph); an
    #: eager framework's kernels are free to make, so callers may use any size they like
    compiles_kernels: bool = True
    #: what making a kernel in forward mode costs against one in reverse mode (tracing and
    #: compiling it, and its first run), for the price of a race of the modes; 1 unless
    #: measured otherwise
    forward_build_cost: float = 1.0
    #: whether a kernel a race needs is made beside the calls where a core is free
    #: (:meth:`make_beside`): where the calls go on meanwhile (XLA's compilation releases
    #: Python's lock; TensorFlow's graphs run outside it while the making traces); PyTorch's
    #: kernels cost nothing to make
    builds_beside: bool = False
    #: what computes in place of the model as given, for ``explain=True`` (the original of a
    #: ``torch.compile``d module, a float32 clone of a half-precision Keras model); "" where
    #: it is the model itself
    model_note: str = ""

    #: kernels kept per bound model, the least recently used dropped first: each compiled
    #: one holds its executable (measured, 1.7 MB for a small JAX MLP, 2.6 MB for Keras), and
    #: calls with ever new chunk sizes (``chunk_size=n``, ``out=`` arrays of each N, repeated
    #: N that earn their own kernel, see ``_tuning.reuse``) would otherwise grow without bound
    MAX_KERNELS: ClassVar[int] = 16
    #: whether the diagonal and the Laplacian are cheaper forward over forward (``k``
    #: second-order tangents) than forward over reverse for few outputs: measured per backend
    #: (docs/thresholds.md)
    reductions_over_forward: ClassVar[bool] = True
    #: whether forward over forward computes a full Hessian in one pass of second-order
    #: Taylor terms (``1 + k + k(k+1)/2`` a value, :mod:`batchjac._backends.jax.laplacian`),
    #: which the order choice then weighs against forward over reverse (``_plan.choose_order``)
    forward_hessian: ClassVar[bool] = False
    #: whether a Hessian's kernel forward over reverse holds every output's passes at once
    #: (``vmap``-ed, as JAX's and TensorFlow's are), for the chunks cut to the cache
    #: (``_plan.hessian_passes``); PyTorch's first build, plain autograd, differentiates one
    #: output after another, and runs faster in chunks cut for one (docs/thresholds.md)
    hessian_outputs_at_once: ClassVar[bool] = True
    #: how many tangent passes one backward pass weighs, in the mode choice the shapes leave
    #: open (``_plan.choose_mode``: forward while ``k < forward_bias * m``); 1 unless measured
    forward_bias: ClassVar[float] = 1.0

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        #: the compiled functions of :meth:`product`, by kind (a backend's ``products``
        #: module fills it; cleared where the model's traces went stale)
        self.products: dict[str, Any] = {}
        self.probed: bool = False
        self.output_shape: tuple[int, ...] | None = None
        #: :meth:`row_working_set` of the probes' rows (None: no estimate)
        self.row_bytes: float | None = None
        self._kernels: OrderedDict[tuple[str, int, bool], Kernel] = OrderedDict()
        self._kernels_lock = threading.Lock()  # threads sharing a model share its kernels
        #: set once the caller's thread has left Python for a while (JAX: XLA compiles its first
        #: kernel outside Python's lock), or has stopped waiting for the probes: probes run
        #: beside the first kernel wait for it, since their tracing would take that lock from
        #: the caller's own tracing (measured: docs/thresholds.md, "Probes beside the first kernel")
        self.compiling = threading.Event()
        #: (chunk size, with outputs) -> (mode, measured timings), from _autotune
        self.tuned: dict[tuple[int, bool], tuple[str, str]] = {}
        #: ("rows", mode, planned chunk size, with outputs) -> (fastest rows, timings)
        self.tuned_rows: dict[tuple[str, str, int, bool], tuple[int, str]] = {}
        #: what this bound model's calls have measured and decided (:mod:`batchjac._tune`)
        self.tuning = TuningState()
        #: the probes running beside the first kernel's compilation (:mod:`batchjac._bind`)
        self.probing: Any = None
        #: held while the model is probed: threads sharing it probe it once
        self.prepare_lock = threading.RLock()

    @abstractmethod
    def forward(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> np.ndarray:
        """The model's output for a small batch, as numpy (inference mode)."""

    @abstractmethod
    def connected(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """False when the framework's autodiff finds no path from ``u`` to the output."""

    @abstractmethod
    def build_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool,
                     budget: CallBudget = UNTUNED) -> Kernel:
        """Compile the chunk kernel (called once per mode, chunk size and outputs flag), for
        the call with ``budget`` (its rows, a fixed or remembered build)."""

    def kernel(self, mode: Mode, chunk_size: int, with_outputs: bool,
               variant: str | None = None, recalled: str | None = None,
               budget: CallBudget = UNTUNED) -> Kernel:
        """The cached kernel; ``variant`` fixes its implementation (see :class:`Kernel`);
        ``recalled`` is the variant an earlier process chose, a hint to a new kernel's first
        build (:attr:`CallBudget.recalled`); ``budget`` the call's, for a new kernel."""
        key = (mode, chunk_size, with_outputs)
        with self._kernels_lock:
            kernel = self._kernels.get(key)
            if kernel is not None:
                self._kernels.move_to_end(key)
        if kernel is None:
            built = dataclasses.replace(budget, variant=variant, recalled=recalled)
            kernel = self.build_kernel(mode, chunk_size, with_outputs, built)  # (outside the lock)
            with self._kernels_lock:
                kernel = self._kernels.setdefault(key, kernel)  # another thread's, if first
                self._kernels.move_to_end(key)
                while len(self._kernels) > self.MAX_KERNELS:  # never this one: the newest
                    self._kernels.popitem(last=False)
        # a variant the kernel no longer offers (XLA failed to compile this model, here and in
        # the run that recorded "xla") is left as it is: the fallback is the same every time
        if variant == FIRST_VARIANT:
            variant = kernel.variants[0]
        if variant is not None and kernel.variant != variant and variant in kernel.variants:
            kernel.use(variant)
        return kernel

    def build_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                            with_outputs: bool, with_jacobian: bool) -> Kernel:
        """Compile a second-order kernel: ``(u, ctx) -> {name: array}`` with the kind's result
        (:data:`SECOND_RESULT`), and ``"outputs"``/``"jacobians"`` when asked. ``hvp`` kernels
        take the tangents ``v`` (rows, *unknown_shape) as the last element of ``ctx``.
        Backends that compute second derivatives override this."""
        from .._errors import InputError

        raise InputError(
            f"The {type(self).__name__} backend does not compute second derivatives; "
            f"batchjac.hessian, hvp and laplacian need a TensorFlow, PyTorch or JAX model "
            f"(a batchjac.ClosedForm model carries its Jacobian only).")

    def accumulation(self) -> tuple[Any, Accumulation] | None:
        """Where the model's Jacobian is offered in mixed mode (:mod:`batchjac._chain`): the
        backend's reading of its chain and the bracketing chosen; None (the default) where the
        backend reads no chain or no bracketing beats the pure modes."""
        return None

    def linear_head(self) -> LinearHead | None:
        """The model's first operation on the unknowns where it is a linear map the same for
        every instance, ``z = A x`` (a dense layer's product), narrower than the unknowns: an
        analysis of ``J Sigma J^T`` then works with ``J_z`` (``m x w``) and ``A Sigma A^T``
        instead of ``J`` (``m x k``) and ``Sigma``. None (the default) where the backend reads
        no head or the model has none."""
        return None

    def product(self, kind: str, u: Any, ctx: tuple[Any, ...], t: Any) -> tuple[Any, Any]:
        """``(y, p)`` of a block of rows: the outputs and, for the ``d`` directions of ``t``
        ``(rows, d, ...)``, ``J v`` (``kind="jvp"``) or ``c^T J`` (``"vjp"``), without forming
        ``J`` (:mod:`batchjac._products`); numpy in and out."""
        from .._errors import InputError

        raise InputError(
            f"batchjac.jvp, vjp and divergence need a TensorFlow, PyTorch or JAX model; this "
            f"{type(self).__name__} has no forward or backward pass of its own (a "
            f"batchjac.ClosedForm model carries its Jacobian only: multiply it).")

    def second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                      with_outputs: bool, with_jacobian: bool) -> Kernel:
        """The cached second-order kernel (kept apart from the Jacobian kernels, with the same
        least-recently-used bound)."""
        cache: OrderedDict[tuple[Any, ...], Kernel] = self.__dict__.setdefault(
            "_second_kernels", OrderedDict())
        key = (kind, order, chunk_size, with_outputs, with_jacobian)
        with self._kernels_lock:
            kernel = cache.get(key)
            if kernel is not None:
                cache.move_to_end(key)
                return kernel
        kernel = self.build_second_kernel(kind, order, chunk_size, with_outputs, with_jacobian)
        with self._kernels_lock:
            kernel = cache.setdefault(key, kernel)
            cache.move_to_end(key)
            while len(cache) > self.MAX_KERNELS:
                cache.popitem(last=False)
        return kernel

    def has_second_kernel(self, kind: SecondKind, order: Order, chunk_size: int,
                          with_outputs: bool, with_jacobian: bool) -> bool:
        return (kind, order, chunk_size, with_outputs, with_jacobian) in \
            self.__dict__.get("_second_kernels", {})

    # -- derivatives that carry gradients (batchjac._differentiable) ---------------------------
    def rematerializes_reverse(self, kind: str) -> bool:
        """Whether :meth:`rematerialized` recomputes ``kind``'s reverse-mode builds too (not
        only its forward-mode ones)."""
        return True

    def differentiable(self, kind: str, how: str, *, with_outputs: bool, with_jacobian: bool,
                       recomputed: bool = False
                       ) -> Callable[[Any, tuple[Any, ...], Any], dict[str, Any]]:
        """``(u, ctx, v) -> {name: array}``: the result of ``kind`` ("jacobian", or a
        :data:`SecondKind` with ``v`` the tangents of ``hvp``) computed by ``how`` (a mode, or
        an order), as framework operations on the framework's arrays, in its graph: a loss on
        the result has a gradient for the model's parameters and for the inputs. Named as a
        kernel's results are ("jacobians", the kind's, "outputs"). ``recomputed``: it will run
        under :meth:`rematerialized`. Backends that can override this."""
        from .._errors import InputError

        raise InputError(
            f"The {type(self).__name__} backend cannot compute derivatives that carry gradients; "
            f"differentiable=True needs a TensorFlow, PyTorch or JAX model.")

    def rematerialized(self, fn: Callable[[Any, tuple[Any, ...], Any], dict[str, Any]]
                       ) -> Callable[[Any, tuple[Any, ...], Any], dict[str, Any]]:
        """``fn`` (of :meth:`differentiable`) with its intermediates recomputed in the backward
        pass instead of kept (``torch.utils.checkpoint``, ``jax.checkpoint``,
        ``tf.recompute_grad``): each chunk of a budgeted call holds its own only while it is
        computed."""
        return fn

    def differentiable_output_shape(self, u: Any, ctx: tuple[Any, ...]) -> tuple[int, ...]:
        """The per-instance output shape for the framework's arrays ``u``/``ctx`` (a few rows),
        inside a trace too (no numbers read)."""
        raise NotImplementedError

    def kernel_sizes(self, mode: Mode, with_outputs: bool) -> list[int]:
        """The chunk sizes of the kernels built so far for ``mode`` (and outputs flag)."""
        with self._kernels_lock:
            return [size for (m, size, w) in self._kernels if m == mode and w == with_outputs]

    def output_shape_of(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> tuple[int, ...] | None:
        """The per-instance output shape without computing or compiling anything (JAX's
        ``eval_shape``), or None where the framework cannot tell that cheaply. Where it can, the
        probes run beside the first kernel's compilation instead of before it."""
        return None

    def device_free_memory(self) -> int | None:
        """Free bytes of the accelerator the kernels run on, for the memory budget; None when
        they run on the host (the budget then comes from the host's memory)."""
        return None

    def row_working_set(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> float | None:
        """Bytes one row of a forward derivative (the model and one tangent) holds at its peak,
        by an estimate from a trace made of these rows already (no new one), where the
        kernels run on the host's CPU (the planner keeps a chunk's temporaries within its
        cache, :func:`batchjac._plan.fit_cache`); None when there is no such estimate."""
        return None

    def rows_apart(self, u: np.ndarray, ctx: tuple[np.ndarray, ...]) -> bool:
        """True when the framework can prove, without computing anything, that the model is
        deterministic and maps each row of a batch to its own output row (JAX reads its
        jaxpr): the probes then skip their forward passes. False: cannot tell."""
        return False

    def in_thread(self) -> contextlib.AbstractContextManager[Any]:
        """The framework settings of the calling thread, entered in another thread that works
        for it (the probes beside the first kernel): JAX's x64 mode may be a thread's own."""
        return contextlib.nullcontext()

    def kernels(self) -> list[Kernel]:
        """Every kernel made for this model so far, first and second order."""
        with self._kernels_lock:
            return [*self._kernels.values(), *self.__dict__.get("_second_kernels", {}).values()]

    def has_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool) -> bool:
        """Whether that kernel exists already (using it costs no compilation)."""
        return (mode, chunk_size, with_outputs) in self._kernels

    def forget_kernel(self, mode: Mode, chunk_size: int, with_outputs: bool) -> None:
        """Drop that kernel (one made beside the calls whose first run failed there: the call
        that needs it makes it again)."""
        with self._kernels_lock:
            self._kernels.pop((mode, chunk_size, with_outputs), None)

    def make_beside(self, mode: Mode, chunk_size: int, with_outputs: bool, budget: CallBudget,
                    variant: str | None = None) -> concurrent.futures.Future[Kernel | None] | None:
        """Start making the kernel of ``mode`` (as :meth:`kernel` does, with ``budget``; fixed
        to build ``variant`` where given) on the thread that makes builds beside the calls
        (:data:`BESIDE`), where this backend does (:attr:`builds_beside`), a core is free and
        the kernel does not exist: its future, else None (the call that first needs it makes
        it). A making that failed leaves no kernel: that call makes it again and reports the
        failure where it belongs."""
        if not self.builds_beside or not idle_core() or \
                self.has_kernel(mode, chunk_size, with_outputs):
            return None
        return BESIDE.submit(self.made_beside, self.beside_settings(), mode, chunk_size,
                             with_outputs, budget, variant)

    def beside_settings(self) -> Any:
        """What a build made on another thread must share with the calling thread (read in
        the calling thread): JAX's trace settings; nothing here."""
        return None

    def made_beside(self, settings: Any, mode: Mode, chunk_size: int, with_outputs: bool,
                    budget: CallBudget, variant: str | None = None) -> Kernel | None:
        """On the thread beside the calls: the kernel made (:meth:`make_beside`), or None where
        this thread's ``settings`` differ from the calling thread's (the call makes it)."""
        return self.kernel(mode, chunk_size, with_outputs, variant=variant, budget=budget)

    def mode_race_builds(self, mode: Mode, chunk_size: int, with_outputs: bool) -> float:
        """The compilations a race of the two modes at this chunk size costs, in makings of a
        kernel of ``mode`` (what the ledger's first call measured): the other mode's kernel
        (weighed by :attr:`forward_build_cost`), and whatever the existing kernel of ``mode``
        still has to compile to be timed (JAX: a full build beside its quick first one), or
        that kernel too if it is new."""
        with self._kernels_lock:
            kernel = self._kernels.get((mode, chunk_size, with_outputs))
        other = self.forward_build_cost if mode == "reverse" else 1 / self.forward_build_cost
        return other + (1 if kernel is None else kernel.provisional_builds)

    def refresh(self) -> bool:
        """Called before each use; e.g. re-sync weights of a float64 copy of the model.
        Returns True when the compiled kernels were dropped (the model changed under them)."""
        return False

    def update(self, **options: Any) -> None:  # noqa: B027 - optional hook
        """Called when this cached bound model serves a call whose options have the same
        :meth:`Backend.options_key`, e.g. new JAX params of the same structure."""


class Backend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def bind(self, model: Any, signature: Signature, **options: Any) -> BoundModel:
        """Wrap ``model`` for ``signature``. Framework-specific checks of the model go here."""

    def device_options(self, model: Any, device: Any, options: dict[str, Any]) -> dict[str, Any]:
        """The options of a call whose inputs are this framework's arrays on ``device``
        (:mod:`batchjac._arrays`): where the model does not say where it computes, the
        inputs' device. By default the options as given (the framework places the work)."""
        return options

    #: whether a differentiable call (:mod:`batchjac._differentiable`) may use the cached bound
    #: model: not where the model's arrays may be a trace's values (JAX: tracers of the
    #: caller's ``jax.grad``, which a cached bound model would keep after the trace ends)
    caches_differentiable_binds: ClassVar[bool] = True

    def options_key(self, options: dict[str, Any]) -> Hashable:
        """What bound models are cached by, besides the model and the signature (hashable).
        Options left out of the key reach the cached bound model through ``update``."""
        return tuple(sorted(options.items()))
