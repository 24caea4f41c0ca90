"""Every use batchjac makes of JAX that a JAX release may rename, move or drop: private or
version-specific names, the names of XLA's compiler options, the parameters of jaxpr
equations, the text of JAX's errors. The other modules of :mod:`batchjac._backends.jax` reach
these only through this one.

Each use is guarded so that, where it is missing or changed, batchjac is slower and still
right, never wrong and never a :class:`~batchjac.ModelError`:

- XLA's option names (:data:`BUILDS`, :data:`CPU_STEADY`, :data:`SECOND_CPU_OPTIONS`,
  :data:`LAPLACIAN_YNN`, census #22-23): a build whose options XLA refuses is compiled with
  XLA's defaults (the first-order race leaves it out; the second-order kernels try the next
  option set); :func:`xla_accepts` tells which this XLA knows (the tests of those builds);
- ``Lowered.as_text(debug_info=False)`` (:func:`module_text`, #24): ``as_text()``, JAX
  0.4.30's form; where neither works, no disk cache of executables;
- ``jax.experimental.serialize_executable`` (:func:`serialize`, :func:`deserialize`) and the
  classes its pickles name (:data:`EXECUTABLE_CLASSES`, #24): no disk cache, each process
  compiles;
- ``memory_analysis().temp_size_in_bytes`` (:func:`temp_bytes`, #25): no blocks of rows;
- ``jax.jit(f).trace`` (:func:`stage`, #26): ``jax.jit(f).lower``, no count of the work (the
  default build first);
- ``jax.enable_x64`` or ``jax.experimental.enable_x64`` (:func:`enable_x64`, #27): with
  neither, x64 is one setting for the whole process, which every thread sees already;
- ``jax.disable_jit`` (:func:`inline_jits`, #31): the forward rules' own jits are traced as
  such (a slower trace of the same program);
- ``jax._src.config.trace_context`` (:func:`trace_settings`): the settings a trace depends on
  (x64, matmul precision, a default device, ... in this thread); where it is gone, nothing is
  traced beside the calls (the call that needs a build traces it, in its own thread);
- jaxpr equations: primitive names and parameters (:func:`primitive`, :func:`param`,
  :func:`sub_jaxprs`, :data:`CALLS`, :func:`bind`, #28-30): the readers catch what a
  renamed parameter raises: "cannot tell" (:mod:`.rows`: the probes run with values), "no
  estimate" (:mod:`.cost`: the default build), "no rule" (:mod:`.laplacian`: the
  second-order kernel differentiates twice with ``jvp``);
- JAX's refusal of forward mode through a ``custom_vjp`` function (:func:`no_forward_rule`):
  recognised by its words, or by what this JAX raises for a tiny ``custom_vjp`` function,
  also behind the traceback-filtering exception older JAX chains in between
  (:func:`unwrapped`).

- ``jax.core.Tracer`` (:func:`is_tracer`): where it is gone, a value is taken as traced by its
  type's name (JAX's tracers are all ``...Tracer`` classes): a differentiable call's NaN check
  then skips what it cannot read.

``tests/test_compat_jax.py`` removes or renames each one and checks the numbers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

# -- XLA's compiler options (census #22-23) ----------------------------------------------------
#: an option of XLA's CPU compiler: which operations it hands to YNNPACK as fusions
YNN_FUSION_TYPE = "xla_cpu_experimental_ynn_fusion_type"
#: XLA's optimisation level (0: the least)
OPTIMIZATION_LEVEL = "xla_backend_optimization_level"
#: XLA's CPU fusion emitters (off: its older loop emitter)
FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"
#: the YNNPACK fusion type that puts each matrix product alone in a library call
INDIVIDUAL_DOT = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"

#: the compiler options of the first-order builds (:class:`~batchjac._backends.jax.builds.
#: JaxKernel`, through :func:`builds`); an XLA that refuses a build's options compiles that
#: build with its defaults
BUILDS: dict[str, dict[str, str | bool]] = {
    "default": {}, "no-ynnpack": {YNN_FUSION_TYPE: ""},
    "quick": {OPTIMIZATION_LEVEL: "0", FUSION_EMITTERS: False}}
#: what the steady builds add on the CPU: XLA's optimisation level 1 without its fusion
#: emitters compiles the benchmark's first-order kernels in about half the time of XLA's
#: defaults, and they run as fast (docs/thresholds.md, "JAX's CPU builds")
CPU_STEADY: dict[str, str | bool] = {OPTIMIZATION_LEVEL: "1", FUSION_EMITTERS: False}


def builds(platform: str) -> dict[str, dict[str, str | bool]]:
    """Each first-order build's compiler options on ``platform`` (``jax.default_backend()``):
    :data:`BUILDS`, with :data:`CPU_STEADY` added to the steady builds on the CPU (elsewhere
    they are the CPU compiler's options, and level 1 would be a GPU's too)."""
    if platform != "cpu":
        return BUILDS
    return {name: options if name == "quick" else {**options, **CPU_STEADY}
            for name, options in BUILDS.items()}


#: the second-order kernels' options on the CPU (:class:`~batchjac._backends.jax.second.
#: JaxSecondKernel`); refused, the next option set is tried, the last XLA's defaults
SECOND_CPU_OPTIONS: dict[str, str | bool] = {FUSION_EMITTERS: False}
#: the YNNPACK fusion types the forward Laplacian tries in turn ("": none)
LAPLACIAN_YNN: tuple[str, ...] = (INDIVIDUAL_DOT, "")


def xla_accepts(options: Mapping[str, str | bool]) -> bool:
    """Whether this JAX's XLA compiles with ``options`` (a tiny function, once per option set):
    an XLA that does not know one refuses it ("No such compile option"; jaxlib 0.4.36 knows
    neither YNNPACK's fusion type nor the fusion emitters), and the kernels then compile the
    next option set or XLA's defaults. Kernels try, and fall back; only a race whose builds
    compile beside the calls asks first (a refusal found there would race a copy of the
    default build)."""
    return not options or _accepts(tuple(sorted(options.items())))


@functools.cache
def _accepts(options: tuple[tuple[str, str | bool], ...]) -> bool:
    try:
        jax.jit(lambda x: x * 2).lower(1.0).compile(compiler_options=dict(options))
    except Exception:
        return False
    return True


# -- stages: trace, lower, compile (census #24-26) ---------------------------------------------
#: the method of a jitted function that traces it without lowering (JAX >= 0.4.30)
_TRACE = "trace"


def stage(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``(jaxpr, lowered)`` of ``jax.jit(fn)`` for ``args``: one trace, its jaxpr (the count of
    the work, :mod:`.cost`) and its lowering. A JAX whose jitted functions have no ``trace``
    lowers them directly: the jaxpr is then None (no estimate)."""
    jitted = jax.jit(fn)
    trace = getattr(jitted, _TRACE, None)
    if trace is None:
        return None, jitted.lower(*args)
    staged = trace(*args)
    return getattr(staged, "jaxpr", None), staged.lower()


def temp_bytes(compiled: Any) -> int | None:
    """The bytes of temporary arrays XLA's buffer assignment gives ``compiled``, or None where
    this JAX has no memory analysis (then no blocks of rows are tried)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        return None


def module_text(lowered: Any) -> str | None:
    """The lowered module's text without source locations (two scripts calling one model
    lower it at different lines), the key of its executable on disk; None where this JAX
    gives no text (no disk cache). JAX 0.4.30's ``as_text`` takes no ``debug_info``."""
    try:
        return str(lowered.as_text(debug_info=False))
    except TypeError:
        pass
    except Exception:
        return None
    try:
        return str(lowered.as_text())
    except Exception:
        return None


