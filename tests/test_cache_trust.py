"""The tuning cache cannot be turned against its user: a directory someone else can write is
refused, nothing inside is followed through a link or opened when it is not a regular file,
every file must carry this cache's signature, and what a signed payload holds is still checked
before JAX's loader sees it. Each case is an attack or an accident seen in outside testing; a
planted file must never run code, block a call, delete or create a file outside the cache, or
change a result."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import stat
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac
from batchjac._errors import TuneCacheWarning
from batchjac._tune import cache as _tunecache
from batchjac._tune.cache import TuneCache, TuneKey

from .helpers import run_in_fresh_process

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX ownership, modes and FIFOs")
DECISION = {"mode": "forward", "timings": "fwd 1 ms, rev 2 ms"}


@pytest.fixture(autouse=True)
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache directory (not created yet), the cache on, nothing refused or warned."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(directory))
    monkeypatch.setenv("BATCHJAC_AUTOTUNE", os.environ.get("BATCHJAC_AUTOTUNE", "on"))
    monkeypatch.delenv("BATCHJAC_CACHE", raising=False)
    _tunecache._reset_warnings()
    yield directory
    _tunecache._reset_warnings()


def key(what: str = "mode") -> TuneKey:
    return TuneKey.make("sha256:model", "rows:float32:(5,)", what, 1000, framework="numpy")


def folder(cache: Path) -> Path:
    return cache / f"v{_tunecache.VERSION}"


@contextlib.contextmanager
def cache_warnings() -> Iterator[list[str]]:
    """The messages of the TuneCacheWarnings given inside the block."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    messages.extend(str(w.message) for w in caught if issubclass(w.category, TuneCacheWarning))


def returns_within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or a test failure where it has not returned in ``seconds`` (a
    blocked open of a FIFO would otherwise hang the suite)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    return result[0]


# -- a directory batchjac can trust, or none ------------------------------------------------------


@posix_only
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_directory_others_can_write_is_refused_once_and_the_cache_is_off(
        cache_env: Path, mode: int) -> None:
    cache = TuneCache(cache_env)
    cache.put(key(), DECISION)
    assert cache.get(key()) == DECISION
    cache_env.chmod(mode)
    with cache_warnings() as caught:
        found = cache.get(key())  # a decision that is there is not read
        cache.put(key("rows"), DECISION)  # nor is anything written
        blob = cache.get_bytes(key("blob"))
    assert found is None
    assert blob is None
    assert len(caught) == 1
    assert re.search(r"does not use the tuning cache in .*can be written by .*chmod go-w", caught[0])
    assert not cache.enabled
    assert not cache.path(key("rows")).exists()  # type: ignore[union-attr]
    assert not cache.has_payloads()


@posix_only
def test_a_group_writable_folder_inside_is_refused_too(cache_env: Path) -> None:
    cache = TuneCache(cache_env)
    cache.put(key(), DECISION)
    folder(cache_env).chmod(0o770)
    with pytest.warns(TuneCacheWarning, match=r"v2 can be written by its group \(mode 0770\)"):
        assert cache.get(key()) is None


@posix_only
@pytest.mark.skipif(os.name == "posix" and os.geteuid() != 0, reason="chown needs root")
def test_a_directory_another_user_owns_is_refused(cache_env: Path) -> None:
    cache = TuneCache(cache_env)
    cache.put(key(), DECISION)
    os.chown(cache_env, 65534, 65534)
    with pytest.warns(TuneCacheWarning, match=r"owned by user id 65534, not by you"):
        assert cache.get(key()) is None


@posix_only
@pytest.mark.skipif(os.name == "posix" and os.geteuid() != 0, reason="chown needs root")
def test_a_file_another_user_owns_is_not_read(cache_env: Path) -> None:
    cache = TuneCache(cache_env)
    cache.put(key(), DECISION)
    path = cache.path(key())
    assert path is not None
    os.chown(path, 65534, 65534)
    with pytest.warns(TuneCacheWarning, match=r"owned by user id 65534"):
        assert cache.get(key()) is None


