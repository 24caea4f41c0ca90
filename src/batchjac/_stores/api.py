"""The public face of the Jacobian stores: :class:`Store` (where and how to write),
:class:`StoreResult` (what was written), and readers of finished stores."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._io import InputFileError
from .formats import Format, HDF5Format, NpyFormat, ZarrFormat

FORMAT_SUFFIXES = {".npy": "npy", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".he5": "hdf5",
                   ".zarr": "zarr"}
#: the names of a Jacobian store's arrays: the Jacobians, and the model's outputs when asked for
JACOBIANS, OUTPUTS = "jacobians", "outputs"
#: the formats of Jacobian stores, by name (``.npy``: the Jacobians in the file itself, the
#: outputs beside it)
FORMATS: dict[str, Format] = {"npy": NpyFormat(JACOBIANS, (OUTPUTS,)), "zarr": ZarrFormat(),
                              "hdf5": HDF5Format()}


@dataclass(frozen=True)
class Store:
    """Where and how to write a resumable result: ``jacobian(..., out=Store("jac.zarr"))``.

    ``out="jac.zarr"`` is short for ``out=Store("jac.zarr")``. ``overwrite`` replaces an
    output (or unfinished store) of a *different* job; an unfinished store of the same job is
    always resumed. ``model_id`` replaces the model's fingerprint (the command line passes the
    model file's hash). ``unknown_names``/``output_names`` label the columns in the metadata
    (by default the unknowns take the input file's column names, when it has any).
    """

    path: str | os.PathLike[str]
    overwrite: bool = False
    model_id: str | None = None
    unknown_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None


@dataclass(frozen=True)
class StoreResult:
    """What ``jacobian(..., out=path)`` returns: where the result is and how it was made."""

    path: str
    format: str
    rows: int
    mode: str
    chunk_size: int
    chunks: int
    computed_chunks: int
    resumed_chunks: int
    seconds: float
    shape: tuple[int, ...]
    outputs_shape: tuple[int, ...] | None

    def open(self, name: str = JACOBIANS) -> Any:
        """The stored array, read-only and lazy (``np.memmap``, h5py dataset or Zarr array)."""
        return open_store(self.path, name)

    def summary(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rows_per_second"] = self.rows / self.seconds if self.seconds > 0 else None
        return data


def is_store_target(out: Any) -> bool:
    return isinstance(out, (str, os.PathLike, Store))


def as_store(out: Any) -> Store:
    return out if isinstance(out, Store) else Store(out)


def format_of(path: str | os.PathLike[str]) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMAT_SUFFIXES:
        raise InputFileError(
            f"Unknown output format {suffix or '(no suffix)'!r} for {os.fspath(path)!r}; batchjac "
            f"writes .npy, .h5/.hdf5 (HDF5) and .zarr (Zarr)."
        )
    return FORMAT_SUFFIXES[suffix]


def store_format(path: str | os.PathLike[str]) -> Format:
    """The format of the Jacobian store at ``path`` (by its suffix)."""
    return FORMATS[format_of(path)]


def open_store(path: str | os.PathLike[str], name: str = JACOBIANS) -> Any:
    """Open array ``name`` ("jacobians" or "outputs") of a finished store, read-only."""
    fmt = store_format(path)
    out = Path(path)
    if fmt.read_manifest(out) is None:
        raise InputFileError(f"{os.fspath(path)!r} is not a finished batchjac output.")
    return fmt.open(out, name)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a finished store, or None if ``path`` is not one."""
    return store_format(path).read_manifest(Path(path))