def trees(lowered: Any) -> tuple[Any, Any] | None:
    """The argument and result trees of a lowered function (an executable is loaded with the
    trace's own, never unpickled ones), or None (no disk cache)."""
    try:
        return lowered.in_tree, lowered.out_tree
    except Exception:
        return None


def serializer() -> Any:
    """``jax.experimental.serialize_executable``, or None where this JAX has none (no disk
    cache). Importing it holds Python's lock for a while: the writer does it when calls are
    quiet."""
    try:
        from jax.experimental import serialize_executable
    except Exception:
        return None
    return serialize_executable


def serialize(compiled: Any) -> bytes | None:
    """The bytes of a compiled executable, or None where it cannot be serialized."""
    module = serializer()
    try:
        blob, _, _ = module.serialize(compiled)
    except Exception:
        return None
    return blob if isinstance(blob, bytes) else None


def deserialize(payload: bytes, lowered: Any) -> Any:
    """The executable in ``payload``, loaded for the trees of ``lowered``, or None: a payload
    this jaxlib cannot load (the caller compiles)."""
    module, both = serializer(), trees(lowered)
    if both is None:
        return None
    try:
        return module.deserialize_and_load(payload, *both)
    except Exception:
        return None


#: the (module, name) pairs a serialized executable's pickle names (an
#: ``UnloadedMeshExecutable`` and what it holds, in the JAX releases batchjac supports:
#: ``JaxprDebugInfo`` and jaxlib's ``SingleDeviceSharding`` are JAX 0.4's); a pickle that
#: names anything else is not loaded. A JAX that pickles other classes loads nothing from the
#: cache: it compiles, as without one (the warm-process tests say so when that happens)
EXECUTABLE_CLASSES = frozenset({
    ("jax", "P"), ("jax.sharding", "PartitionSpec"), ("jax._src.partition_spec", "PartitionSpec"),
    ("jax._src.core", "ManualAxisType"), ("jax._src.core", "MemorySpace"),
    ("jax._src.core", "ShapedArray"), ("jax._src.core", "AxisType"),
    ("jax._src.core", "JaxprDebugInfo"), ("jaxlib.xla_extension", "SingleDeviceSharding"),
    ("jax._src.mesh", "AxisType"), ("jax._src.mesh", "AbstractMesh"), ("jax._src.mesh", "Mesh"),
    ("jax._src.interpreters.pxla", "AllArgsInfo"),
    ("jax._src.interpreters.pxla", "UnloadedMeshExecutable"),
    ("jax._src.interpreters.pxla", "MeshExecutableFastpathData"),
    ("jax._src.layout", "Layout"), ("jax._src.layout", "DeviceLocalLayout"),
    ("jax._src.layout", "Format"), ("jax._src.linear_util", "DebugInfo"),
    ("jax._src.api_util", "DebugInfo"), ("jax._src.core", "DebugInfo"),
    ("jax._src.named_sharding", "_unpickle_named_sharding"),
    ("jax._src.named_sharding", "NamedSharding"),
    ("jax._src.sharding_impls", "_unpickle_single_device_sharding"),
    ("jax._src.sharding_impls", "_unpickle_named_sharding"),
    ("jax._src.sharding_impls", "SingleDeviceSharding"),
    ("jax._src.sharding_impls", "GSPMDSharding"), ("jax._src.sharding_impls", "UnspecifiedValue"),
    ("jax._src.stages", "ArgInfo"), ("jaxlib._jax", "DeviceList"),
    ("jaxlib.xla_extension", "DeviceList"), ("jax._src.lib", "DeviceList"),
    ("numpy", "dtype"), ("numpy.dtypes", "Float32DType"), ("numpy.dtypes", "Float64DType"),
    ("builtins", "frozenset"), ("builtins", "set"), ("builtins", "slice"),
    ("collections", "OrderedDict"),
})