@posix_only
def test_a_symlinked_directory_is_followed_only_to_a_directory_of_ones_own(
        cache_env: Path, tmp_path: Path) -> None:
    """A symlinked ``~/.cache`` is common: the link at the top is followed and its target
    checked; a shared target is refused like the directory itself."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    cache_env.symlink_to(real)
    cache = TuneCache(cache_env)
    cache.put(key(), DECISION)
    assert cache.get(key()) == DECISION
    real.chmod(0o777)
    with pytest.warns(TuneCacheWarning, match="can be written by"):
        assert cache.get(key()) is None


@posix_only
def test_a_symlinked_folder_never_deletes_or_creates_outside_the_cache(
        cache_env: Path, tmp_path: Path) -> None:
    """``v2`` planted as a link to another folder: eviction once removed that folder's
    ``*.bin`` files. ``v2/payloads`` planted as a dangling link: its target was created."""
    victims = tmp_path / "victims"
    victims.mkdir()
    for name in ("a.bin", "b.bin"):
        (victims / name).write_bytes(os.urandom(4096))
    cache_env.mkdir(mode=0o700)
    folder(cache_env).symlink_to(victims)
    cache = TuneCache(cache_env, max_payload_bytes=1)  # everything but the newest must go
    with cache_warnings() as caught:
        cache.put_bytes(key("a"), b"\x01" * 100)
        cache.put(key(), DECISION)
        found = cache.get(key())
    assert found is None
    assert len(caught) == 1
    assert "v2 is a symbolic link" in caught[0]
    assert sorted(p.name for p in victims.iterdir()) == ["a.bin", "b.bin"]

    _tunecache._reset_warnings()
    other = tmp_path / "other-cache"
    other.mkdir(mode=0o700)
    folder(other).mkdir(mode=0o700)
    target = tmp_path / "created-by-batchjac"
    (folder(other) / _tunecache.PAYLOADS_MARK).symlink_to(target)
    cache = TuneCache(other)
    with pytest.warns(TuneCacheWarning, match="cannot write its cache"):
        cache.put_bytes(key("a"), b"\x01" * 100)
    assert not target.exists()
    assert not os.path.lexists(target)
    assert not cache.has_payloads()  # a link is no mark


@posix_only
def test_a_symlinked_file_or_key_is_never_read(cache_env: Path, tmp_path: Path) -> None:
    cache = TuneCache(cache_env)
    cache.put(key("rows"), DECISION)
    path, elsewhere = cache.path(key()), tmp_path / "elsewhere.json"
    assert path is not None
    elsewhere.write_bytes(cache.path(key("rows")).read_bytes())  # type: ignore[union-attr]
    path.symlink_to(elsewhere)
    with pytest.warns(TuneCacheWarning, match=r"cannot read .*symbolic link"):
        assert cache.get(key()) is None
    # the signing key replaced by a link to a file whose bytes someone else chose
    signing = folder(cache_env) / _tunecache.KEY_FILE
    chosen = tmp_path / "chosen-key"
    chosen.write_bytes(b"k" * _tunecache.KEY_BYTES)
    signing.unlink()
    signing.symlink_to(chosen)
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match="no signing key"):
        assert cache.get(key("rows")) is None
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match=r"cannot write .*signing key"):
        cache.put(key("rows"), DECISION)
    assert chosen.read_bytes() == b"k" * _tunecache.KEY_BYTES


@posix_only
@pytest.mark.parametrize("where", ["decision", "payload", "key"])
def test_a_fifo_in_the_cache_never_blocks(cache_env: Path, where: str) -> None:
    cache = TuneCache(cache_env)
    cache.put(key("rows"), DECISION)
    path = {"decision": cache.path(key()), "payload": cache.blob_path(key()),
            "key": folder(cache_env) / _tunecache.KEY_FILE}[where]
    assert path is not None
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    read: Callable[[], Any] = {"payload": lambda: cache.get_bytes(key()),
                               "decision": lambda: cache.get(key()),
                               "key": lambda: cache.get(key("rows"))}[where]
    with pytest.warns(TuneCacheWarning, match="not a regular file|no signing key"):
        found = returns_within(10, read)
    assert found is None
    assert stat.S_ISFIFO(os.lstat(path).st_mode)  # left as it was


# -- only files this cache signed ----------------------------------------------------------------


def test_files_are_signed_with_a_private_key_made_on_the_first_write(cache_env: Path) -> None:
    cache = TuneCache(cache_env)
    cache.put(key(), DECISION)
    signing = folder(cache_env) / _tunecache.KEY_FILE
    assert len(signing.read_bytes()) == _tunecache.KEY_BYTES
    if os.name == "posix":
        assert stat.S_IMODE(signing.stat().st_mode) == 0o600
        assert stat.S_IMODE(cache_env.stat().st_mode) == 0o700
    document = json.loads(cache.path(key()).read_text())  # type: ignore[union-attr]
    assert re.fullmatch(r"[0-9a-f]{64}", document["mac"])
    # a file with its decision changed (any field), or its signature dropped, is a miss
    for change in ({"decision": {**DECISION, "mode": "reverse"}}, {"written": "yesterday"},
                   {"mac": None}):
        tampered = {**document, **change}
        cache.path(key()).write_text(json.dumps(tampered))  # type: ignore[union-attr]
        _tunecache._reset_warnings()
        with pytest.warns(TuneCacheWarning, match="signature does not match"):
            assert cache.get(key()) is None


def test_a_file_from_another_cache_is_not_read(cache_env: Path, tmp_path: Path) -> None:
    """A colleague's cache copied in (same versions, same machine kind): its files are signed
    with its own key, not this one's."""
    theirs = TuneCache(tmp_path / "theirs")
    theirs.put(key(), {**DECISION, "mode": "reverse"})
    theirs.put_bytes(key("blob"), b"\x07" * 64)
    mine = TuneCache(cache_env)
    mine.put(key("rows"), DECISION)  # (the folder and its key exist)
    for name in (theirs.path(key()), theirs.blob_path(key("blob"))):
        assert name is not None
        (folder(cache_env) / name.name).write_bytes(name.read_bytes())
    with cache_warnings() as caught:
        found = mine.get(key()), mine.get_bytes(key("blob"))
    assert found == (None, None)
    assert len(caught) == 1  # (one per process)
    assert "signature does not match" in caught[0]


