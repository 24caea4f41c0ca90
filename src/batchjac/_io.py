"""Input files read by rows: ``.npy``, ``.npz`` (``file.npz:key``), ``.csv``/``.tsv``,
``.parquet``, HDF5 (``file.h5:/dataset``) and Zarr (``store.zarr`` or ``store.zarr:array``).

A :class:`Reader` looks like a read-only array to the rest of batchjac: ``shape``, ``dtype``,
``ndim``, ``len()`` and row slices ``reader[lo:hi]`` that read those rows only, so a batch is
streamed chunk by chunk and memory does not grow with the number of rows:

- ``.npy`` (and uncompressed ``.npz`` members) are read with positioned reads of the rows'
  bytes, not through a memory map, so pages read once do not pile up in resident memory;
- HDF5 and Zarr arrays are sliced by rows (their own chunked reads);
- Parquet is read by row groups (one row group in memory at a time);
- CSV/TSV text and compressed ``.npz`` members cannot be read at a row offset; they are
  converted once, in a streaming pass, to a binary temporary file (in ``$TMPDIR``, deleted on
  close or exit) which is then read like ``.npy``. That costs one pass and the disk size of the
  numeric data, never memory.

Column names (CSV/TSV header, Parquet schema, a ``columns`` attribute of an HDF5 dataset or a
Zarr array) are kept in :attr:`Reader.columns`, so ``wrt`` can name unknown columns. A CSV/TSV
file whose first row is all numbers has no header: that row is data, and the columns have no
names.

Only numpy is imported here; h5py, zarr and pyarrow are imported when a file of that kind is
opened (they come with ``pip install batchjac[io]``).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import stat
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import InputError, InputFileError as InputFileError, InputTypeError

NPY_SUFFIXES = (".npy",)
NPZ_SUFFIXES = (".npz",)
TEXT_SUFFIXES = {".csv": ",", ".tsv": "\t"}
PARQUET_SUFFIXES = (".parquet", ".pq")
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
ZARR_SUFFIXES = (".zarr",)

FORMATS_HELP = (".npy, .npz[:key], .csv, .tsv, .parquet, .h5/.hdf5[:/dataset] and .zarr[:array]")


class Reader:
    """A read-only, row-sliceable view of an array stored in a file."""

    #: lets batchjac recognise readers without importing this module
    __batchjac_reader__ = True
    #: whether ``dtype`` is the data's own (False for text: CSV numbers are parsed as float64,
    #: but that says nothing about the precision the user wants to compute in)
    carries_dtype = True
    #: what the file is to the caller (``--inputs``, ``--known``: messages name the option)
    what = "input"

    def __init__(self, source: str, shape: tuple[int, ...], dtype: np.dtype,
                 columns: tuple[str, ...] | None = None) -> None:
        self.source = source
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        if columns is not None and (len(self.shape) < 2 or len(columns) != self.shape[-1]):
            columns = None  # names that do not match the feature axis are not column names
        self.columns = columns

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.source!r} shape={self.shape} dtype={self.dtype}>"

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as a new, writable numpy array."""
        lo, hi = max(0, lo), min(hi, self.shape[0])
        if hi <= lo:
            return np.empty((0, *self.shape[1:]), self.dtype)
        try:
            out = self._read(lo, hi)
        except InputError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise InputFileError(f"Reading rows {lo}:{hi} of {self.source!r} failed: "
                                 f"{type(e).__name__}: {e}") from e
        return out

    def _read(self, lo: int, hi: int) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, key: Any) -> np.ndarray:
        rest: tuple[Any, ...] = ()
        if isinstance(key, tuple):
            key, rest = (key[0], key[1:]) if key else (slice(None), ())
        if key is Ellipsis:
            key, rest = slice(None), (Ellipsis, *rest)
        n = self.shape[0]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"row {int(key)} is out of range for {n} rows")
            row = self.read(i, i + 1)[0]
            return row[rest] if rest else row
        if isinstance(key, slice):
            lo, hi, step = key.indices(n)
            rows = self.read(lo, hi) if step == 1 else self._take(np.arange(lo, hi, step))
        else:
            idx = np.asarray(key)
            if idx.dtype == bool:
                idx = np.flatnonzero(idx)
            rows = self._take(np.where(idx < 0, idx + n, idx).astype(np.int64))
        return rows[(slice(None), *rest)] if rest else rows

    def _take(self, idx: np.ndarray) -> np.ndarray:
        """Rows at ``idx``: one read of the covering range when dense, else one read per row."""
        if idx.size == 0:
            return np.empty((0, *self.shape[1:]), self.dtype)
        lo, hi = int(idx.min()), int(idx.max()) + 1
        if hi - lo <= 4 * idx.size + 1024:
            return self.read(lo, hi)[idx - lo]
        return np.concatenate([self.read(int(i), int(i) + 1) for i in idx])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self.read(0, self.shape[0])
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def close(self) -> None:
        """Release the file (idempotent)."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawReader(Reader):
    """C-ordered rows at a byte offset of a file (``.npy`` data, stored ``.npz`` members, and
    the temporary files of converted text), read with positioned reads."""

    def __init__(self, source: str, path: str, offset: int, shape: tuple[int, ...], dtype: np.dtype,
                 columns: tuple[str, ...] | None = None, *, temporary: bool = False) -> None:
        super().__init__(source, shape, dtype, columns)
        self.path, self.offset, self.temporary = path, offset, temporary
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self._fd: int | None = os.open(path, os.O_RDONLY)
        if temporary:
            _TEMPORARY.add(path)

    def _read(self, lo: int, hi: int) -> np.ndarray:
        if self._fd is None:
            raise InputFileError(f"{self.source!r} was closed.")
        out = np.empty((hi - lo, *self.shape[1:]), self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        pos, start = 0, self.offset + lo * self.row_bytes
        while pos < len(view):
            got = os.preadv(self._fd, [view[pos:]], start + pos)
            if got == 0:
                raise InputFileError(
                    f"{self.source!r} is shorter than its header says ({self.shape[0]} rows): it "
                    f"ends inside row {lo + pos // max(self.row_bytes, 1)}. Is it truncated?")
            pos += got
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.temporary:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            _TEMPORARY.discard(self.path)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class MemmapReader(Reader):
    """Fortran-ordered ``.npy`` files: rows are strided, so they are read through a memory map
    whose pages are released after each read."""

    def __init__(self, source: str, path: str) -> None:
        self._arr = np.load(path, mmap_mode="r")
        super().__init__(source, self._arr.shape, self._arr.dtype)

    def _read(self, lo: int, hi: int) -> np.ndarray:
        out = np.array(self._arr[lo:hi], order="C")
        mm = getattr(self._arr, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            import mmap

            mm.madvise(mmap.MADV_DONTNEED)
        return out


class H5Reader(Reader):
    def __init__(self, source: str, file: Any, dataset: Any) -> None:
        self._file, self._ds = file, dataset
        super().__init__(source, dataset.shape, dataset.dtype, _names(dataset.attrs))

    def _read(self, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self._ds[lo:hi])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()


class ZarrReader(Reader):
    def __init__(self, source: str, array: Any) -> None:
        self._arr = array
        super().__init__(source, array.shape, np.dtype(array.dtype), _names(array.attrs))

    def _read(self, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self._arr[lo:hi])


class ParquetReader(Reader):
    """Numeric columns of a Parquet file as ``(N, columns)``; one row group in memory at a time."""

    def __init__(self, source: str, path: str) -> None:
        pq = _pyarrow("parquet").parquet
        self._file = pq.ParquetFile(path)
        schema = self._file.schema_arrow
        names = tuple(schema.names)
        dtypes = [_numeric_dtype(schema.field(i).type, name, source) for i, name in enumerate(names)]
        meta = self._file.metadata
        self._starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        dtype = np.result_type(*dtypes) if dtypes else np.dtype(np.float64)
        super().__init__(source, (int(meta.num_rows), len(names)), dtype, names)
        self._cache: tuple[int, np.ndarray] | None = None

    def _group(self, i: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != i:
            table = self._file.read_row_group(i)
            self._cache = (i, _table_to_numpy(table, self.dtype))
        return self._cache[1]

    def _read(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, *self.shape[1:]), self.dtype)
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        pos = lo
        for g in range(first, len(self._starts) - 1):
            start, end = int(self._starts[g]), int(self._starts[g + 1])
            if start >= hi:
                break
            a, b = max(pos, start), min(hi, end)
            if b > a:
                out[a - lo:b - lo] = self._group(g)[a - start:b - start]
                pos = b
        return out

    def close(self) -> None:
        self._cache = None
        with contextlib.suppress(Exception):
            self._file.close()


# -- opening --------------------------------------------------------------------------------

def split_key(ref: str | os.PathLike[str]) -> tuple[str, str | None]:
    """``"data.npz:x"`` → ``("data.npz", "x")``; a path that exists as given has no key."""
    text = os.fspath(ref)
    if os.path.exists(text) or ":" not in text:
        return text, None
    path, key = text.rsplit(":", 1)
    return path, (key or None)


#: what a file that is not a regular file is, by its ``stat`` mode (for messages)
_SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def require_regular(path: str | os.PathLike[str], what: str) -> None:
    """Refuse ``path`` (the ``what`` file) unless it is a regular file, a link to one included,
    before anything opens it: a FIFO blocks ``open()`` until a writer comes, and a device such
    as ``/dev/zero`` never ends (read whole, it ends in a MemoryError). A missing path is left
    to the caller (its own message)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _SPECIAL_FILES if test(mode)), "not a regular file")
    via = f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
    raise InputFileError(f"The {what} {os.fspath(path)!r} is {kind}{via}, not a regular file: "
                         f"batchjac reads its inputs from regular files only (a pipe or device "
                         f"would block or never end). Save the data to a file and give that.")


