"""What every subcommand opens: its input files and its model.

- :class:`Files` opens input files of every format ``batchjac`` reads
  (:func:`batchjac._io.open_input`: .npy, .npz:key, .csv, .tsv, .parquet, .h5:/dataset, .zarr)
  as row readers, and closes them together when the command ends;
- :func:`gather_inputs` turns ``--inputs``/``--known``/``--wrt``/``--wrt-input`` into the
  positional inputs and ``wrt`` of the Python API;
- :func:`load_model` loads MODEL with :func:`batchjac._loaders.load_model`, which refuses
  model files that run code while loading unless ``--trust-model``;
- :func:`resolve_output` is where every subcommand that writes resolves its output path, and
  refuses, before anything is read or written, an output that would replace one of the
  command's own input files (even with ``--overwrite``) or whose name, or a name batchjac
  derives from it, is longer than the filesystem allows; :func:`refuse_existing` keeps a file
  that is not a finished batchjac output unless ``--overwrite`` (exit 6).

Readers go to the Python API as they are (it streams them by rows). Where an API function
needs a numpy array (``propagate``'s ``cov``/``std``), :meth:`Files.array` gives a memory map
of a ``.npy`` file and reads any other format whole.

numpy, the readers and the loaders are imported when a command calls these, not at import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
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


def model_path(ref: str) -> str | None:
    """The file or directory MODEL names (``file.py`` of ``file.py:attr``); None for a module."""
    if os.path.lexists(ref):
        return ref
    target = ref.rsplit(":", 1)[0] if ":" in ref else None
    return target if target is not None and target.endswith(".py") else None


def load_model(ref: str, *, trust: bool) -> LoadedModel:
    """MODEL as a :class:`batchjac._loaders.LoadedModel` (``.model``, ``.backend``,
    ``.fingerprint``). A model *file* that runs code while loading (a Keras ``Lambda`` layer, a
    pickled torch module) is refused unless ``trust`` (``--trust-model``): a command run on a
    file received from someone else must not run that someone's code."""
    from .._loaders import load_model as load

    if ":" not in ref and not Path(ref).suffix and os.sep not in ref and not Path(ref).exists():
        raise click.UsageError(f"MODEL must be 'module:attr' or 'path/to/file.py:attr', or a model "
                               f"file; got {ref!r}, which is no file and has no ':'.")
    path = model_path(ref)
    if path is not None and not os.path.isdir(path):
        from .._io import require_regular

        require_regular(path, "MODEL")  # a FIFO would block the loader's open()
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


# -- outputs ----------------------------------------------------------------------------------

#: the parameters of the subcommands whose values name files the command reads (MODEL, the
#: input files, number-or-file options such as --std and --lower, and @files of names)
READ_PARAMS = ("model", "inputs", "known", "targets", "x0", "cov", "std", "lower", "upper",
               "weights", "sigma", "jacobians", "outputs", "input_names", "output_names")