def test_a_planted_probe_verdict_never_skips_the_row_interaction_probe(cache_env: Path) -> None:
    """A verdict for a model whose rows interact (a batch mean), planted under its key, once
    set ``probed`` and the model's Jacobians came back with exit 0."""
    common = """
        import json, numpy as np, jax.numpy as jnp, batchjac
        W = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
        def plain(x):
            return jnp.tanh(x @ W)
        def center(x):
            y = jnp.tanh(x @ W)
            return y - y.mean(0)
        x = np.random.default_rng(4).normal(size=(30, 4)).astype(np.float32)
    """
    common = textwrap.dedent(common)
    run_in_fresh_process(common + "batchjac.jacobian(plain, x)\n")
    verdicts = [p for p in folder(cache_env).glob("*.json")
                if json.loads(p.read_text())["key"]["what"] == "probes"]
    assert len(verdicts) == 1, "the plain model's verdict was not remembered"
    document = json.loads(verdicts[0].read_text())
    fingerprint = run_in_fresh_process(common + textwrap.dedent("""
        from batchjac._fingerprint import computation_fingerprint
        print(computation_fingerprint(center))
    """)).strip()
    planted = {**document, "key": {**document["key"], "model": fingerprint}}
    (folder(cache_env) / f"{TuneKey(**planted['key']).digest()}.json").write_text(json.dumps(planted))
    out = run_in_fresh_process(common + textwrap.dedent("""
        import warnings
        from batchjac._errors import RowInteractionError
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                batchjac.jacobian(center, x)
                print("COMPUTED")
            except RowInteractionError:
                print("REFUSED")
        print([str(w.message) for w in caught])
    """))
    assert "REFUSED" in out
    assert "signature does not match" in out


# -- compiled executables -------------------------------------------------------------------------

