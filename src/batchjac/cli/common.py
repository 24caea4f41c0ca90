"""What every subcommand opens: its input files and its model.

- :class:`Files` opens input files of every format ``batchjac`` reads
  (:func:`batchjac._io.open_input`: .npy, .npz:key, .csv, .tsv, .parquet, .h5:/dataset, .zarr)
  as row readers, and closes them together when the command ends;
- :func:`gather_inputs` turns ``--inputs``/``--known``/``--wrt``/``--wrt-input`` into the
  positional inputs and ``wrt`` of the Python API;
- :func:`load_model` loads MODEL with :func:`batchjac._loaders.load_model`, which refuses
  model files that run code while loading unless ``--trust-model``.

Readers go to the Python API as they are (it streams them by rows). Where an API function
needs a numpy array (``propagate``'s ``cov``/``std``), :meth:`Files.array` gives a memory map
of a ``.npy`` file and reads any other format whole.

numpy, the readers and the loaders are imported when a command calls these, not at import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from .options import INPUT_FORMATS, parse_numbers, parse_wrt

if TYPE_CHECKING:
    from .._jacobian import BackendName
    from .._loaders import LoadedModel


class Files:
    """The input files a command opened (``with Files() as files``), closed together."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._open:
            self._open.pop().close()

    def open(self, ref: str, what: str) -> Any:
        """A row reader of the file ``ref`` (``what`` names the option in messages)."""
        from .._io import open_input

        reader = open_input(ref, what=what)
        self._open.append(reader)
        return reader

    def array(self, ref: str, what: str) -> Any:
        """The file as a numpy array, for API arguments that take arrays: a C-ordered ``.npy``
        (or stored ``.npz`` member) is memory-mapped, any other format is read whole."""
        import numpy as np

        from .._io import RawReader

        reader = self.open(ref, what)
        if isinstance(reader, RawReader) and reader.shape[0] and reader.row_bytes:
            # the map keeps the file's data even when a temporary file is deleted on close
            return np.memmap(reader.path, dtype=reader.dtype, mode="r", offset=reader.offset,
                             shape=reader.shape)
        return np.asarray(reader)

    def value(self, text: str | None, what: str) -> Any:
        """None, a number, or a file opened for reading rows."""
        if text is None:
            return None
        numbers = parse_numbers(text)
        if numbers is not None and len(numbers) == 1:
            return numbers[0]
        if numbers is not None:
            raise click.BadParameter(f"{text!r} is a list of numbers; give one number (for every "
                                     f"unknown) or a file with the values.", param_hint=what)
        require_file(text, what, "a number")
        return self.open(text, what)


def require_file(text: str, what: str, alternative: str) -> None:
    """A usage error when ``text`` is neither ``alternative`` nor something that names a file
    (it exists, or has a suffix or a directory part: a missing one is then reported as a
    missing file, exit 3)."""
    from .._io import split_key

    path = split_key(text)[0]
    if Path(path).suffix or os.sep in path or Path(path).exists():
        return
    raise click.UsageError(f"{what} must be {alternative} or a file ({INPUT_FORMATS}); got "
                           f"{text!r}, which is neither (no such file, and no suffix).")


def gather_inputs(files: Files, inputs: Sequence[str], *, known: str | None, wrt: str | None,
                  wrt_input: int | None = None) -> tuple[tuple[Any, ...], Any]:
    """The positional inputs and ``wrt`` of :func:`batchjac.jacobian` from the options: one
    file (``wrt`` its unknown columns), ``--inputs`` with ``--known`` (``concat([u, h])``), or
    several ``--inputs`` (a multi-input model; ``--wrt-input`` says which holds the unknowns)."""
    if not inputs:
        raise click.UsageError(f"Missing option --inputs: give the model's inputs, e.g. --inputs "
                               f"FILE.npy (formats: {INPUT_FORMATS}).")
    if known is not None and (len(inputs) != 1 or wrt is not None or wrt_input is not None):
        raise click.UsageError("--known goes with one --inputs file and no --wrt or --wrt-input: "
                               "with --known every column of --inputs is unknown (the model takes "
                               "concat([inputs, known], -1)); use --known or --wrt, not both.")
    if wrt_input is not None and not -len(inputs) <= wrt_input < len(inputs):
        raise click.BadParameter(f"{wrt_input} is out of range: there are {len(inputs)} --inputs "
                                 f"files (0..{len(inputs) - 1}).", param_hint="--wrt-input")
    columns = parse_wrt(wrt) if wrt is not None else None  # usage errors before opening files
    readers = [files.open(path, "--inputs") for path in inputs]
    if known is not None:
        from .._errors import InputError

        h = files.open(known, "--known")
        if len(h) != len(readers[0]):
            raise InputError(f"--known {known!r} has {len(h)} rows but --inputs {inputs[0]!r} has "
                             f"{len(readers[0])}; they must have one row per instance.")
        return (readers[0], h), None
    if len(readers) == 1:
        return (readers[0],), columns
    if wrt_input is None:
        raise click.UsageError(f"With {len(readers)} --inputs files, say which holds the unknowns "
                               f"with --wrt-input INDEX (0..{len(readers) - 1}).")
    return (tuple(readers),), (wrt_input if columns is None else (wrt_input, columns))


def load_model(ref: str, *, trust: bool) -> LoadedModel:
    """MODEL as a :class:`batchjac._loaders.LoadedModel` (``.model``, ``.backend``,
    ``.fingerprint``). A model *file* that runs code while loading (a Keras ``Lambda`` layer, a
    pickled torch module) is refused unless ``trust`` (``--trust-model``): a command run on a
    file received from someone else must not run that someone's code."""
    from .._loaders import load_model as load

    if ":" not in ref and not Path(ref).suffix and os.sep not in ref and not Path(ref).exists():
        raise click.UsageError(f"MODEL must be 'module:attr' or 'path/to/file.py:attr', or a model "
                               f"file; got {ref!r}, which is no file and has no ':'.")
    return load(ref, trust=trust)


def backend_of(option: str | None, loaded: LoadedModel) -> BackendName | None:
    """``--backend`` if given, else the framework of the model file (None: detect it from the
    model object)."""
    return cast("BackendName | None", option or loaded.backend)


@contextlib.contextmanager
def writing_output(what: str) -> Iterator[None]:
    """An OSError while writing a command's results (disk full, permissions) becomes a
    :class:`batchjac._stores.StoreWriteError` naming ``what``: exit 7, not a traceback."""
    try:
        yield
    except OSError as e:
        from .._stores import StoreWriteError

        raise StoreWriteError(f"Writing the results into {what} failed: {e.strerror or e}; fix "
                              f"that (disk space, permissions) and run the same command again.",
                              e.errno) from e