# -- process state: x64 in a thread, jit inlined (census #27, #31) ----------------------------
#: where JAX keeps its x64 context: ``jax.enable_x64`` (JAX >= 0.7), else
#: ``jax.experimental.enable_x64``
_X64_HOMES = (("jax", "enable_x64"), ("jax.experimental", "enable_x64"))


def enable_x64(on: bool) -> contextlib.AbstractContextManager[Any]:
    """A context computing with x64 ``on`` in this thread (the probes' thread takes the calling
    thread's mode). A JAX with neither home has no per-thread mode to carry: the process's
    setting holds in every thread, and nothing is needed."""
    import importlib

    for module, name in _X64_HOMES:
        try:
            context = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if context is not None:
            return context(on)  # type: ignore[no-any-return]
    return contextlib.nullcontext()


def trace_settings() -> Any:
    """The settings of this thread a trace depends on (JAX's own key for its jit cache:
    x64, the matmul precision, a default device, ... with this thread's overrides), or None
    where this JAX does not say. A build traced on another thread is the calling thread's
    only where the two are equal."""
    try:
        from jax._src import config as jax_config

        return jax_config.trace_context()
    except Exception:  # (a JAX that moved or renamed it: nothing is traced beside the calls)
        return None


#: JAX's context in which ``jax.jit`` traces inline
_DISABLE_JIT = "disable_jit"


def inline_jits() -> contextlib.AbstractContextManager[Any]:
    """A context where the jax.numpy calls of the forward rules are traced inline, not each as
    a jit of its own first (a quicker trace of the same program); none where JAX lacks it."""
    disable = getattr(jax, _DISABLE_JIT, None)
    return contextlib.nullcontext() if disable is None else disable()


# -- jaxpr equations (census #28-30) ------------------------------------------------------------
#: primitives holding a sub-jaxpr called on their operands as they are, by the parameter that
#: holds it (``pjit`` became ``jit``; ``custom_vjp_call_jaxpr`` is older JAX's)
CALLS: Mapping[str, str] = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}
#: ... of those, the ones the forward rules (:mod:`.laplacian`) walk into: not a
#: ``custom_vjp`` function, which has no forward-mode rule to follow
FORWARD_CALLS: Mapping[str, str] = {
    name: key for name, key in CALLS.items() if not name.startswith("custom_vjp")}