def _read_files(ctx: click.Context) -> list[tuple[str, str]]:
    """(option, path) of every existing file or directory the running command reads."""
    from .._io import split_key

    found = []
    for param in ctx.command.params:
        if param.name not in READ_PARAMS:
            continue
        value = ctx.params.get(param.name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        longs = [o for o in param.opts if o.startswith("--")]
        option = longs[0] if longs else param.human_readable_name
        for text in values:
            if not isinstance(text, str) or not text:
                continue
            if param.name == "model":
                path = model_path(text)
            elif text.startswith("@") and param.name in ("input_names", "output_names"):
                path = text[1:]
            else:
                path = split_key(text)[0]
            if path is not None and os.path.lexists(path):
                found.append((option, path))
    return found


def _same(a: str | Path, b: str | Path) -> bool:
    """Whether two paths are one file: the same inode (a hard link, a link, another spelling),
    or the same resolved path where one does not exist yet."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _within(inner: str | Path, outer: str | Path) -> bool:
    """Whether ``inner`` lies inside the directory ``outer``, as written or resolved."""
    return any(os.path.commonpath([i, o]) == o and i != o
               for i, o in ((os.path.abspath(inner), os.path.abspath(outer)),
                            (os.path.realpath(inner), os.path.realpath(outer))))


def _name_max(path: str) -> int:
    """The longest file name (bytes) the filesystem of ``path`` allows (``NAME_MAX``), read
    from its nearest existing ancestor."""
    probe = os.path.abspath(path)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return int(os.pathconf(probe, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


def _check_lengths(option: str, out: str, derived: str) -> None:
    """Refuse ``out`` when one of its names is longer than the filesystem allows, or its last
    name is once batchjac appends ``derived`` to it (the longest name it makes beside it)."""
    from .._errors import InputFileError

    limit = _name_max(out)
    parts = [p for p in Path(os.path.abspath(out)).parts[1:] if p not in ("", os.sep)]
    for i, part in enumerate(parts):
        size = len(os.fsencode(part))
        extra = len(os.fsencode(derived)) if i == len(parts) - 1 else 0
        if size + extra <= limit:
            continue
        shown = part if len(part) <= 40 else f"{part[:20]}...{part[-12:]}"
        beside = (f"; batchjac also writes names up to {extra} bytes longer beside it (its work "
                  f"directory {shown + derived.split('.removed-')[0]!r} and their temporaries), "
                  f"so it may be at most {limit - extra} bytes" if extra else "")
        raise InputFileError(
            f"{option} {out!r}: the name {shown!r} is {size} bytes, and this filesystem allows "
            f"{limit} bytes per name (NAME_MAX){beside}. Give {option} a shorter name.")


def resolve_output(option: str, out: str, *, replaces: Sequence[str | Path] = (),
                   derived: str = "") -> Path:
    """The output path ``out`` of the running command (``option`` names it in messages),
    checked before any input is read or anything is written; the one place every subcommand
    that writes resolves its output.

    ``replaces`` are the paths the command writes or replaces (the output, the files beside
    it, its work directory): none may be, or (a directory) hold, one of the files the command
    reads (MODEL, --inputs, --known, --cov...), compared by inode and resolved path, and
    ``--overwrite`` does not change that. ``out`` itself may not be an input either (a
    directory that ``propagate`` or ``report`` writes into may hold inputs beside the files it
    writes). ``derived`` is the longest suffix batchjac appends to the output's name for its
    own files (``.partial`` and the like): the name with it must fit the filesystem's
    ``NAME_MAX``, or the run would fail midway.
    """
    from .._errors import StoreExistsError

    _check_lengths(option, out, derived)
    reads = _read_files(click.get_current_context())
    for what, path in reads:
        if _same(path, out):
            raise StoreExistsError(
                f"{option} {out!r} is the {what} file {path!r}: writing the output there would "
                f"destroy the command's own input, and --overwrite does not allow that. Give "
                f"{option} another path.")
    for target in replaces:
        for what, path in reads:
            if _same(path, target) or _within(path, target):
                held = "is" if _same(path, target) else "holds"
                raise StoreExistsError(
                    f"{option} {out!r} would replace {os.fspath(target)!r}, which {held} the "
                    f"{what} file {path!r}: batchjac does not replace the command's own input, even "
                    f"with --overwrite. Give {option} another path, or move that input first.")
    return Path(out)


def store_paths(out: str, fmt: Any) -> list[Path]:
    """What a store at ``out`` of the format ``fmt`` occupies: its final paths (the output and
    the files beside it) and its work directory ``OUT.partial``."""
    from .._stores import WorkDir

    return [*fmt.final_paths(Path(out)), WorkDir(Path(out)).path]


def store_suffix() -> str:
    """The longest suffix a store appends to its output's name: the work directory
    ``OUT.partial``, renamed ``OUT.partial.removed-PID-NANOSECONDS`` when it is deleted
    (:meth:`batchjac._stores.WorkDir.remove`; a PID of up to 7 digits, 19 for the time)."""
    from .._stores.workdir import WORK_SUFFIX

    return f"{WORK_SUFFIX}.removed-{'9' * 7}-{'9' * 19}"


def refuse_existing(paths: Sequence[Path], *, option: str, overwrite: bool,
                    finished: Callable[[Path], bool] | None = None) -> None:
    """The rule of every output: something at one of ``paths`` that is not a finished batchjac
    output is kept (:class:`~batchjac._stores.StoreExistsError`, exit 6) unless ``overwrite``.
    ``finished`` tells a finished output (its manifest); without it, every existing file is
    kept (an output that records nothing cannot tell an earlier run's from another file)."""
    from .._stores import StoreExistsError

    for path in paths:
        if overwrite or not os.path.lexists(path) or (finished is not None and finished(path)):
            continue
        why = "and is not a finished batchjac output" if finished is not None else \
            "and batchjac cannot tell it from a file it did not write"
        raise StoreExistsError(f"The output {os.fspath(path)!r} exists {why}; choose another "
                               f"{option}, or pass --overwrite to replace it.")