def open_input(ref: str | os.PathLike[str], *, what: str = "input") -> Reader:
    """Open an input file for reading by rows (see the module docstring for the formats);
    ``what`` names it in messages (the reader keeps it)."""
    reader = _open_input(ref, what)
    reader.what = what
    return reader


def _open_input(ref: str | os.PathLike[str], what: str) -> Reader:
    path, key = split_key(ref)
    source = os.fspath(ref)
    p = Path(path)
    suffix = p.suffix.lower()
    if not p.exists():
        raise InputFileError(f"The {what} file {path!r} does not exist.")
    if not p.is_dir():
        require_regular(path, what)
    is_zarr_dir = p.is_dir() and (suffix in ZARR_SUFFIXES or _looks_like_zarr(p))
    if p.is_dir() and not is_zarr_dir:
        raise InputFileError(f"The {what} {path!r} is a directory, not a Zarr store; batchjac reads "
                             f"{FORMATS_HELP}.")
    if not is_zarr_dir and not os.access(path, os.R_OK):
        raise InputFileError(f"The {what} file {path!r} is not readable (permission denied).")
    if key is not None and suffix not in (*NPZ_SUFFIXES, *HDF5_SUFFIXES) and not is_zarr_dir:
        raise InputFileError(f"{source!r}: a ':key' suffix selects an array of a .npz, HDF5 or Zarr "
                             f"file; {suffix or 'this file'} files hold one array.")
    try:
        if is_zarr_dir:
            return _open_zarr(source, path, key)
        if suffix in NPY_SUFFIXES:
            return _open_npy(source, path)
        if suffix in NPZ_SUFFIXES:
            return _open_npz(source, path, key)
        if suffix in TEXT_SUFFIXES:
            return _open_text(source, path, TEXT_SUFFIXES[suffix])
        if suffix in PARQUET_SUFFIXES:
            return ParquetReader(source, path)
        if suffix in HDF5_SUFFIXES:
            return _open_h5(source, path, key)
    except InputError:
        raise
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, RuntimeError) as e:
        kind = suffix or "Zarr"
        raise InputFileError(f"Cannot read the {what} file {path!r} as {kind}: "
                             f"{type(e).__name__}: {_first_line(e)}") from e
    raise InputFileError(f"Unknown {what} format {suffix or '(no suffix)'!r} for {path!r}; batchjac "
                         f"reads {FORMATS_HELP}.")


