"""Every private or version-specific part of torch the PyTorch backend uses, each behind one
function, each guarded (census #13-21 of the engine review, and the custom-Function reads of the
second-order kernel). Where one is missing or has changed, batchjac runs slower and stays right;
it never raises an error from here, and never blames the model for it:

==========================================  ====================================================
what (torch)                                 where it is gone or has changed
==========================================  ====================================================
``nn.modules.batchnorm._BatchNorm``,         the training-mode warning names the public
``nn.modules.dropout._DropoutNd``            batch-norm and dropout classes
(:func:`mode_dependent_layers`)
``utils._python_dispatch.TorchDispatchMode`` no working-set estimate (the chunks are not cut to
(:func:`dispatch_mode`)                      the cache) and no forward Laplacian (the order's
                                             own build)
``TorchDispatchMode._should_skip_dynamo``    the modes' handlers are wrapped by TorchDynamo
(:func:`dispatch_mode`)                      (imported on their first call)
``utils._pytree`` (:func:`pytree`)           as ``TorchDispatchMode``
``Tensor._version`` (:func:`version`)        every weight reads as changed: cast copies and
                                             Laplacian tapes are made again on every call
``forward_ad._maybe_load_decompositions``    loaded by torch on the first dual tensor, its
(:func:`load_forward_decompositions`)        deprecation warning not silenced
``warnings._filters_mutated`` (Python's)     the per-module warning caches are not reset
``"torch._dynamo" in sys.modules``           the cheap first builds are taken as if TorchDynamo
(:func:`dynamo_loaded`)                      were not loaded
``OptimizedModule._orig_mod``, a compiled    a ``torch.compile``d model is computed compiled
function's ``_torchdynamo_orig_callable``,   (correct; its first call and each new chunk
``Module._compiled_call_impl``               shape compile again)
(:func:`uncompiled`)
ATen names, ``overloadpacket.__name__``      every operation takes the Laplacian's general
(:func:`aten_name`)                          rule; where the namespace cannot be read, no
                                             forward Laplacian (the order's own build)
``torch.OutOfMemoryError`` (torch 2.5+)      ``torch.cuda.OutOfMemoryError`` and the message
(:func:`out_of_memory_errors`)
a graph node's ``_forward_cls``,             each custom autograd Function is taken as not twice
``AccumulateGrad.variable``,                 differentiable (no plain-autograd second order, no
``once_differentiable``'s wrapper            forward over forward through it); an error that
(:func:`functions_readable` and the          names the torch version where torch.func cannot
functions it checks)                         differentiate it either
==========================================  ====================================================

Only this module of the backend names them (tests/test_architecture.py checks the imports);
tests/test_compat_torch.py removes or renames each and compares the numbers with references.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings
from types import ModuleType
from typing import Any

import torch


def _private(name: str) -> ModuleType | None:
    """The module ``name`` of torch's private API, or None where it cannot be imported."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


# -- #13: the layers whose output depends on training mode ----------------------------------------
#: the public classes of the two private bases, for a torch without them
_PUBLIC_MODE_DEPENDENT = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                          "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d", "Dropout",
                          "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                          "FeatureAlphaDropout")


@functools.cache
def mode_dependent_layers() -> tuple[type, ...]:
    """The module classes whose output depends on training mode (batch statistics, random
    masks): torch's private bases of batch norm and dropout where they exist, and their public
    subclasses (all of them where a base is gone)."""
    found: list[type] = []
    for module, name in (("batchnorm", "_BatchNorm"), ("dropout", "_DropoutNd")):
        base = getattr(getattr(torch.nn.modules, module, None), name, None)
        if isinstance(base, type):
            found.append(base)
    for name in _PUBLIC_MODE_DEPENDENT:
        cls = getattr(torch.nn, name, None)
        if isinstance(cls, type) and not issubclass(cls, tuple(found)):
            found.append(cls)
    return tuple(found)


# -- #14, #16: dispatch modes ---------------------------------------------------------------------
#: the classmethod by which a dispatch mode says whether TorchDynamo wraps its handler
_SKIP_DYNAMO = "_should_skip_dynamo"


def _no_dynamo(cls: type) -> bool:
    return False


