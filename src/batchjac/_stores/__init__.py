"""Resumable stores: results written unit by unit (chunks of rows) to ``.npy``, HDF5 or Zarr,
crash-safe and resumable. ``jacobian(model, ..., out="jac.zarr")`` (and ``batchjac compute``)
write Jacobian stores (:mod:`.jacobians`); ``batchjac solve --out`` writes solution stores
(:mod:`batchjac._solve_store`). The guarantees, for both:

- **Nothing half-done is visible under the output's name.** Work happens in a sibling directory
  ``OUT.partial/``; the finished output is moved to ``OUT`` in one rename (the commit point),
  so an ``OUT`` that exists is complete, and it carries its manifest (``complete: true``).
- **A kill at any moment loses at most the units in flight.** Each unit's data is written
  and fsynced first, then the unit is recorded as done by a small record in
  ``OUT.partial/done/`` written to a temporary file, fsynced and renamed into place (atomic).
  One record per unit, rather than one manifest rewritten per unit, keeps the cost per unit
  constant and lets several writers (Dask workers) record units without a lock.
- **Same command, same bytes.** Unit boundaries and everything else that fixes the result
  (for Jacobians: the mode, the chunk size and the kernel, the backend's first
  implementation, XLA for TensorFlow, never chosen by timing) are fixed when the store is
  created and read back when it is resumed, and the store's metadata holds no times. A run
  that was killed and resumed writes a store bitwise identical to one that was not.
- **Only the same job may resume.** The manifest records the job: the model's fingerprint
  (:mod:`batchjac._fingerprint`, or a file's hash from the command line), the batchjac and
  framework versions, the inputs' shapes, dtypes and column names, the layout and every option
  that changes the result. Each done unit also records the sha256 of the input rows it was
  computed from; a resumed run re-reads those rows and compares, before computing anything.
  (A hash of whole input files up front would cost a full extra read on every run; per-unit
  hashes cost nothing extra on a fresh run, check exactly the rows whose results are kept, and
  ignore rows not yet computed, which are read from the current inputs anyway.) The model's
  outputs on fixed probe inputs are recorded too and compared with a tolerance, which catches
  a changed model even where the fingerprint cannot see inside it. A different job is refused
  unless ``overwrite=True``.
- **Kept units are checked, and links are never followed.** Each done record also holds the
  sha256 of the unit's result as written; a resumed run reads every kept unit back and
  compares before trusting it (a unit changed on disk since is computed again, with a
  warning, so the finished output is still the one an uninterrupted run writes). Work files
  are opened without following symbolic links (``O_NOFOLLOW``, new files with ``O_EXCL``) and
  a resumed work directory must hold only regular files and directories: a link planted there
  would make the remaining units go into the file it points to, the kept units be read from
  it and the finished output be that link. Such a store is refused (``overwrite=True``
  discards it: the links are removed, never what they point to).

The modules, one concept each:

- :mod:`.api`: Store, StoreResult and the readers of finished Jacobian stores;
- :mod:`.arrays`: the arrays a store holds (per-instance specs, storage chunks);
- :mod:`.formats`: the Format protocol and the formats (.npy, directory of .npy, Zarr, HDF5);
- :mod:`.durable`: fsync, atomic writes, work files opened without following links;
- :mod:`.npy`: the .npy work files;
- :mod:`.workdir`: ``OUT.partial/``: lock, marker, done records, sweeping, vetting;
- :mod:`.manifest`: the job a store records, how it is recognised, hashes and digests;
- :mod:`.resume`: the resume protocol every kind of store runs;
- :mod:`.units`: computing units and saving each one (the local loop, the one ``save_chunk``);
- :mod:`.jacobians`: the Jacobian store (``compute_to_store``);
- :mod:`.hessians`: the second-order store (``second_to_store``: Hessians, their diagonal,
  the Laplacian, Hessian-vector products);
- :mod:`.progress`: the progress bar.
"""

from .._errors import (
    StoreBusyError as StoreBusyError,
    StoreError as StoreError,
    StoreExistsError as StoreExistsError,
    StoreMismatchError as StoreMismatchError,
    StoreRecomputeWarning as StoreRecomputeWarning,
    StoreWriteError as StoreWriteError,
)
from .api import (
    FORMATS as FORMATS,
    Store as Store,
    StoreResult as StoreResult,
    as_store as as_store,
    format_of as format_of,
    is_store_target as is_store_target,
    open_store as open_store,
    read_manifest as read_manifest,
    store_format as store_format,
)
from .arrays import (
    STORAGE_CHUNK_BYTES as STORAGE_CHUNK_BYTES,
    ArrayInfo as ArrayInfo,
    ArraySpec as ArraySpec,
    dims as dims,
    storage_rows as storage_rows,
)
from .formats import (
    ChunkWriter as ChunkWriter,
    Format as Format,
    HDF5Format as HDF5Format,
    NpyDirFormat as NpyDirFormat,
    NpyFormat as NpyFormat,
    ZarrFormat as ZarrFormat,
)
from .jacobians import compute_to_store as compute_to_store
from .manifest import (
    framework_version as framework_version,
    hash_arrays as hash_arrays,
    jsonable as jsonable,
    probe as probe,
)
from .progress import progress_bar as progress_bar
from .resume import Job as Job, Outcome as Outcome, Target as Target, run as run
from .units import (
    Pending as Pending,
    Unit as Unit,
    UnitFunction as UnitFunction,
    Wording as Wording,
    save_chunk as save_chunk,
    save_chunk_at as save_chunk_at,
)
from .workdir import WorkDir as WorkDir
