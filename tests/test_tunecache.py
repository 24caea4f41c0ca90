"""The on-disk tuning cache: decisions survive the process, are shared between processes, and a
cache in a bad state (corrupt, truncated, foreign, unwritable, switched off) is never an error
and never a wrong choice, with one warning per process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import batchjac
from batchjac._config import cache_dir, cache_enabled
from batchjac._errors import BatchJacWarning, InputError, InputTypeError, TuneCacheWarning
from batchjac._tune import cache as _tunecache
from batchjac._tune.cache import TuneKey, default_cache, machine_id, versions

from .helpers import without_dac_capabilities

SRC = str(Path(batchjac.__file__).resolve().parents[1])
DECISION = {"mode": "forward", "chunk_size": 1000, "variant": "xla", "timings": "fwd 1.2 ms, rev 3.4 ms"}


@pytest.fixture(autouse=True)
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache directory (not created yet), the cache on, and warnings not yet given."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(directory))
    monkeypatch.delenv("BATCHJAC_CACHE", raising=False)
    _tunecache._reset_warnings()
    yield directory
    _tunecache._reset_warnings()


def key(what: str = "mode", shape: str | int = 1000, model: str = "sha256:model") -> TuneKey:
    return TuneKey.make(model, "rows:float32:(5,)|(3,)", what, shape, framework="numpy")


def _run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh Python, warnings as errors, with this cache directory."""
    environ = {**os.environ, "PYTHONPATH": SRC, "BATCHJAC_CACHE_DIR": str(cache), **env}
    return subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=120)


def _put_all(cache: _tunecache.TuneCache, *keys: TuneKey) -> None:
    for k in keys:
        cache.put(k, DECISION)


# -- keys -----------------------------------------------------------------------------------------


def test_keys_are_frozen_hashable_and_hold_what_a_timing_depends_on() -> None:
    k = key()
    assert k == key()
    assert hash(k) == hash(key())
    assert k.shape == "1000"
    assert key(shape="1000") == k
    assert {k: 1}[key()] == 1
    assert key(what="rows") != k
    assert key(shape=2000) != k
    assert key(model="sha256:other") != k
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.what = "rows"  # type: ignore[misc]
    assert k.versions.startswith(f"batchjac={batchjac.__version__}+{_tunecache.code_id()};python=")
    assert "numpy=" in k.versions
    assert f"cores={os.cpu_count()}" in k.machine
    assert k.machine == machine_id()
    assert machine_id("NVIDIA  H200") == machine_id() + ";gpu=NVIDIA H200"
    assert "torch=" in versions("torch")
    assert "jaxlib=" in versions("jax")
    assert versions("no-such-framework").endswith("no-such-framework=none")
    assert len(k.digest()) == 64
    assert k.digest() == key().digest() != key(what="rows").digest()
    with pytest.raises(InputTypeError, match=r"TuneKey\.signature must be a string.*got int 3"):
        TuneKey("sha256:m", 3, "mode")  # type: ignore[arg-type]


def test_keys_of_models_use_the_computation_fingerprint() -> None:
    def make(w: np.ndarray) -> object:
        return lambda x: np.tanh(x @ w)

    rng = np.random.default_rng(0)
    a = TuneKey.make(make(rng.normal(size=(5, 4))), "sig", "mode", framework="numpy")
    b = TuneKey.make(make(rng.normal(size=(5, 4))), "sig", "mode", framework="numpy")  # retrained
    c = TuneKey.make(make(rng.normal(size=(5, 3))), "sig", "mode", framework="numpy")  # narrower
    assert a == b != c


# -- the store ------------------------------------------------------------------------------------