def _open_npy(source: str, path: str, base: int = 0, size: int | None = None) -> Reader:
    """The ``.npy`` data at byte ``base`` of ``path`` (a ``.npz`` member there: ``size`` its
    bytes; else the rest of the file)."""
    with open(path, "rb") as f:
        f.seek(base)
        shape, fortran, dtype, header_end = _npy_header(
            f, source, os.fstat(f.fileno()).st_size - base if size is None else size)
    if fortran and len(shape) > 1:
        if base:
            raise InputFileError(f"{source!r} is a Fortran-ordered array inside a .npz; save it "
                                 f"C-ordered (np.ascontiguousarray) or as a .npy file.")
        return MemmapReader(source, path)
    return RawReader(source, path, header_end, shape, dtype)


#: a row of more bytes than this is no real array: a corrupt header (it would overflow int64)
_MAX_ROW_BYTES = 1 << 60


def _npy_header(f: Any, source: str, size: int) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """Shape, order, dtype and the data's offset from a ``.npy`` header at the position of
    ``f``; ``size`` is the bytes from there to the end of the array's file (or member). A
    header whose shape is negative, absurd, or larger than the file is refused here, before
    anything is allocated or read."""
    fmt = np.lib.format
    start = f.tell()
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
    except ValueError as e:
        raise InputFileError(f"{source!r} is not a valid .npy file: {_first_line(e)}") from e
    if dtype.hasobject:
        raise InputTypeError(f"{source!r} holds Python objects (dtype {dtype}); batchjac reads "
                             f"numbers only: save a numeric array (np.asarray(x, dtype=float)).")
    shape = tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise InputFileError(f"{source!r} is not a valid .npy file: its header gives the shape "
                             f"{shape}, with a negative size. Is it corrupt? Save it again with "
                             f"np.save.")
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    header_end = f.tell()
    available = size - (header_end - start)
    if row_bytes > _MAX_ROW_BYTES or (shape and shape[0] * row_bytes > available):
        raise InputFileError(
            f"{source!r} is shorter than its header says: shape {shape} of {dtype} needs "
            f"{(shape[0] if shape else 1) * row_bytes:,} bytes, and the file holds "
            f"{max(available, 0):,} after its header. Is it truncated or corrupt?")
    return shape, bool(fortran), dtype, header_end