MODEL = """
    import json, warnings, numpy as np, jax.numpy as jnp, batchjac
    from batchjac._backends.jax import executables as jax_executables
    jax_executables.MIN_COMPILE_SECONDS = 0.0  # (tiny kernels are written too)
    W = np.random.default_rng({seed}).normal(size=(5, 3)).astype(np.float32)
    def model(x):
        return jnp.tanh(x @ W)
    x = np.random.default_rng(1).normal(size=(40, 5)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jac = batchjac.jacobian(model, x)
        jax_executables.flush()
    t = np.tanh(x.astype(np.float64) @ W.astype(np.float64))
    ref = (1 - t ** 2)[:, :, None] * W.T.astype(np.float64)[None]
    print(json.dumps({{"error": float(np.abs(jac - ref).max()),
                      "warnings": [str(w.message) for w in caught]}}))
"""


def run_model(seed: int) -> dict[str, Any]:
    """The Jacobians' error in a fresh process, with no race (each run compiles the same
    kernels, so a planted file is looked up for sure) and the cache warnings it gave."""
    os.environ["BATCHJAC_AUTOTUNE"] = "off"  # (the fixture's monkeypatch restores it)
    out = run_in_fresh_process(MODEL.format(seed=seed))
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def payloads(cache: Path) -> dict[Path, tuple[dict[str, Any], bytes]]:
    """Each executable file in ``cache``: its header and payload."""
    found = {}
    for path in sorted(folder(cache).glob("*.bin")):
        head, _, payload = path.read_bytes().partition(b"\n")
        found[path] = (json.loads(head), payload)
    return found


class Planted:
    """What a planted pickle does when it is loaded: make a directory (the test looks)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@posix_only
def test_a_planted_payload_never_runs_code(cache_env: Path, tmp_path: Path) -> None:
    """A payload that runs code when unpickled, stored with a valid header under the key of the
    model the user runs: in a group-writable cache it is never opened (the cache is refused);
    in the user's own cache, signed, its pickle names ``os.mkdir`` and is refused unread."""
    pytest.importorskip("jax")
    first = run_model(seed=3)
    assert first["error"] < 1e-5
    found = payloads(cache_env)
    assert found, "no executable written"
    marker = tmp_path / "the-planted-code-ran"
    evil = pickle.dumps(Planted(marker))
    planted = len(evil).to_bytes(8, "little") + evil + evil  # (any layout a loader might read)
    cache = TuneCache(cache_env)
    for header, _ in found.values():
        cache.put_bytes(TuneKey(**header["key"]), planted)  # signed, as by someone who can write
    cache_env.chmod(0o770)
    shared = run_model(seed=3)
    assert not marker.exists()
    assert shared["error"] < 1e-5
    assert any("does not use the tuning cache" in w and "can be written by its group" in w
               for w in shared["warnings"]), shared["warnings"]

    cache_env.chmod(0o700)
    own = run_model(seed=3)  # the user's own cache, the payload signed with its key
    assert not marker.exists()
    assert own["error"] < 1e-5