def test_put_then_get_round_trips(cache_env: Path) -> None:
    cache = default_cache()
    assert cache.enabled
    assert cache.directory == cache_env
    assert cache.get(key()) is None  # nothing stored yet: a miss, silently
    cache.put(key(), DECISION)
    assert cache.get(key()) == DECISION
    assert cache.get(key(what="rows")) is None
    cache.put(key(), {**DECISION, "mode": "reverse"})  # replaced
    assert cache.get(key()) == {**DECISION, "mode": "reverse"}
    path = cache_env / f"v{_tunecache.VERSION}" / f"{key().digest()}.json"
    assert cache.path(key()) == path
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, _tunecache.KEY_FILE])
    stored = json.loads(path.read_text())  # readable, and holds its key
    assert stored["schema"] == "batchjac-tunecache"
    assert stored["version"] == _tunecache.VERSION
    assert stored["key"] == dataclasses.asdict(key())
    assert stored["decision"]["mode"] == "reverse"
    if os.name == "posix":
        assert path.stat().st_mode & 0o777 == 0o600


def test_another_process_reads_what_this_one_wrote_and_vice_versa(cache_env: Path) -> None:
    make_key = 'TuneKey.make("sha256:model", "rows:float32:(5,)|(3,)", "mode", 1000, framework="numpy")'
    default_cache().put(key(), DECISION)
    child = _run(f"""
        import json
        from batchjac._tune.cache import TuneKey, default_cache
        cache = default_cache()
        print(json.dumps(cache.get({make_key})))
        cache.put({make_key.replace('"mode"', '"rows"')}, {{"chunk_size": 250}})
        """, cache_env)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == DECISION
    assert default_cache().get(key(what="rows")) == {"chunk_size": 250}


def test_corrupt_and_truncated_files_are_ignored_with_one_warning(cache_env: Path) -> None:
    cache = default_cache()
    for what in ("mode", "rows", "variant"):
        cache.put(key(what), DECISION)
    truncated, corrupt = cache.path(key("mode")), cache.path(key("rows"))
    assert truncated is not None
    assert corrupt is not None
    truncated.write_bytes(truncated.read_bytes()[:40])
    corrupt.write_bytes(b"\x00\xff garbage \x89PNG")
    with pytest.warns(TuneCacheWarning, match=r"ignores the tuning cache file .*not valid JSON") as caught:
        found = [cache.get(key(what)) for what in ("mode", "rows", "variant")]
    assert found == [None, None, DECISION]  # the sound file is still read
    assert len(caught) == 1
    assert issubclass(TuneCacheWarning, BatchJacWarning)
    assert "BATCHJAC_CACHE=off" in str(caught[0].message)
    cache.put(key("mode"), DECISION)  # the next tuning overwrites the file
    assert cache.get(key("mode")) == DECISION



def test_payloads_round_trip_and_damaged_ones_are_never_handed_out(cache_env: Path) -> None:
    """A binary payload (a compiled executable) is given back byte for byte; one that was
    truncated, had a byte flipped, or sits under another key is ignored with one warning: a
    framework's loader never sees damaged bytes."""
    cache = default_cache()
    rng = np.random.default_rng(7)
    payloads = {what: rng.integers(0, 256, size=int(rng.integers(1000, 5000)), dtype=np.uint8).tobytes()
                for what in ("a", "b", "c", "d")}
    for what, payload in payloads.items():
        cache.put_bytes(key(what), payload)
    assert cache.get_bytes(key("a")) == payloads["a"]
    truncated, flipped, copied = (cache.blob_path(key(w)) for w in ("b", "c", "d"))
    assert truncated is not None
    assert flipped is not None
    assert copied is not None
    truncated.write_bytes(truncated.read_bytes()[:-100])
    raw = bytearray(flipped.read_bytes())
    raw[-10] ^= 0x01
    flipped.write_bytes(bytes(raw))
    copied.write_bytes(cache.blob_path(key("a")).read_bytes())  # type: ignore[union-attr]
    with pytest.warns(TuneCacheWarning, match=r"ignores the cache file .*truncated") as caught:
        found = [cache.get_bytes(key(w)) for w in ("b", "c", "d")]
    assert found == [None, None, None]
    assert len(caught) == 1  # one warning per process and kind
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match="does not match its checksum"):
        assert cache.get_bytes(key("c")) is None
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match="belongs to another key"):
        assert cache.get_bytes(key("d")) is None
    assert cache.get_bytes(key("missing")) is None  # nothing stored: no warning
    assert cache.get_bytes(key("a")) == payloads["a"]  # the sound file is still read