def _open_npz(source: str, path: str, key: str | None) -> Reader:
    with zipfile.ZipFile(path) as zf:
        names = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
        if key is None:
            if len(names) != 1:
                raise InputFileError(f"{path!r} holds {len(names)} arrays {names[:10]}; name one as "
                                     f"'{path}:{names[0] if names else 'key'}'.")
            key = names[0]
        if key not in names:
            raise InputFileError(f"{path!r} has no array {key!r}; it holds {names[:20]}.")
        info = zf.getinfo(key + ".npy")
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as f:  # the member's data follows its local header
                f.seek(info.header_offset)
                local = f.read(30)
                name_len = int.from_bytes(local[26:28], "little")
                extra_len = int.from_bytes(local[28:30], "little")
            return _open_npy(source, path, info.header_offset + 30 + name_len + extra_len,
                             info.file_size)
        with zf.open(info) as member:  # compressed: stream it into a temporary raw file
            shape, fortran, dtype, _ = _npy_header(member, source, info.file_size)
            if fortran and len(shape) > 1:
                raise InputFileError(f"{source!r} is Fortran-ordered inside a compressed .npz; save "
                                     f"it C-ordered or as .npy.")
            tmp = _temporary_file(".raw")
            with open(tmp, "wb") as out:
                while block := member.read(1 << 24):
                    out.write(block)
    return RawReader(source, tmp, 0, shape, dtype, temporary=True)