def test_another_models_executable_under_this_models_key_is_a_miss(cache_env: Path) -> None:
    """An executable swapped in under another model's key, its size and checksum fixed up (all
    anyone without the cache's key can do): the signature no longer matches, the model compiles
    its own kernel and its Jacobians are its own."""
    pytest.importorskip("jax")
    assert run_model(seed=3)["error"] < 1e-5
    of_3 = payloads(cache_env)
    assert run_model(seed=4)["error"] < 1e-5
    of_4 = {p: v for p, v in payloads(cache_env).items() if p not in of_3}
    assert len(of_3) == len(of_4) >= 1
    for (path, (header, _)), (_, payload) in zip(of_4.items(), of_3.values()):
        import hashlib

        header["decision"] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
        path.write_bytes(json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
    swapped = run_model(seed=4)
    assert swapped["error"] < 1e-5
    assert any("signature does not match" in w for w in swapped["warnings"]), swapped["warnings"]


def test_an_executable_for_another_argument_structure_is_a_miss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callables that lower to one module text with different pytrees (a Flax ``apply``
    with its params dict against a plain function of a tuple): the second once loaded the
    first one's executable and failed with "Function compiled with input pytree does not
    match". Now it is a miss, with no warning, and the second compiles its own."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from batchjac._backends.jax import compat, executables as jax_executables

    monkeypatch.setattr(jax_executables, "MIN_COMPILE_SECONDS", 0.0)
    monkeypatch.setattr(jax_executables, "_SEEN", set())
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)

    def as_tuple() -> Any:
        def kernel(x: Any, p: Any) -> Any:
            return jnp.tanh(x @ p[0]) @ p[1]
        return jax.jit(kernel).lower(x, (a, b)), (x, (a, b))

    def as_dict() -> Any:
        def kernel(x: Any, p: Any) -> Any:
            return jnp.tanh(x @ p["params"]["a"]) @ p["params"]["b"]
        return jax.jit(kernel).lower(x, {"params": {"a": a, "b": b}}), (x, {"params": {"a": a, "b": b}})

    (first, _), (second, second_args) = as_tuple(), as_dict()
    # (the premise: one module text, the disk cache's key, in this JAX's form of it)
    assert compat.module_text(first) is not None
    assert compat.module_text(first) == compat.module_text(second)
    compiled, loaded = jax_executables.compile(first)
    assert not loaded
    jax_executables.flush()
    assert jax_executables.load(first) is not None  # (it is on disk, and loads for its own call)
    assert jax_executables.load(second) is None
    compiled, loaded = jax_executables.compile(second)
    assert not loaded
    want = np.tanh(np.asarray(x, np.float64) @ np.asarray(a, np.float64)) @ np.asarray(b, np.float64)
    np.testing.assert_allclose(np.asarray(compiled(*second_args)), want, rtol=1e-5, atol=1e-5)


def test_the_pickle_scan_refuses_what_it_cannot_prove(tmp_path: Path) -> None:
    """The scan reads a pickle without running it: an executable's pickle passes, one naming
    any other callable, an extension code or bytes that are no pickle are refused."""
    jax = pytest.importorskip("jax")
    from jax.experimental import serialize_executable

    from batchjac._backends.jax.executables import _only_known_classes

    lowered = jax.jit(lambda x: x * 2.0).lower(np.ones((3, 2), np.float32))
    blob, _, _ = serialize_executable.serialize(lowered.compile())
    assert _only_known_classes(blob)  # (what this JAX writes is loadable)
    marker = tmp_path / "ran"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert not _only_known_classes(pickle.dumps(Planted(marker), protocol=protocol))
    assert not _only_known_classes(pickle.dumps(np.load))
    assert not _only_known_classes(b"\x80\x04\x82\x01.")  # EXT1
    assert not _only_known_classes(os.urandom(64))
    assert not marker.exists()


def test_no_pickle_of_bytes_read_back_from_disk_in_the_package() -> None:
    """No module unpickles what it reads from a cache or a store. The two pickles that remain
    are named here with why: a model file the user asked to trust (``--trust-model``), and the
    model Dask ships from the client to its workers in memory."""
    root = Path(batchjac.__file__).resolve().parent
    allowed = {
        ("_loaders/torch.py", "torch.load"),  # a user's model file, only with --trust-model
        ("_dask.py", "pickle.loads"),  # the client's model, sent to its workers in memory
    }
    patterns = {
        "pickle.loads": re.compile(r"\bpickle\.loads?\("),
        "Unpickler": re.compile(r"\bUnpickler\b"),
        "torch.load": re.compile(r"\btorch\.load\((?![^)]*weights_only=True)"),
        "allow_pickle=True": re.compile(r"allow_pickle\s*=\s*True"),
        "marshal": re.compile(r"\bmarshal\.loads?\("),
        "dill": re.compile(r"\bdill\.loads?\("),
    }
    found = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for name, pattern in patterns.items():
            if pattern.search(text):
                found.add((path.relative_to(root).as_posix(), name))
    assert found <= allowed, sorted(found - allowed)