def test_a_directory_says_whether_it_ever_held_a_payload(cache_env: Path) -> None:
    """A lookup in a directory that never held an executable is skipped (its key costs the
    kernel's text hashed): the mark appears with the first payload, private as the rest."""
    cache = default_cache()
    assert not cache.has_payloads()
    cache.put(key("mode"), DECISION)  # a decision is not a payload
    assert not cache.has_payloads()
    cache.put_bytes(key("a"), b"\x00\x01\x02")
    assert cache.has_payloads()
    mark = cache_env / f"v{_tunecache.VERSION}" / _tunecache.PAYLOADS_MARK
    assert mark.stat().st_mode & 0o077 == 0
    assert not _tunecache.TuneCache(None).has_payloads()


def test_payloads_beyond_the_size_limit_go_least_recently_used_first(
        cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCHJAC_CACHE_MAX_BYTES bounds the executables kept: past it the payloads least
    recently written or read are removed, never the one just written; decisions stay."""
    monkeypatch.setenv("BATCHJAC_CACHE_MAX_BYTES", "35000")  # three payloads of ~10.4 kB
    cache = default_cache()
    rng = np.random.default_rng(11)
    payloads = {w: rng.integers(0, 256, size=10_000, dtype=np.uint8).tobytes() for w in "abcd"}
    cache.put(key("mode"), DECISION)
    for i, w in enumerate("abc"):
        cache.put_bytes(key(w), payloads[w])
        path = cache.blob_path(key(w))
        assert path is not None
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # a, b, c written in that order
    assert cache.get_bytes(key("a")) == payloads["a"]  # read: now the most recent of the three
    cache.put_bytes(key("d"), payloads["d"])
    kept = {w for w in "abcd" if cache.get_bytes(key(w)) is not None}
    assert kept == {"a", "c", "d"}  # b was the least recently used
    assert cache.get(key("mode")) == DECISION
    monkeypatch.setenv("BATCHJAC_CACHE_MAX_BYTES", "lots")
    with pytest.raises(InputError, match=r"BATCHJAC_CACHE_MAX_BYTES.*'lots'"):
        default_cache()


def test_payloads_are_not_written_with_the_cache_off(cache_env: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHJAC_CACHE", "off")
    default_cache().put_bytes(key(), b"\x01\x02")
    assert not cache_env.exists()
    with pytest.raises(InputTypeError, match="payload must be bytes; got str"):
        _tunecache.TuneCache(cache_env).put_bytes(key(), "text")  # type: ignore[arg-type]

@pytest.mark.parametrize(("document", "match"), [
    ({"key": "other"}, r"belongs to another key \(its model differ"),
    ({"schema": "someone-else"}, "not a batchjac tuning cache file"),
    ({"version": 1}, "cache format version 1"),
    ({"decision": ["forward"]}, "not a JSON object"),
    (None, "not a batchjac tuning cache file"),
])
def test_foreign_files_are_ignored(cache_env: Path, document: dict[str, object] | None, match: str) -> None:
    cache = default_cache()
    cache.put(key(), DECISION)
    path = cache.path(key())
    assert path is not None
    stored = json.loads(path.read_text())
    if document is None:
        stored = [1, 2, 3]
    elif document.get("key") == "other":
        stored["key"] = {**stored["key"], "model": "sha256:other"}  # a collision, or a copied file
    else:
        stored.update(document)
    path.write_text(json.dumps(stored))
    with pytest.warns(TuneCacheWarning, match=match):
        assert cache.get(key()) is None


def test_a_file_copied_from_another_key_is_not_used(cache_env: Path) -> None:
    cache = default_cache()
    cache.put(key(what="rows"), {"chunk_size": 64})
    source, target = cache.path(key(what="rows")), cache.path(key(what="mode"))
    assert source is not None
    assert target is not None
    target.write_bytes(source.read_bytes())
    with pytest.warns(TuneCacheWarning, match=r"another key \(its what differ"):
        assert cache.get(key(what="mode")) is None


def test_decisions_the_caller_rejects_are_ignored(cache_env: Path) -> None:
    cache = default_cache()
    cache.put(key(), {"mode": "sideways", "chunk_size": True})
    schema = {"mode": {"forward", "reverse"}, "chunk_size": int}

    def check(decision: dict[str, object]) -> None:
        if decision["mode"] not in ("forward", "reverse"):
            raise ValueError(f"unknown mode {decision['mode']!r}")

    with pytest.warns(TuneCacheWarning, match=r"rejects its decision .*unknown mode 'sideways'"):
        assert cache.get(key(), validate=check) is None
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match=r"'mode' is 'sideways', which is not one of 'forward', 're"):
        assert cache.get(key(), validate=schema) is None
    cache.put(key(), {"mode": "forward", "chunk_size": True})  # JSON's true is no chunk size
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match=r"'chunk_size' is True, which is not of type int"):
        assert cache.get(key(), validate=schema) is None
    _tunecache._reset_warnings()
    with pytest.warns(TuneCacheWarning, match="rejects its decision"):
        assert cache.get(key(), validate=lambda d: False) is None
    cache.put(key(), {"mode": "reverse", "chunk_size": 512})
    assert cache.get(key(), validate=schema) == {"mode": "reverse", "chunk_size": 512}
    assert cache.get(key(), validate=check) == {"mode": "reverse", "chunk_size": 512}


def test_decisions_must_be_json(cache_env: Path) -> None:
    cache = default_cache()
    with pytest.raises(InputTypeError, match=r"JSON values only .*int\(\) or float\(\)"):
        cache.put(key(), {"chunk_size": np.int64(3), "seconds": np.float32(1.0)})
    with pytest.raises(InputTypeError, match="dict with string keys"):
        cache.put(key(), {1: "forward"})  # type: ignore[dict-item]
    with pytest.raises(InputTypeError, match="must be a TuneKey"):
        cache.put("mode", DECISION)  # type: ignore[arg-type]
    assert not cache_env.exists()


WRITER = """
    import sys, time
    from pathlib import Path
    from batchjac._tune.cache import TuneKey, default_cache
    me, go = int(sys.argv[1]), Path(sys.argv[2])
    key = TuneKey.make("sha256:model", "sig", "rows", 1000, framework="numpy")
    cache = default_cache()
    while not go.exists():
        time.sleep(0.001)
    for i in range(200):
        # sizes vary, so a torn write would show as a truncated or mixed file
        cache.put(key, {"writer": me, "i": i, "pad": "x" * (1 + (i * 37 + me * 4000) % 6000)})
    """


def test_concurrent_writers_leave_a_whole_file(cache_env: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": SRC, "BATCHJAC_CACHE_DIR": str(cache_env)}
    code = textwrap.dedent(WRITER)
    writers = [subprocess.Popen([sys.executable, "-W", "error", "-c", code, str(me), str(go)],
                                env=env, stderr=subprocess.PIPE, text=True) for me in (1, 2)]
    the_key = TuneKey.make("sha256:model", "sig", "rows", 1000, framework="numpy")
    cache, seen = default_cache(), set()
    try:
        time.sleep(0.5)  # both started and waiting, so that their writes overlap
        go.touch()
        deadline = time.monotonic() + 120
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
            # filterwarnings=error: a torn file read here would fail the test
            decision = cache.get(the_key, validate={"writer": int, "i": int, "pad": str})
            if decision is not None:
                seen.add(decision["writer"])
        errors = [w.communicate(timeout=120)[1] for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    assert [w.returncode for w in writers] == [0, 0], errors
    final = cache.get(the_key, validate={"writer": int, "i": int, "pad": str})
    assert final is not None
    assert final["writer"] in (1, 2)
    assert final["i"] == 199
    assert len(final["pad"]) == 1 + (199 * 37 + final["writer"] * 4000) % 6000
    assert sorted(p.name for p in (cache_env / f"v{_tunecache.VERSION}").iterdir()) == sorted(
        [f"{the_key.digest()}.json", _tunecache.KEY_FILE])  # no temp files
    assert seen <= {1, 2}


# -- the environment ------------------------------------------------------------------------------


def test_cache_off_reads_and_writes_nothing(cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default_cache().put(key("rows"), DECISION)
    monkeypatch.setenv("BATCHJAC_CACHE", " OFF ")
    assert not cache_enabled()
    cache = default_cache()
    assert not cache.enabled
    assert cache.directory is None
    assert cache.path(key()) is None
    assert cache.get(key("rows")) is None  # not read, though it is there
    other = cache_env.parent / "elsewhere"
    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(other))
    default_cache().put(key(), DECISION)
    assert not other.exists()


def test_invalid_cache_switch_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHJAC_CACHE", "maybe")
    with pytest.raises(InputError, match=r"BATCHJAC_CACHE must be 'on' or 'off'; got 'maybe'"):
        default_cache()


def test_an_unwritable_directory_warns_once_and_carries_on(cache_env: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # a regular file where the directory should be: mkdir and open fail even for root, who may
    # write into a directory of mode 0o500
    cache_env.write_text("not a directory")
    cache = default_cache()
    with pytest.warns(TuneCacheWarning, match=r"cannot write its tuning cache in .*BATCHJAC_CACHE_DIR") as w:
        _put_all(cache, key(), key("rows"))
    assert len(w) == 1
    assert cache.get(key()) is None  # nothing stored: a miss, and not a second warning
    assert cache_env.read_text() == "not a directory"


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_read_only_directory_warns_once(cache_env: Path) -> None:
    """As root (which writes anywhere) in a child without the DAC capabilities: the kernel
    refuses the write there as it does for any user."""
    folder = cache_env / f"v{_tunecache.VERSION}"
    folder.mkdir(parents=True)
    folder.chmod(0o500)
    try:
        if os.geteuid() != 0:
            with pytest.warns(TuneCacheWarning, match="cannot write") as caught:
                _put_all(default_cache(), key(), key("rows"))
            assert len(caught) == 1
            return
        code = f"""
            import warnings
            from batchjac._tune.cache import TuneKey, default_cache
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for what in ("mode", "rows"):
                    key = TuneKey.make("sha256:model", "rows:float32:(5,)|(3,)", what, 1000,
                                       framework="numpy")
                    default_cache().put(key, {DECISION!r})
            print(len(caught), [str(w.message) for w in caught])
        """
        environ = {**os.environ, "PYTHONPATH": SRC, "BATCHJAC_CACHE_DIR": str(cache_env)}
        child = subprocess.run(without_dac_capabilities([sys.executable, "-c", textwrap.dedent(code)]),
                               env=environ, capture_output=True, text=True, timeout=120, check=False)
        assert child.returncode == 0, child.stderr
        assert child.stdout.startswith("1 "), child.stdout  # one warning for both writes
        assert "cannot write" in child.stdout, child.stdout
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_unreadable_files_warn(cache_env: Path) -> None:
    cache = default_cache()
    path = cache.path(key())
    assert path is not None
    path.mkdir(parents=True)  # a directory where the file should be: open fails, also for root
    with pytest.warns(TuneCacheWarning, match="cannot read the tuning cache file"):
        assert cache.get(key()) is None


def test_where_the_cache_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHJAC_CACHE_DIR", "relative/cache")
    assert cache_dir() == tmp_path / "relative" / "cache"  # absolute: other cwds find it too
    monkeypatch.setenv("BATCHJAC_CACHE_DIR", "")  # empty is unset, as for XDG variables
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "batchjac"
    monkeypatch.setenv("XDG_CACHE_HOME", "not/absolute")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "batchjac"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "batchjac"
    assert not (tmp_path / "home").exists()  # nothing created until a decision is written


def test_the_test_suite_writes_its_caches_in_a_temporary_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py points BATCHJAC_CACHE_DIR at a temporary directory for the session."""
    import tempfile

    from tests import conftest

    monkeypatch.undo()  # what this module's fixture set: the session's own setting is left
    session = conftest.SESSION_CACHE_DIR
    assert session is not None
    assert os.environ.get("BATCHJAC_CACHE_DIR") == session
    assert Path(session).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
    assert os.path.isdir(session)