@functools.cache
def dispatch_mode(handler: type) -> type | None:
    """``handler`` (a class with ``__init__`` and ``__torch_dispatch__``) made a torch dispatch
    mode, or None where torch has no ``TorchDispatchMode`` batchjac can use. The mode runs no
    compiled code, so TorchDynamo is kept out of its handler: torch's default wraps it in
    ``torch._dynamo.disable``, whose first call imports TorchDynamo; where the classmethod that
    says so is renamed, the mode is made without it (the import then, the same values)."""
    module = _private("torch.utils._python_dispatch")
    base = getattr(module, "TorchDispatchMode", None)
    if not isinstance(base, type):
        return None
    body = {name: handler.__dict__[name] for name in ("__init__", "__torch_dispatch__")
            if name in handler.__dict__}
    body.update(__module__=handler.__module__, __qualname__=handler.__qualname__,
                __doc__=handler.__doc__)
    hooked = isinstance(base.__dict__.get(_SKIP_DYNAMO), classmethod)
    for quiet in ((True, False) if hooked else (False,)):
        attrs = {**body, _SKIP_DYNAMO: classmethod(_no_dynamo)} if quiet else body
        try:
            return type(handler.__name__, (handler, base), attrs)
        except Exception:
            continue
    return None


# -- #15: pytrees ---------------------------------------------------------------------------------
@functools.cache
def pytree() -> ModuleType | None:
    """``torch.utils._pytree`` (flatten, map and rebuild nested args), or None where it cannot
    be imported or lacks a function the backend calls."""
    module = _private("torch.utils._pytree")
    needed = ("tree_flatten", "tree_unflatten", "tree_leaves", "tree_map", "tree_map_only",
              "tree_structure")
    if module is None or not all(callable(getattr(module, n, None)) for n in needed):
        return None
    return module


# -- #17: in-place versions -----------------------------------------------------------------------
def version(t: torch.Tensor) -> int | None:
    """The version counter of ``t`` (it moves on every in-place change), or None where it
    cannot be read: a caller then takes ``t`` as changed and recomputes what it derived."""
    try:
        v = t._version
    except Exception:
        return None
    return v if isinstance(v, int) else None


# -- #18, #19: forward mode's decompositions and the warning filters ------------------------------
#: torch's loader of forward mode's decompositions, in ``torch.autograd.forward_ad``
_DECOMPOSITIONS = "_maybe_load_decompositions"
#: Python's reset of the per-module warning caches, in ``warnings``
_FILTERS_MUTATED = "_filters_mutated"


def load_forward_decompositions() -> bool:
    """Load forward mode's decompositions now (torch otherwise loads them on the first dual
    tensor); False where this torch has no such loader (nothing to do, or torch does it)."""
    load = getattr(torch.autograd.forward_ad, _DECOMPOSITIONS, None)
    if not callable(load):
        return False
    load()
    return True


def warning_filters_changed() -> None:
    """After ``warnings.filters`` was edited in place: the per-module caches of warnings
    already shown are reset (Python's own hook, where it has it)."""
    mutated = getattr(warnings, _FILTERS_MUTATED, None)
    if callable(mutated):
        mutated()


# -- #20: TorchDynamo ---------------------------------------------------------------------------
#: what importing torch._dynamo costs, the first use of a torch.func transform in a process
#: (measured: docs/thresholds.md): a race against a torch.func build pays it where the builds
#: in use have not
DYNAMO_IMPORT_SECONDS = 1.0


def dynamo_loaded() -> bool:
    """Whether TorchDynamo is imported already (torch.func's transforms import it on their
    first use; the plain-autograd builds do not)."""
    return "torch._dynamo" in sys.modules


#: where torch.compile keeps the original: of a module (``torch.compile(module)``, an
#: ``OptimizedModule``), of a function, and the compiled call of a module compiled in place
#: (``module.compile()``), which ``Module._call_impl`` bypasses
_ORIG_MOD, _ORIG_CALLABLE, _COMPILED_CALL = ("_orig_mod", "_torchdynamo_orig_callable",
                                             "_compiled_call_impl")