def _open_text(source: str, path: str, delimiter: str) -> Reader:
    """Parse CSV/TSV in a streaming pass into a float64 temporary file (see module docstring)."""
    pa = _pyarrow("csv")
    csv = pa.csv
    parse = csv.ParseOptions(delimiter=delimiter)
    reader = csv.open_csv(path, parse_options=parse,
                          read_options=csv.ReadOptions(block_size=1 << 22))
    names: tuple[str, ...] | None = tuple(reader.schema.names)
    assert names is not None
    if _is_data_row(names):  # no header: the first row is data, read it as such
        reader.close()
        reader = csv.open_csv(path, parse_options=parse, read_options=csv.ReadOptions(
            block_size=1 << 22, autogenerate_column_names=True))
        names = None
    for i, name in enumerate(reader.schema.names):
        _numeric_dtype(reader.schema.field(i).type, name, source)
    tmp = _temporary_file(".raw")
    rows = 0
    try:
        with open(tmp, "wb") as out:
            for batch in _batches(reader, source):
                block = _table_to_numpy(batch, np.dtype(np.float64), source=source)
                out.write(block.tobytes())
                rows += block.shape[0]
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    result = RawReader(source, tmp, 0, (rows, len(reader.schema.names)), np.dtype(np.float64),
                       names, temporary=True)
    result.carries_dtype = False
    return result


def _batches(reader: Any, source: str) -> Iterator[Any]:
    """The record batches of a streaming CSV reader. The column types come from the first
    block; a later value that is not a number (a text column further down) is invalid data,
    reported as such, not as an unreadable file."""
    pa = _pyarrow("csv")
    rows = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as e:
            text = _first_line(e)
            if "conversion error" not in text.lower():
                raise
            raise InputTypeError(
                f"{source!r} has a value that is not a number after row {rows} ({text}); "
                f"batchjac reads numeric columns only. Drop or encode that column first.") from e
        rows += batch.num_rows
        yield batch


def _is_data_row(fields: Sequence[str]) -> bool:
    """Whether the first row of a text file, read as its header, is a row of numbers (a file
    without a header). One exception: the header ``0,1,...,k-1`` that pandas writes for a frame
    made from an array is read as column names."""
    try:
        [float(f) for f in fields]
    except ValueError:
        return False
    if any("_" in f for f in fields):  # Python's float() reads "1_000"; a CSV parser does not
        return False
    return [f.strip() for f in fields] != [str(i) for i in range(len(fields))]


def _open_h5(source: str, path: str, key: str | None) -> Reader:
    h5py = _module("h5py", "HDF5")
    f = h5py.File(path, "r")
    try:
        if key is None:
            found: list[str] = []
            f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
            if len(found) != 1:
                raise InputFileError(f"{path!r} holds {len(found)} datasets {found[:10]}; name one as "
                                     f"'{path}:/{found[0] if found else 'dataset'}'.")
            key = found[0]
        obj = f.get(key)
        if not isinstance(obj, h5py.Dataset):
            what = "no object" if obj is None else "a group, not a dataset"
            raise InputFileError(f"{path!r} has {what} at {key!r}.")
        if obj.dtype.kind not in "fiub":
            raise InputTypeError(f"{source!r} has dtype {obj.dtype}; batchjac reads real numbers "
                                 f"only: store the numeric columns as their own dataset.")
        return H5Reader(source, f, obj)
    except BaseException:
        f.close()
        raise


def _open_zarr(source: str, path: str, key: str | None) -> Reader:
    zarr = _module("zarr", "Zarr")
    node = zarr.open(path, mode="r")
    if key is not None:
        if hasattr(node, "shape"):  # one array at the root: an array has no members to name
            raise InputFileError(f"The Zarr store {path!r} is one array, not a group: it has no "
                                 f"array {key!r}. Give it as {path!r}, without ':{key}'.")
        try:
            node = node[key.lstrip("/")]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            arrays = sorted(name for name, _ in node.arrays())
            raise InputFileError(f"The Zarr store {path!r} has no array {key!r}; it holds "
                                 f"{arrays[:20]}.") from e
    if not hasattr(node, "shape"):  # a group: take its only array
        arrays = sorted(name for name, _ in node.arrays())
        if len(arrays) != 1:
            raise InputFileError(f"The Zarr group {path!r} holds {len(arrays)} arrays {arrays[:10]}; "
                                 f"name one as '{path}:{arrays[0] if arrays else 'array'}'.")
        node = node[arrays[0]]
    if np.dtype(node.dtype).kind not in "fiub":
        raise InputTypeError(f"{source!r} has dtype {node.dtype}; batchjac reads real numbers "
                             f"only: store the numeric columns as their own array.")
    return ZarrReader(source, node)