#: the parameters that hold the sub-jaxprs an equation runs (calls, loops, branches)
SUB_JAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr", "branches")
#: ... of those, the ones a call runs once per evaluation
CALLED_ONCE = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def primitive(eqn: Any) -> str:
    """The name of an equation's primitive."""
    return str(eqn.primitive.name)


def param(eqn: Any, name: str) -> Any:
    """The parameter ``name`` of an equation: a ``KeyError`` where this JAX names it otherwise,
    which every reader turns into its fallback."""
    return eqn.params[name]


def maybe_param(eqn: Any, name: str) -> Any:
    """The parameter ``name`` of an equation, or None where it has none."""
    return eqn.params.get(name)


def sub_jaxprs(eqn: Any, names: tuple[str, ...] = SUB_JAXPRS) -> Iterator[Any]:
    """The jaxprs (not closed) an equation holds under ``names``, in their order."""
    for name in names:
        sub = eqn.params.get(name)
        for one in sub if isinstance(sub, (tuple, list)) else (sub,):
            body = getattr(one, "jaxpr", one)
            if hasattr(body, "eqns"):
                yield body


def is_literal(var: Any) -> bool:
    """Whether an equation's operand is a literal (a value, no variable): told by its ``val``,
    since importing ``jax.extend`` for its class costs more than a small first call's walk."""
    return hasattr(var, "val")


def bind(eqn: Any, args: Any) -> list[Any]:
    """The equation's primitive applied to ``args`` with its parameters: a list of results.
    JAX < 0.7's ``get_bind_params`` returns ``(subfunctions, params)``."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Any = ()
    if isinstance(params, tuple):
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# -- JAX's errors -------------------------------------------------------------------------------
#: the exceptions of JAX's traceback filtering, which JAX before 0.5 chains between an error
#: raised inside a trace and the error that caused it
_TRACEBACK_WRAPPERS = ("SimplifiedTraceback", "UnfilteredStackTrace")


def unwrapped(e: BaseException | None) -> BaseException | None:
    """``e``, or where it is one of JAX's traceback-filtering exceptions, the error behind it."""
    while e is not None and type(e).__name__ in _TRACEBACK_WRAPPERS:
        e = e.__cause__
    return e


#: what JAX's refusal of forward mode through a ``custom_vjp`` function says (directly, or its
#: linearised form inside a second forward pass)
NO_FORWARD_RULE = (("custom_vjp", "forward-mode"), ("'custom_lin'",))


def no_forward_rule(e: Exception) -> bool:
    """Whether ``e`` is JAX refusing forward mode through a ``custom_vjp`` function: its text
    holds one of :data:`NO_FORWARD_RULE`, or it is what this JAX raises when a tiny
    ``custom_vjp`` function is pushed forward, once or twice (where a release words its
    refusal otherwise)."""
    text = f"{type(e).__name__}: {e}"
    if any(all(part in text for part in marks) for marks in NO_FORWARD_RULE):
        return True
    return any(isinstance(e, kind) and line in text for kind, line in _forward_refusals())


@functools.lru_cache(maxsize=1)
def _forward_refusals() -> tuple[tuple[type[Exception], str], ...]:
    """The type and first line of what JAX raises for forward mode through a ``custom_vjp``
    function, and for forward over forward through one (traced only, on a scalar)."""

    @jax.custom_vjp
    def square(x: Any) -> Any:
        return x * x

    square.defvjp(lambda x: (x * x, x), lambda x, g: (2 * x * g,))

    def twice(x: Any) -> Any:
        return jax.jvp(lambda a: jax.jvp(square, (a,), (x,))[1], (x,), (x,))

    found = []
    for fn in (jax.jacfwd(square), twice):
        try:
            jax.make_jaxpr(fn)(1.0)
        except Exception as e:
            lines = str(e).strip().splitlines()
            if lines and lines[0]:
                found.append((type(e), lines[0]))
    return tuple(found)


# -- a trace's values (differentiable calls) ---------------------------------------------------

def is_tracer(a: Any) -> bool:
    """Whether ``a`` is a value of a JAX trace (numbers known only when it runs)."""
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    if isinstance(tracer, type):
        return isinstance(a, tracer)
    return type(a).__name__.endswith("Tracer")  # (a JAX without it)