def uncompiled(model: Any) -> Any | None:
    """The model ``torch.compile`` compiled, called uncompiled: an ``OptimizedModule``'s
    original module, a compiled function's original function, a module compiled in place
    called through ``Module._call_impl``; None for a model that is not compiled (or whose
    original cannot be read)."""
    if isinstance(model, torch.nn.Module):
        if type(model).__name__ == "OptimizedModule":
            orig = getattr(model, _ORIG_MOD, None)
            return orig if isinstance(orig, torch.nn.Module) else None
        call = getattr(torch.nn.Module, "_call_impl", None)
        if getattr(model, _COMPILED_CALL, None) is not None and callable(call):
            return types.MethodType(call, model)
        return None
    orig = getattr(model, _ORIG_CALLABLE, None)
    return orig if callable(orig) and orig is not model else None


# -- #21: ATen operation names ------------------------------------------------------------------
def aten_name(op: Any) -> str | None:
    """The name of an ATen operation as the forward Laplacian's tables spell it (``"mm"`` for
    ``aten::mm.default``); "" where the name cannot be read (the general rule then, never
    another operation's); None for an operation outside the ``aten`` namespace, or one whose
    namespace cannot be read (a custom op named ``mylib::tanh`` is not ``aten::tanh``, and
    torch's forward mode passes no tangent through a custom op without a forward rule: zeros,
    without an error)."""
    try:
        namespace = op.namespace
    except Exception:
        return None
    if namespace != "aten":
        return None
    try:
        name = op.overloadpacket.__name__
    except Exception:
        return ""
    return name if isinstance(name, str) else ""


# -- out of memory ------------------------------------------------------------------------------
@functools.cache
def out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """The exceptions torch raises when a device's memory runs out: ``torch.OutOfMemoryError``
    from torch 2.5, ``torch.cuda.OutOfMemoryError`` before; Python's ``MemoryError`` always."""
    found: list[type[BaseException]] = [MemoryError]
    for owner in (torch, getattr(torch, "cuda", None)):
        cls = getattr(owner, "OutOfMemoryError", None)
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in found:
            found.append(cls)
    return tuple(found)


# -- custom autograd Functions in a graph ---------------------------------------------------------
#: where a custom Function's backward node names its Function
_FORWARD_CLS = "_forward_cls"


def function_of(node: Any) -> type | None:
    """The custom ``torch.autograd.Function`` whose backward node ``node`` is, or None."""
    function = getattr(node, _FORWARD_CLS, None)
    return function if isinstance(function, type) else None


def leaf_of(node: Any) -> Any:
    """The tensor an ``AccumulateGrad`` node accumulates into (None for other nodes)."""
    return getattr(node, "variable", None)


def is_python_node(node: Any) -> bool:
    """Whether a graph node's class is defined in Python (a custom Function's backward is;
    torch's own nodes are C++ classes): what is left to tell a custom Function by where
    :func:`functions_readable` is False."""
    return type(node).__module__ != "builtins"


def _once_code() -> Any:
    """The code of the wrapper ``torch.autograd.function.once_differentiable`` puts around a
    backward (``functools.wraps`` copies the name, not the code); None where it has none."""
    try:
        marked = torch.autograd.function.once_differentiable(lambda ctx, *g: g)
    except Exception:
        return None
    return getattr(marked, "__code__", None)


_ONCE_CODE = _once_code()


def once_differentiable(function: type) -> bool:
    """Whether a custom Function's backward is ``@once_differentiable``: computed under
    ``no_grad``, so plain autograd cannot differentiate it again."""
    if _ONCE_CODE is None:
        return True
    for name in ("backward", "vjp"):
        fn = getattr(function, name, None)
        if getattr(fn, "__code__", None) is _ONCE_CODE:
            return True
    return False


@functools.cache
def functions_readable() -> bool:
    """Whether :func:`function_of`, :func:`leaf_of` and :func:`once_differentiable` read this
    torch right, tried once on two Functions of known kinds: where not, a model's custom
    Functions cannot be told apart, and each is taken as not twice differentiable."""
    try:
        class Once(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * 2

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g * 2

        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * 2

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g * 2

        with torch.enable_grad():
            x = torch.ones(1, requires_grad=True)
            once, twice = Once.apply(x), Twice.apply(x)
        leaves = [leaf_of(n) for n, _ in once.grad_fn.next_functions if n is not None]
        return (function_of(once.grad_fn) is Once and function_of(twice.grad_fn) is Twice
                and once_differentiable(Once) and not once_differentiable(Twice)
                and function_of(x.grad_fn) is None and any(t is x for t in leaves))
    except Exception:
        return False
