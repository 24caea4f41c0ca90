"""The manifest of a store: the job it records, how a job is recognised, and the digests.

A manifest is a JSON object: ``store_version``, ``complete``, ``job`` (what was computed:
model, versions, inputs, options; compared exactly on resume), ``probe`` (the model's outputs
on fixed inputs, compared with a tolerance), ``plan`` (``rows``, ``chunk_size``, ``chunks``
and whatever else fixes the result), ``arrays`` and, once complete, ``digests`` (the sha256
of every unit's input rows and of every unit's result, each digested in unit order).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._spec import BatchSpec
from .durable import load_json

STORE_VERSION = 1
#: rows of the model's outputs on fixed random inputs, recorded to recognise the model
PROBE_ROWS = 4
PROBE_VALUES = 64


def load_manifest(path: Path, follow: bool = True) -> dict[str, Any] | None:
    """The manifest in ``path``, or None; ``follow=False`` for work files: a link there is
    refused (StoreError), not read."""
    manifest = load_json(path, follow)
    return manifest if isinstance(manifest, dict) and "job" in manifest else None


def is_complete_manifest(manifest: Any) -> bool:
    return isinstance(manifest, dict) and manifest.get("complete") is True and "job" in manifest


# -- hashing ----------------------------------------------------------------------------------

def hash_arrays(arrays: Sequence[np.ndarray]) -> str:
    """The sha256 of arrays (dtype, shape and bytes of each, in order)."""
    sha = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        sha.update(f"{a.dtype.str}{a.shape}".encode())
        sha.update(a.view(np.uint8).reshape(-1).data if a.size else b"")
    return sha.hexdigest()


def digest(hashes: Sequence[str]) -> str:
    """One sha256 of the hashes of every unit, in unit order."""
    return hashlib.sha256("".join(hashes).encode()).hexdigest()


# -- the job --------------------------------------------------------------------------------

def jsonable(value: Any) -> Any:
    """Tuples as lists, numpy scalars as Python numbers, keys sorted: what a JSON round trip
    gives (so a manifest written fresh and one read back from disk serialise alike)."""
    return json.loads(json.dumps(value, default=_json_default, sort_keys=True))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.dtype):
        return obj.name
    return repr(obj)


def framework_version(backend: str) -> str:
    from .._backends import REGISTRY

    module = sys.modules.get(REGISTRY.get(backend, ("", backend, ""))[1])
    return f"{backend} {getattr(module, '__version__', '?')}"


def probe(bound: Any, spec: BatchSpec) -> dict[str, Any]:
    """The model's outputs on fixed random inputs (shapes and dtypes of this batch)."""
    rng = np.random.default_rng(20240611)
    u = rng.standard_normal((PROBE_ROWS, *spec.unknown_shape)).astype(spec.dtype)
    ctx = []
    for shape, dt in spec.ctx_specs():
        dt = np.dtype(dt)
        if dt.kind == "f":
            ctx.append(rng.standard_normal((PROBE_ROWS, *shape)).astype(dt))
        else:
            ctx.append(np.zeros((PROBE_ROWS, *shape), dt))
    y = np.asarray(bound.forward(u, tuple(ctx)), dtype=np.float64).reshape(-1)
    finite = y[np.isfinite(y)]
    # non-finite values as None: JSON (and Zarr attributes) have no NaN
    return {"values": [float(v) if np.isfinite(v) else None for v in y[:PROBE_VALUES]],
            "abs_sum": float(np.abs(finite).sum()), "size": int(y.size)}


def same_probe(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.get("size") != b.get("size") or len(a.get("values", ())) != len(b.get("values", ())):
        return False
    va = np.array([np.nan if v is None else v for v in a["values"]], np.float64)
    vb = np.array([np.nan if v is None else v for v in b["values"]], np.float64)
    if not np.array_equal(np.isfinite(va), np.isfinite(vb)):
        return False
    scale = max(float(np.abs(va[np.isfinite(va)]).max()) if np.isfinite(va).any() else 0.0, 1e-30)
    close = np.allclose(va[np.isfinite(va)], vb[np.isfinite(vb)], rtol=1e-4, atol=1e-5 * scale)
    sa, sb = float(a["abs_sum"]), float(b["abs_sum"])
    return bool(close and abs(sa - sb) <= 1e-4 * max(abs(sa), abs(sb), 1e-30))


def difference(stored: Any, now: Any, path: str = "") -> str | None:
    """The first leaf where two JSON values differ, as 'path: stored X, now Y'."""
    if isinstance(stored, dict) and isinstance(now, dict):
        for key in sorted(set(stored) | set(now)):
            found = difference(stored.get(key), now.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(stored, list) and isinstance(now, list) and len(stored) == len(now):
        for i, (s, n) in enumerate(zip(stored, now)):
            found = difference(s, n, f"{path}[{i}]")
            if found:
                return found
        return None
    if stored != now:
        show = [v if len(repr(v)) < 80 else repr(v)[:77] + "..." for v in (stored, now)]
        return f"{path}: the store has {show[0]!r}, this call {show[1]!r}"
    return None


def job_problem(stored: dict[str, Any], job: dict[str, Any], probe: dict[str, Any] | None
                ) -> str | None:
    """Why the manifest ``stored`` is not of the job ``job`` whose probe is ``probe`` (None
    when it is; a job without a probe is recognised by its description alone)."""
    if stored.get("store_version") != STORE_VERSION:
        return f"store format version {stored.get('store_version')!r}, this batchjac writes {STORE_VERSION}"
    diff = difference(stored.get("job"), job)
    if diff is not None:
        return diff
    if probe is not None and not same_probe(stored.get("probe", {}), probe):
        return ("the model's outputs on fixed probe inputs differ from those recorded: it is not "
                "the model the store was made with")
    return None
