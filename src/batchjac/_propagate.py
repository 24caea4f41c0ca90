"""``propagate``: input uncertainty to output uncertainty, per instance.

Three methods, one result shape:

- ``"linear"``: first order, ``mean = f(mu)``, ``cov = J Sigma J^T``, with ``f(mu)`` and ``J``
  from the same pass of the Jacobian kernel;
- ``"unscented"``: the scaled unscented transform (Julier & Uhlmann 1997; Wan & van der Merwe
  2000), ``2 k + 1`` sigma points per instance;
- ``"monte_carlo"``: ``n_samples`` seeded Gaussian draws per instance, evaluated in large
  batches through the bound model's forward pass.

Instances are processed in chunks and written into ``out`` arrays when given (e.g.
``np.lib.format.open_memmap``), so results larger than memory stream like Jacobians.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._arrays import OutputArg, deliver, like, on_host
from ._backends import LinearHead
from ._errors import BatchJacError, CovarianceClippedWarning, InputError, add_context
from ._evaluate import (
    Evaluator,
    bind,
    block_rows,
    budget,
    check_out,
    context,
    in_elems,
    output_size,
    reduce_jacobians,
    repeat_rows,
)
from ._loaders import as_model
from ._plan import ModeArg, bytes_per_row
from ._runner import model_call, pad_chunk
from ._sinks import ArraySink
from ._spec import BatchSpec
from ._validate import DTypeLike, normalize, to_numpy

Method = Literal["linear", "unscented", "monte_carlo"]
_METHODS = ("linear", "unscented", "monte_carlo")


@dataclass
class Propagation:
    """Per-instance output mean ``(N, *output_shape)`` and covariance ``(N, m, m)``, with
    ``m`` the flattened output size (C order), of the inputs' array kind and on their device
    (see :func:`propagate`)."""

    mean: Any
    cov: Any
    method: str
    output_shape: tuple[int, ...]
    n_samples: int | None = None
    #: how the input uncertainty was taken: "std", "std per instance", "diagonal (taken as
    #: std)", "diagonal per instance (taken as std)", "low rank (r of k)", "dense" or "dense
    #: per instance" (a structured ``cov`` costs what its structure needs, not ``k^2``); a
    #: shared one sandwiched through the model's linear head adds ", folded through the
    #: model's linear head (w of k values)"
    sigma_form: str = ""
    #: unscented only: instances whose covariance had negative eigenvalues (negative centre
    #: weight) and was projected onto the nearest positive semi-definite matrix
    clipped: int = 0

    @property
    def std(self) -> Any:
        """Per-instance output standard deviations, shaped like ``mean`` and of its kind."""
        var = np.diagonal(to_numpy(self.cov, "cov"), axis1=1, axis2=2)
        return like(np.sqrt(np.maximum(var, 0.0)).reshape(tuple(self.mean.shape)), self.mean)


class _Uncertainty:
    """The input covariance in one of its accepted forms, validated, served by instance range.

    ``kind``: "shared" (one (k, k) matrix), "stack" (N, k, k), "std_shared" (k,) or
    "std_stack" (N, k). A ``cov`` with no entry off its diagonal becomes the standard
    deviations it holds ("std_shared"; a stack of such matrices "diag_stack", its diagonals
    read per range), and a shared one of rank ``r <= k / 2`` is sandwiched through its factor
    (``(A L)(A L)^T``, ``L`` of ``k x r``): ``A Sigma A^T`` then costs ``m k`` or ``m k r``
    a row where the dense product costs ``m k^2`` (``form`` says which was taken).
    """

    def __init__(self, cov: Any, std: Any, n: int, unknown_shape: tuple[int, ...]) -> None:
        k = int(np.prod(unknown_shape, dtype=np.int64))
        self.k, self.n = k, n
        self.kind: str
        self.data: Any  # an array; per-instance stacks may be memory-mapped
        self.form = ""  # how it is taken (Propagation.sigma_form)
        if (cov is None) == (std is None):
            raise InputError(
                "Give the input uncertainty as exactly one of `cov` (a (k, k) matrix for all "
                "instances, or an (N, k, k) stack) and `std` (standard deviations, (k,) or "
                "(N, k)); got " + ("both." if cov is not None else "neither.")
            )
        ushape = tuple(unknown_shape)
        if std is not None:
            s = _as_float(std, "std")
            if s.ndim == 0:
                s = np.full(k, float(s))
            if s.shape in ((k,), ushape):
                self.kind, self.data = "std_shared", s.reshape(k).astype(np.float64)
                self.form = "std"
            elif s.shape in ((n, k), (n, *ushape)):
                self.kind, self.data = "std_stack", s.reshape(n, k)
                self.form = "std per instance"
            else:
                raise InputError(
                    f"`std` has shape {s.shape}, which does not match the {k} unknowns (unknown "
                    f"shape {ushape}, {n} instances): give ({k},) for all instances or ({n}, {k}) "
                    f"per instance."
                )
            self._check_std()
        else:
            c = _as_float(cov, "cov")
            if c.shape == (k, k):
                self.kind, self.data = "shared", c.astype(np.float64)
            elif c.shape == (n, k, k):
                self.kind, self.data = "stack", c
            else:
                hint = " For standard deviations use `std=`." if c.ndim in (1, 2) and \
                    c.shape[-1] == k else ""
                raise InputError(
                    f"`cov` has shape {c.shape}, which does not match the {k} unknowns (unknown "
                    f"shape {ushape}, {n} instances): give ({k}, {k}) for all instances or "
                    f"({n}, {k}, {k}) per instance.{hint}"
                )
            self._check_cov(c.dtype)
            self._structure()

    #: a shared covariance of at most this share of full rank is used through its factor
    LOW_RANK = 0.5

    def _structure(self) -> None:
        """Take a diagonal ``cov`` as standard deviations, a low-rank shared one as its
        factor (after :meth:`_check_cov`: symmetric, positive semi-definite)."""
        k = self.k
        if self.kind == "shared":
            c = self.data
            if not np.any(c - np.diag(np.diagonal(c))):
                self.kind, self.data = "std_shared", np.sqrt(np.maximum(np.diagonal(c), 0.0))
                self.form = "diagonal (taken as std)"
                return
            # the rank from the eigenvalues the check computed; the factor only where it is
            # used (a dense Sigma is sandwiched as it is: no eigendecomposition)
            tol = 100 * k * np.finfo(np.float64).eps
            r = int((self._eigenvalues > tol * max(self._eigenvalues.max(), 1e-300)).sum())
            if r > self.LOW_RANK * k:
                self.form = "dense"
                return
            w, v = np.linalg.eigh(_sym(c))
            kept = w > tol * max(w.max(), 1e-300)
            self._shared_factor = v * np.sqrt(np.maximum(w, 0.0))
            self._low = np.ascontiguousarray(self._shared_factor[:, kept])
            self.form = f"low rank ({int(kept.sum())} of {k})"
            return
        if self._all_diagonal:
            self.kind, self.form = "diag_stack", "diagonal per instance (taken as std)"
        else:
            self.form = "dense per instance"

    def _std_of(self, lo: int, hi: int) -> np.ndarray:
        """Standard deviations, ``(k,)`` shared or ``(hi - lo, k)`` (the std kinds and a
        stack of diagonal covariances)."""
        if self.kind == "std_shared":
            return self.data
        if self.kind == "std_stack":
            return np.asarray(self.data[lo:hi], np.float64)
        diag = np.diagonal(np.asarray(self.data[lo:hi], np.float64), axis1=1, axis2=2)
        return np.sqrt(np.maximum(diag, 0.0))

    def _check_std(self) -> None:
        for lo in range(0, self.n if self.kind == "std_stack" else 1, 65536):
            s = self.data if self.kind == "std_shared" else np.asarray(self.data[lo:lo + 65536])
            bad = ~np.isfinite(s) | (s < 0)
            if bad.any():
                where = np.argwhere(bad)[0]
                inst = "" if self.kind == "std_shared" else f" for instance {lo + int(where[0])}"
                raise InputError(
                    f"`std` has an invalid value {s[tuple(where)]}{inst}: standard deviations "
                    f"must be finite and >= 0."
                )

    def _check_cov(self, dtype: np.dtype) -> None:
        eps = float(np.finfo(dtype).eps) if dtype.kind == "f" else float(np.finfo(np.float64).eps)
        if self.kind == "shared":
            c = self.data
            diag = np.diagonal(c)
            if np.isfinite(c).all() and (diag >= 0).all() and not np.any(c - np.diag(diag)):
                self._eigenvalues = diag.copy()  # (a diagonal's: no eigendecomposition)
                return
            self._eigenvalues = _check_psd(self.data[None], 0, shared=True, eps=eps)[0]
            return
        self._all_diagonal = True
        off = ~np.eye(self.k, dtype=bool)
        for lo in range(0, self.n, 4096):
            block = np.asarray(self.data[lo:lo + 4096])
            _check_psd(block, lo, shared=False, eps=eps)
            self._all_diagonal = self._all_diagonal and not np.any(block[:, off])

    def factor(self, lo: int, hi: int) -> np.ndarray:
        """``L`` with ``L L^T = Sigma``, (hi - lo, k, k), from the symmetric eigendecomposition
        (works for singular, positive semi-definite matrices where Cholesky does not)."""
        if self.kind.startswith("std") or self.kind == "diag_stack":
            s = self._std_of(lo, hi)
            eye = np.eye(self.k)
            return np.broadcast_to(eye * np.atleast_2d(s)[:, None, :], (hi - lo, self.k, self.k))
        if self.kind == "shared":
            if not hasattr(self, "_shared_factor"):
                self._shared_factor = _sqrt_psd(_sym(self.data)[None])[0]
            return np.broadcast_to(self._shared_factor, (hi - lo, self.k, self.k))
        return _sqrt_psd(_sym(np.asarray(self.data[lo:hi], np.float64)))

    def folds(self, width: int) -> bool:
        """Whether a shared ``Sigma`` is cheaper sandwiched through a linear head of ``width``
        values (:func:`_folded`): ``m w^2 / 2`` a row (its Cholesky factor) against ``m k^2 / 2``
        (dense) or ``m k r`` (of rank ``r``, through its factor)."""
        if self.kind != "shared":
            return False
        low = getattr(self, "_low", None)
        work = self.k * self.k / 2 if low is None else self.k * low.shape[1]
        return width * width / 2 < work

    def _cholesky(self, dtype: np.dtype) -> np.ndarray | None:
        """A shared dense ``Sigma``'s Cholesky factor ``L`` (lower, ``L L^T = Sigma``) in
        ``dtype``, made once; None where ``Sigma`` is singular (positive semi-definite: the
        full product then). ``J Sigma J^T = (J L)(J L)^T``, and ``J L`` is a triangular product:
        half the multiply-adds of ``J Sigma`` (docs/thresholds.md, "J Sigma J^T through Sigma's
        Cholesky factor")."""
        made: tuple[np.ndarray | None] | None = getattr(self, "_chol", None)
        if made is None:
            try:
                made = (np.linalg.cholesky(_sym(np.asarray(self.data, np.float64))),)
            except np.linalg.LinAlgError:
                made = (None,)
            self._chol = made
        low = made[0]
        return None if low is None else low.astype(dtype, copy=False)

    def sandwich(self, a: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """``A Sigma A^T`` for ``A`` (hi - lo, m, k)."""
        if self.kind.startswith("std") or self.kind == "diag_stack":
            s = self._std_of(lo, hi)
            b = a * (s if s.ndim == 1 else s[:, None, :])
            return b @ b.transpose(0, 2, 1)
        low = getattr(self, "_low", None)
        if low is not None:
            b = _times(a, low)
            return b @ b.transpose(0, 2, 1)
        if self.kind == "shared":  # (in the Jacobians' dtype: float32 J, float32 products)
            chol = self._cholesky(a.dtype)
            sigma = None if chol is not None else _sym(self.data).astype(a.dtype, copy=False)
            out = np.empty((a.shape[0], a.shape[1], a.shape[1]))
            # (J L a slice at a time, in one buffer the triangular product overwrites)
            buf = None if chol is None else np.empty((min(a.shape[0], SANDWICH_ROWS), *a.shape[1:]),
                                                     chol.dtype)
            for i in range(0, a.shape[0], SANDWICH_ROWS):  # (J Sigma a slice at a time)
                part = a[i:i + SANDWICH_ROWS]
                if sigma is not None:
                    out[i:i + SANDWICH_ROWS] = _times(part, sigma) @ part.transpose(0, 2, 1)
                else:
                    assert chol is not None
                    assert buf is not None
                    b = _times_lower(part, chol, buf[:len(part)])
                    out[i:i + SANDWICH_ROWS] = b @ b.transpose(0, 2, 1)
            return _sym(out)
        sigma = _sym(np.asarray(self.data[lo:hi], np.float64))
        return _sym(a @ sigma @ a.transpose(0, 2, 1))


#: the most bytes a chunk of the linear method takes (its Jacobians and what it keeps beside
#: them), below the memory budget: the Jacobians are reduced chunk by chunk, so larger chunks
#: gain little and the peak stays below the size of all the Jacobians (docs/thresholds.md)
LINEAR_BUDGET = 512 << 20

#: instances whose ``J Sigma`` is formed at once (the rest of the chunk's J waits): the
#: product's temporary stays a slice of the chunk's Jacobians, not their size again
SANDWICH_ROWS = 1024


def _times(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for a stack ``a`` (n, m, k) and one matrix ``b`` (k, r), as one matrix product
    of ``n m`` rows: numpy's stacked ``@`` calls BLAS once per instance, several times slower
    for W2's (10, 784) rows against a shared (784, 784) covariance."""
    n, m, k = a.shape
    return (np.ascontiguousarray(a).reshape(n * m, k) @ b).reshape(n, m, b.shape[1])


def _times_lower(a: np.ndarray, low: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """``a @ low`` for a stack ``a`` (n, m, k) and a lower-triangular ``low`` (k, k), as one
    triangular matrix product of BLAS (``trmm``: half the work of :func:`_times`), in ``buf``
    (C-ordered, ``a``'s shape): computed in place as ``(low^T buf^T)^T``, the transposed rows
    being the Fortran-ordered operand BLAS overwrites."""
    from scipy.linalg.blas import get_blas_funcs

    n, m, k = a.shape
    buf[...] = a
    flat = buf.reshape(n * m, k)
    trmm = get_blas_funcs("trmm", (low, flat))
    # (the result read from what trmm returns: buf itself where it could write in place)
    done = trmm(1.0, low, flat.T, side=0, lower=1, trans_a=1, overwrite_b=1)
    return np.asarray(done).T.reshape(n, m, k)


def _as_float(value: Any, name: str) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise InputError(f"`{name}` must hold real numbers; got dtype {arr.dtype}.")
    return arr


def _sym(a: np.ndarray) -> np.ndarray:
    return 0.5 * (a + np.swapaxes(a, -1, -2))


def _sqrt_psd(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh(a)
    return v * np.sqrt(np.maximum(w, 0.0))[:, None, :]


def _check_psd(c: np.ndarray, offset: int, *, shared: bool, eps: float) -> np.ndarray:
    """Finite, symmetric and positive semi-definite up to the rounding of the given dtype
    (machine epsilon ``eps``); otherwise say which instance is wrong and how. Returns the
    eigenvalues, ascending, ``(len(c), k)``."""
    what = "`cov`" if shared else "`cov[{i}]` (instance {i})"
    c = np.asarray(c, np.float64)
    finite = np.isfinite(c).reshape(len(c), -1).all(axis=1)
    if not finite.all():
        i = offset + int(np.argmin(finite))
        raise InputError(f"{what.format(i=i)} has a NaN or Inf entry; covariances must be finite.")
    k = c.shape[-1]
    size = np.maximum(np.abs(c).reshape(len(c), -1).max(axis=1), 1e-300)
    asym = np.abs(c - c.transpose(0, 2, 1)).reshape(len(c), -1).max(axis=1)
    bad = asym > max(1e-8, 100 * eps) * size
    if bad.any():
        j = int(np.argmax(bad))
        r, s = np.unravel_index(int(np.argmax(np.abs(c[j] - c[j].T))), c[j].shape)
        count = "" if shared else f" ({int(bad.sum())} instance(s) in this block of 4096)"
        raise InputError(
            f"{what.format(i=offset + j)} is not symmetric: entry ({r}, {s}) is {c[j, r, s]:.6g} "
            f"but ({s}, {r}) is {c[j, s, r]:.6g}{count}. A covariance matrix must be symmetric "
            f"positive semi-definite; symmetrise it with (C + C.T) / 2 if the difference is "
            f"rounding."
        )
    w = np.linalg.eigvalsh(_sym(c))
    low = w[:, 0] < -max(1e-10, 100 * k * eps) * np.maximum(np.abs(w).max(axis=1), 1e-300)
    if low.any():
        j = int(np.argmax(low))
        count = "" if shared else f" ({int(low.sum())} instance(s) in this block of 4096)"
        raise InputError(
            f"{what.format(i=offset + j)} is not positive semi-definite: its smallest eigenvalue "
            f"is {w[j, 0]:.3g} (largest {w[j, -1]:.3g}){count}. A covariance matrix must be "
            f"symmetric positive semi-definite; build it as A @ A.T, or from standard deviations "
            f"and a valid correlation matrix."
        )
    return w


def propagate(
    model: Any,
    mean: Any,
    known: Any = None,
    *,
    cov: Any = None,
    std: Any = None,
    method: Method = "linear",
    wrt: Any = None,
    n_samples: int = 10_000,
    seed: int = 0,
    alpha: float = 1.0,
    beta: float = 0.0,
    kappa: float | None = None,
    dtype: DTypeLike = None,
    mode: ModeArg = "auto",
    chunk_size: int | None = None,
    max_memory: int | str | None = None,
    out: tuple[Any, Any] | None = None,
    backend: str | None = None,
    backend_options: dict[str, Any] | None = None,
    order: int = 1,
    output: OutputArg = "auto",
) -> Propagation:
    """Per-instance output mean and covariance of ``model`` given uncertain unknowns.

    ``mean`` holds the unknowns' means; the inputs are given as for :func:`batchjac.jacobian`:
    ``propagate(model, x, cov=...)`` (every feature uncertain), ``propagate(model, mean, known,
    cov=...)`` (the model takes ``concat([unknown, known], -1)``; the known part is exact), or
    ``propagate(model, x, wrt=[0, 2], cov=...)`` / ``propagate(model, {"x": X, "h": H},
    wrt="x", cov=...)``.

    The uncertainty of the ``k`` unknowns (flattened in C order) is one of:

    - ``cov``: a ``(k, k)`` covariance for every instance, or an ``(N, k, k)`` stack;
    - ``std``: standard deviations (independent unknowns), ``(k,)`` for every instance or
      ``(N, k)``; a scalar is the same for every unknown.

    A separate ``std`` argument, rather than guessing from ``cov``'s shape, keeps ``(k, k)``
    and ``(N, k)`` apart when ``N == k``. Covariances must be symmetric positive semi-definite
    (checked; the error names the instance).

    Methods (inputs are taken as Gaussian for the last two):

    - ``"linear"``: ``mean = f(mu)``, ``cov = J Sigma J^T`` (exact for a linear model);
    - ``"unscented"``: the ``2 k + 1`` sigma points ``mu`` and ``mu +- sqrt(k + lambda) L_j``
      (``L L^T = Sigma``, ``L_j`` its columns), ``lambda = alpha^2 (k + kappa) - k``, with the
      weights of Wan & van der Merwe: ``W0m = lambda / (k + lambda)``, ``W0c = W0m + 1 -
      alpha^2 + beta``, ``Wi = 1 / (2 (k + lambda))``. The defaults ``alpha=1, beta=0,
      kappa=3 - k`` (``kappa=None``) are Julier & Uhlmann's original set: the points lie
      ``sqrt(3)`` standard deviations out whatever ``k``, and they match the Gaussian's
      fourth moment along each axis of ``L``: the mean is exact for any quadratic model, the
      covariance for sums of squares along those axes (products such as ``x0 x1`` need points
      off the axes; in general the axis fourth moment needs ``beta = 2 - alpha^2 (k + kappa) +
      alpha^2``). For ``k > 3`` the centre weights are negative, so a strongly curved output
      can get a covariance that is not PSD: its negative eigenvalues are then set to zero
      (the nearest PSD matrix; counted in ``clipped``, with a
      :class:`CovarianceClippedWarning`). The common ``alpha=1e-3, beta=2, kappa=0`` keeps
      the points close, but weights of ~1e6 amplify a float32 model's rounding error a
      million times: use it only in float64;
    - ``"monte_carlo"``: ``n_samples`` draws per instance from ``N(mu_i, Sigma_i)`` (seeded by
      ``seed`` and the instance index, so results do not depend on chunking), evaluated in
      batches of many instances and samples; the covariance is the unbiased sample covariance.

    Returns a :class:`Propagation` with ``mean`` ``(N, *output_shape)`` and ``cov`` ``(N, m,
    m)`` in float64 (``m`` = flattened output size). ``order=2`` (with ``method="linear"``)
    adds the second-order terms of Gaussian inputs, ``E[y_a] = f_a + 1/2 tr(H_a Sigma)`` and
    ``Cov += 1/2 tr(H_a Sigma H_b Sigma)``, from per-instance Hessians
    (:mod:`batchjac._propagate_second`; their order of differentiation is chosen as
    :func:`batchjac.hessian` with ``mode="auto"`` chooses it); its ``method`` reads
    "second_order". ``out=(mean_out, cov_out)``: writable
    arrays of those shapes (e.g. ``np.lib.format.open_memmap``) filled chunk by chunk.

    ``mean`` and ``cov`` of the result (and ``std``) have the kind and device of the inputs
    ``mean``/``known``, as :func:`batchjac.jacobian`'s result has (torch tensors in, torch
    tensors out on their device; ``output=`` asks for a kind; with ``out=`` they are those
    host arrays). The algebra runs on the host (covariances in float64, eigendecompositions,
    draws): the inputs are copied there once and the result back once.

    >>> import numpy as np, batchjac
    >>> from batchjac.examples import seed_model
    >>> model = seed_model("tensorflow")
    >>> rng = np.random.default_rng(0)
    >>> mu, known = rng.normal(size=(10, 5)).astype("f4"), rng.normal(size=(10, 3)).astype("f4")
    >>> res = batchjac.propagate(model, mu, known, std=0.01)
    >>> res.mean.shape, res.cov.shape
    ((10, 4), (10, 4, 4))
    """
    model = as_model(model)
    if method not in _METHODS:
        raise InputError(f"`method` must be one of {_METHODS}; got {method!r}.")
    if order not in (1, 2) or isinstance(order, bool):
        raise InputError(f"`order` must be 1 or 2; got {order!r}.")
    if order == 2 and method != "linear":
        raise InputError(f"`order=2` is the second-order refinement of method='linear'; got "
                         f"method={method!r} (the unscented and Monte Carlo methods have no order).")
    inputs = (mean,) if known is None else (mean, known)
    delivery = on_host(inputs, output, out=out)
    spec = normalize(inputs, wrt=wrt, dtype=dtype, nan_policy="raise")
    unc = _Uncertainty(cov, std, spec.n, spec.unknown_shape)
    kappa = _check_method_options(method, spec.k, n_samples=n_samples, alpha=alpha, kappa=kappa)
    name, bound = bind(model, spec, backend, backend_options)
    assert bound.output_shape is not None
    out_shape = tuple(bound.output_shape)
    m = output_size(bound)
    mean_out, cov_out = _outputs(out, (spec.n, *out_shape), (spec.n, m, m))
    sink = ArraySink({"cov": cov_out, "mean": mean_out})
    if order == 2:  # (its own module: the Hessians' pass, chunk by chunk into the same sink)
        from ._propagate_second import propagate_second

        try:
            propagate_second(bound, spec, unc, sink, m, mode="auto", chunk_size=chunk_size,
                             max_memory=max_memory)
        except BatchJacError as e:
            raise add_context(e, context(spec, name)) from e
        return Propagation(mean=deliver(mean_out, delivery), cov=deliver(cov_out, delivery),
                           method="second_order", output_shape=out_shape, sigma_form=unc.form)
    clipped = [0]  # unscented: instances whose covariance was projected onto the PSD cone
    try:
        if method == "linear":
            # (a mode asked for: computed or refused, reduce_jacobians)
            _linear(bound, spec, name, unc, sink, m, mode=mode, chunk_size=chunk_size,
                    max_memory=max_memory)
        else:
            evaluator = Evaluator(bound, _block(spec, m, method, n_samples, max_memory))
            for lo, hi in _instance_chunks(spec, m, chunk_size, max_memory):
                if method == "unscented":
                    y, c = _unscented(evaluator, spec, unc, lo, hi, alpha, beta, kappa, clipped)
                else:
                    y, c = _monte_carlo(evaluator, spec, unc, lo, hi, n_samples, seed)
                sink.write(lo, hi, {"cov": c, "mean": y.reshape(hi - lo, *out_shape)})
    except BatchJacError as e:
        raise add_context(e, context(spec, name)) from e
    if clipped[0]:
        _warn_clipped(clipped[0], spec, alpha=alpha, beta=beta, kappa=kappa)
    return Propagation(mean=deliver(mean_out, delivery), cov=deliver(cov_out, delivery),
                       method=method, output_shape=out_shape,
                       n_samples=int(n_samples) if method == "monte_carlo" else None,
                       clipped=clipped[0], sigma_form=unc.form)


def _check_method_options(method: str, k: int, *, n_samples: int, alpha: float,
                          kappa: float | None) -> float:
    """Check the options of ``method``; return ``kappa`` (its default ``3 - k`` filled in)."""
    if method == "monte_carlo" and (isinstance(n_samples, bool) or
                                    not isinstance(n_samples, (int, np.integer)) or n_samples < 2):
        raise InputError(f"`n_samples` must be an integer >= 2; got {n_samples!r}.")
    kappa = 3.0 - k if kappa is None else float(kappa)
    if method == "unscented":
        lam = alpha**2 * (k + kappa) - k
        if not alpha > 0 or not k + lam > 0:
            raise InputError(
                f"The unscented transform needs alpha > 0 and alpha^2 (k + kappa) > 0; got "
                f"alpha={alpha}, kappa={kappa} with k={k} unknowns."
            )
    return kappa


def _outputs(out: tuple[Any, Any] | None, mean_shape: tuple[int, ...],
             cov_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The arrays the results go into: the caller's ``out`` (checked), or new ones."""
    if out is None:
        return np.empty(mean_shape), np.empty(cov_shape)
    if not isinstance(out, tuple) or len(out) != 2:
        raise InputError("`out` must be a tuple (mean_out, cov_out) of writable arrays; "
                         f"got {type(out).__name__}.")
    check_out(out[0], mean_shape, "mean")
    check_out(out[1], cov_shape, "cov")
    return out


def _warn_clipped(clipped: int, spec: BatchSpec, *, alpha: float, beta: float,
                  kappa: float) -> None:
    """Say that ``clipped`` instances' covariances were projected onto the PSD cone."""
    warnings.warn(
        f"The unscented transform gave {clipped} of {spec.n} instances a covariance with "
        f"negative eigenvalues (its centre weight is negative: k={spec.k} unknowns, "
        f"alpha={alpha}, beta={beta}, kappa={kappa}); batchjac set them to zero, the "
        f"nearest valid covariance, which still understates a strongly curved output. "
        f"Use method='monte_carlo' for such outputs, or weights that are all >= 0 "
        f"(alpha=1 with kappa >= 0 and beta >= 0).",
        CovarianceClippedWarning, stacklevel=3,  # the caller of propagate()
    )


def _linear(bound: Any, spec: BatchSpec, backend: str, unc: _Uncertainty, sink: ArraySink,
            m: int, *, mode: ModeArg, chunk_size: int | None,
            max_memory: int | str | None) -> None:
    k = spec.k
    head = bound.linear_head() if mode == "auto" and unc.kind == "shared" and spec.n else None
    if head is not None and unc.folds(head.width):
        _folded(bound, spec, head, unc, sink, m, chunk_size=chunk_size, max_memory=max_memory)
        return
    # a row keeps its product with Sigma and its covariance, and its own Sigma where each
    # instance has one (a shared one is held once)
    kept = 2 * m * k + 2 * m * m + (k * k if unc.kind == "stack" else 0)

    def sandwiches(chunks: Iterator[tuple[int, int, Any, Any]], _: Any) -> None:
        for lo, hi, y, jac in chunks:
            assert y is not None
            a = np.asarray(jac).reshape(hi - lo, m, k)  # (a float32 J stays so for the products)
            sink.write(lo, hi, {"cov": unc.sandwich(a, lo, hi), "mean": y})

    reduce_jacobians(bound, spec, backend, mode=mode, chunk_size=chunk_size,
                     max_memory=min(budget(max_memory), LINEAR_BUDGET), with_outputs=True,
                     consume=sandwiches, extra_bytes_per_row=8 * kept)


def _folded(bound: Any, spec: BatchSpec, head: LinearHead, unc: _Uncertainty, sink: ArraySink,
            m: int, *, chunk_size: int | None, max_memory: int | str | None) -> None:
    """``J Sigma J^T`` through the model's linear head ``z = A x`` (:meth:`~batchjac._backends.
    BoundModel.linear_head`): ``J = J_z A``, so ``J Sigma J^T = J_z (A Sigma A^T) J_z^T``, with
    ``A Sigma A^T`` (``w x w``) formed once and ``J_z`` (``m x w``) per instance, in blocks of
    rows within the linear method's budget (the last block padded: one compiled shape)."""
    k, w = spec.k, head.width
    u0, c0 = spec.chunk(0, 1)
    a = head.matrix(u0, c0)
    folded = _Uncertainty(_sym(a @ _sym(unc.data) @ a.T), None, spec.n, (w,))
    per_row = bytes_per_row(w, m, in_elems(spec), spec.dtype.itemsize) + \
        8 * (2 * m * w + 2 * m * m)
    rows = chunk_size or max(1, min(budget(max_memory), LINEAR_BUDGET) // per_row)
    rows = min(rows, spec.n)
    for lo in range(0, spec.n, rows):
        hi = min(lo + rows, spec.n)
        u, ctx = pad_chunk(spec, lo, hi, rows)
        with model_call(f"rows {lo}:{hi}"):
            y, jz = head.jacobians(u, ctx)
        y, jz = np.asarray(y)[:hi - lo], np.asarray(jz)[:hi - lo]
        sink.write(lo, hi, {"cov": folded.sandwich(jz, lo, hi), "mean": y})
    unc.form = f"{unc.form}, folded through the model's linear head ({w} of {k} values)"


def _block(spec: BatchSpec, m: int, method: str, n_samples: int,
           max_memory: int | str | None) -> int:
    """Rows per forward call: whole instances' sigma points, or samples of one or more
    instances, up to the memory-derived block size."""
    cap = block_rows(spec, m, max_memory)
    per = 2 * spec.k + 1 if method == "unscented" else n_samples
    if per >= cap:
        return cap if method == "monte_carlo" else per
    return (cap // per) * per


def _instance_chunks(spec: BatchSpec, m: int, chunk_size: int | None,
                     max_memory: int | str | None) -> Iterator[tuple[int, int]]:
    """Ranges of instances whose statistics (covariances, factors) fit an eighth of the budget."""
    k = spec.k
    if chunk_size is None:
        per = 8 * (3 * m * m + 2 * k * k + 2 * (m + k))
        chunk_size = int(max(1, min(65536, budget(max_memory) // 8 // per)))
    for lo in range(0, spec.n, chunk_size):
        yield lo, min(lo + chunk_size, spec.n)


def _unscented(evaluator: Evaluator, spec: BatchSpec, unc: _Uncertainty, lo: int, hi: int,
               alpha: float, beta: float, kappa: float, clipped: list[int]
               ) -> tuple[np.ndarray, np.ndarray]:
    k = spec.k
    lam = alpha**2 * (k + kappa) - k
    c = k + lam
    wm = np.full(2 * k + 1, 1.0 / (2 * c))
    wm[0] = lam / c
    wc = wm.copy()
    wc[0] += 1.0 - alpha**2 + beta
    per = evaluator.block // (2 * k + 1) if evaluator.block >= 2 * k + 1 else 1
    ys, covs = [], []
    for a in range(lo, hi, per):
        b = min(a + per, hi)
        u, ctx = spec.chunk(a, b)
        mu = u.reshape(b - a, k).astype(np.float64)
        lf = np.sqrt(c) * unc.factor(a, b)  # columns are the sigma directions
        pts = np.empty((b - a, 2 * k + 1, k))
        pts[:, 0] = mu
        pts[:, 1:k + 1] = mu[:, None, :] + lf.transpose(0, 2, 1)
        pts[:, k + 1:] = mu[:, None, :] - lf.transpose(0, 2, 1)
        y = evaluator(pts.reshape(-1, *spec.unknown_shape).astype(spec.dtype),
                      repeat_rows(ctx, 2 * k + 1)).reshape(b - a, 2 * k + 1, -1)
        ybar = np.einsum("p,rpm->rm", wm, y)
        d = y - ybar[:, None, :]
        ys.append(ybar)
        if wc.min() >= 0:  # a sum of outer products with weights >= 0: PSD as it is
            covs.append((d * wc[None, :, None]).transpose(0, 2, 1) @ d)
        else:
            c_psd, bad = _psd_weighted_cov(d, wc)
            covs.append(c_psd)
            clipped[0] += int(bad.sum())
    return np.concatenate(ys), np.concatenate(covs)


def _psd_weighted_cov(d: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sum_p w_p d_p d_p^T`` per instance (``d``: ``(R, P, m)``) with its negative
    eigenvalues set to zero: the nearest PSD matrix in the Frobenius norm (Higham 1988), and
    which instances had any beyond rounding. The matrix is ``Q (R W R^T) Q^T`` with ``d^T =
    Q R`` (``P`` columns at most), so only a ``P x P`` eigenproblem per instance is solved,
    however many outputs there are."""
    q, r = np.linalg.qr(d.transpose(0, 2, 1))  # q (R, m, p), r (R, p, P), p = min(m, P)
    small = (r * w[None, None, :]) @ r.transpose(0, 2, 1)
    small = 0.5 * (small + small.transpose(0, 2, 1))
    lam, u = np.linalg.eigh(small)
    scale = np.abs(lam).max(axis=1, keepdims=True)
    bad = (lam < -1e-12 * scale).any(axis=1)
    v = q @ u
    return (v * np.clip(lam, 0.0, None)[:, None, :]) @ v.transpose(0, 2, 1), bad


def _monte_carlo(evaluator: Evaluator, spec: BatchSpec, unc: _Uncertainty, lo: int, hi: int,
                 n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    k = spec.k
    block = evaluator.block
    per = max(1, block // n)  # instances per forward batch (1 when n >= block)
    ys, covs = [], []
    for a in range(lo, hi, per):
        b = min(a + per, hi)
        u, ctx = spec.chunk(a, b)
        mu = u.reshape(b - a, k).astype(np.float64)
        lf = unc.factor(a, b)
        gens = [np.random.default_rng([seed, i]) for i in range(a, b)]
        step = n if per > 1 else block
        y = _draw(evaluator, spec, gens, mu, lf, ctx, min(step, n))
        shift = y[:, :1].copy()  # sums of deviations from one sample: no cancellation
        s1, s2 = np.zeros((b - a, y.shape[2])), np.zeros((b - a, y.shape[2], y.shape[2]))
        done = 0
        while True:
            d = y - shift
            s1 += d.sum(axis=1)
            s2 += d.transpose(0, 2, 1) @ d
            done += y.shape[1]
            if done >= n:
                break
            y = _draw(evaluator, spec, gens, mu, lf, ctx, min(step, n - done))
        mean_d = s1 / n
        ys.append(shift[:, 0] + mean_d)
        covs.append(_sym((s2 - n * mean_d[:, :, None] * mean_d[:, None, :]) / (n - 1)))
    return np.concatenate(ys), np.concatenate(covs)


def _draw(evaluator: Evaluator, spec: BatchSpec, gens: list[np.random.Generator], mu: np.ndarray,
          lf: np.ndarray, ctx: tuple[np.ndarray, ...], count: int) -> np.ndarray:
    """``count`` more samples of each instance's output, (r, count, m)."""
    z = np.stack([g.standard_normal((count, spec.k)) for g in gens])  # (r, count, k)
    x = mu[:, None, :] + z @ lf.transpose(0, 2, 1)
    return evaluator(x.reshape(-1, *spec.unknown_shape).astype(spec.dtype),
                     repeat_rows(ctx, count)).reshape(len(gens), count, -1)