# -- helpers --------------------------------------------------------------------------------

def _looks_like_zarr(p: Path) -> bool:
    return any((p / name).exists() for name in ("zarr.json", ".zarray", ".zgroup"))


def _names(attrs: Any) -> tuple[str, ...] | None:
    for key in ("columns", "column_names"):
        try:
            value = attrs.get(key)
        except Exception:  # attribute types h5py cannot read
            return None
        if value is not None:
            items = [v.decode() if isinstance(v, bytes) else str(v) for v in np.atleast_1d(value)]
            return tuple(items)
    return None


def _module(name: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise InputFileError(f"Reading {what} files needs {name}: {install_hint(name)}.") from None


def install_hint(name: str) -> str:
    """How to get the file-format package ``name``: the ``io`` extra, or, for zarr on Python
    3.10 (zarr 3 needs 3.11, and the extra leaves it out there), what to do instead."""
    import sys

    if name == "zarr" and sys.version_info < (3, 11):
        return (f"zarr 3 needs Python 3.11 or later and this is Python "
                f"{sys.version_info[0]}.{sys.version_info[1]}; use .h5 or .npy files, or "
                f"Python 3.11+ with pip install batchjac[io]")
    return "pip install batchjac[io]"


def _pyarrow(sub: str) -> Any:
    import importlib

    try:
        importlib.import_module(f"pyarrow.{sub}")
        return importlib.import_module("pyarrow")
    except ImportError:
        raise InputFileError("Reading CSV, TSV and Parquet files needs pyarrow: "
                             "pip install batchjac[io].") from None


def _numeric_dtype(typ: Any, name: str, source: str) -> np.dtype:
    import pyarrow as pa

    if pa.types.is_null(typ):  # an empty column: all missing
        return np.dtype(np.float64)
    if pa.types.is_boolean(typ):
        return np.dtype(np.float64)
    if pa.types.is_integer(typ) or pa.types.is_floating(typ):
        return np.dtype(typ.to_pandas_dtype())
    raise InputTypeError(  # invalid data (exit 4), not an unreadable file
        f"Column {name!r} of {source!r} is not numeric ({typ}); batchjac reads numeric columns only. "
        f"Drop or encode it first."
    )


def _table_to_numpy(table: Any, dtype: np.dtype, source: str = "") -> np.ndarray:
    """A table or record batch of numeric columns as ``(rows, columns)``; missing values → NaN."""
    out = np.empty((table.num_rows, table.num_columns), dtype)
    for j in range(table.num_columns):
        col = table.column(j)
        if hasattr(col, "combine_chunks"):
            col = col.combine_chunks()
        out[:, j] = col.to_numpy(zero_copy_only=False)
    return out


_TEMPORARY: set[str] = set()


def _temporary_file(suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix="batchjac-", suffix=suffix)
    os.close(fd)
    _TEMPORARY.add(path)
    return path


@atexit.register
def _remove_temporaries() -> None:
    for path in list(_TEMPORARY):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def is_reader(obj: Any) -> bool:
    return bool(getattr(type(obj), "__batchjac_reader__", False))


def column_indices(columns: Sequence[str] | None, wanted: Sequence[Any], name: str) -> list[int]:
    """Translate column names (and pass integer indices through) for ``wrt``."""
    out: list[int] = []
    for item in wanted:
        if isinstance(item, str):
            if columns is None:
                raise InputError(
                    f"`wrt` names column {item!r}, but `{name}` has no column names; give column "
                    f"indices instead (e.g. [0, 1, 4]).")
            if item not in columns:
                shown = list(columns[:20]) + (["..."] if len(columns) > 20 else [])
                raise InputError(f"`wrt` names column {item!r}, which `{name}` does not have; its "
                                 f"columns are {shown}.")
            out.append(columns.index(item))
        else:
            out.append(item)
    return out
