"""Tests of the block-option cache (hierremat.store.cache) and its CLI (hierremat.cache)."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hierremat.store import cache as cache_module
from hierremat.store.cache import FORMAT_VERSION, CacheKey, OptionsCache, canonical_json

REPO = Path(__file__).resolve().parents[1]
LOGGER = "hierremat.cache"


def _key(sig="sig-a"):
    return CacheKey(sig, "cuda", "NVIDIA H100", "float32", "cm1", "ilp1")


PAYLOAD = {"options": [{"kept": [1, 2, 3], "time_s": 1.5e-3, "peak_bytes": 1 << 30}], "note": "é"}


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_round_trip_and_copies(tmp_path):
    c = OptionsCache(tmp_path)
    assert c.get(_key()) is None
    c.put(_key(), PAYLOAD)
    got = c.get(_key())
    assert got == PAYLOAD
    got["note"] = "mutated"  # callers get copies
    assert c.get(_key()) == PAYLOAD
    # a fresh instance reads it back from disk
    fresh = OptionsCache(tmp_path)
    assert fresh.get(_key()) == PAYLOAD
    assert fresh.get(_key("other")) is None
    doc = json.loads(c.path_for(_key()).read_text())
    assert doc["format"] == "hierremat-options" and doc["format_version"] == FORMAT_VERSION
    assert doc["key"] == _key().to_dict() and set(doc) == {"format", "format_version", "key", "payload", "checksum"}


def test_key_digest_stable_and_typed():
    assert _key().digest() == _key().digest() and len(_key().digest()) == 64
    assert _key().digest() != _key("sig-b").digest()
    assert CacheKey.from_dict(_key().to_dict()) == _key()
    with pytest.raises(TypeError):
        CacheKey("s", "cuda", "x", "float32", 1, "ilp1")


def test_put_rejects_non_json(tmp_path):
    with pytest.raises(TypeError):
        OptionsCache(tmp_path).put(_key(), {"x": object()})
    with pytest.raises(TypeError):
        OptionsCache(tmp_path).put(_key(), [1, 2])


def test_memory_layer_hit(tmp_path):
    c = OptionsCache(tmp_path)
    c.put(_key(), PAYLOAD)
    c.path_for(_key()).unlink()
    assert c.get(_key()) == PAYLOAD  # served from memory
    assert OptionsCache(tmp_path).get(_key()) is None


@pytest.mark.parametrize("offset", [0, 10, 40, 120, -5])
def test_flipped_byte_is_a_miss_then_put_repairs(tmp_path, caplog, offset):
    OptionsCache(tmp_path).put(_key(), PAYLOAD)
    path = OptionsCache(tmp_path).path_for(_key())
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    c = OptionsCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert c.get(_key()) is None
    (w,) = _warnings(caplog)
    assert str(path) in w.getMessage()
    c.put(_key(), PAYLOAD)
    assert OptionsCache(tmp_path).get(_key()) == PAYLOAD


def test_tampered_payload_checksum_mismatch(tmp_path, caplog):
    c = OptionsCache(tmp_path)
    c.put(_key(), PAYLOAD)
    path = c.path_for(_key())
    doc = json.loads(path.read_text())
    doc["payload"]["options"][0]["time_s"] = 0.0
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert OptionsCache(tmp_path).get(_key()) is None
    assert "checksum" in _warnings(caplog)[0].getMessage()


def test_truncated_file_is_a_miss(tmp_path, caplog):
    c = OptionsCache(tmp_path)
    c.put(_key(), PAYLOAD)
    path = c.path_for(_key())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert OptionsCache(tmp_path).get(_key()) is None
    assert "truncated" in _warnings(caplog)[0].getMessage()
    path.write_bytes(b"")
    assert OptionsCache(tmp_path).get(_key()) is None


def test_wrong_format_version_and_wrong_key_are_misses(tmp_path, caplog):
    c = OptionsCache(tmp_path)
    c.put(_key(), PAYLOAD)
    path = c.path_for(_key())
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(dict(doc, format_version=FORMAT_VERSION + 1)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert OptionsCache(tmp_path).get(_key()) is None
    assert "format_version" in _warnings(caplog)[0].getMessage()
    # a valid document for another key, stored under this key's file name
    OptionsCache(tmp_path).put(_key("other"), {"other": True})
    path.write_bytes(OptionsCache(tmp_path).path_for(_key("other")).read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert OptionsCache(tmp_path).get(_key()) is None
    assert "another key" in _warnings(caplog)[0].getMessage()


def test_env_var_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HIERREMAT_CACHE_DIR", str(tmp_path / "envdir"))
    c = OptionsCache()
    assert c.directory == tmp_path / "envdir"
    c.put(_key(), PAYLOAD)
    assert (tmp_path / "envdir" / f"{_key().digest()}.json").is_file()
    assert OptionsCache(tmp_path / "explicit").directory == tmp_path / "explicit"
    monkeypatch.delenv("HIERREMAT_CACHE_DIR")
    assert OptionsCache().directory == Path("~/.cache/hierremat").expanduser()


def test_disabled(tmp_path):
    OptionsCache(tmp_path).put(_key(), PAYLOAD)
    off = OptionsCache(tmp_path, enabled=False)
    assert off.get(_key()) is None
    off.put(_key("new"), PAYLOAD)
    assert not OptionsCache(tmp_path).path_for(_key("new")).exists()
    assert off.get(_key("new")) is None


def test_entries_and_clear(tmp_path):
    c = OptionsCache(tmp_path)
    assert c.entries() == [] and c.clear() == 0  # directory does not exist yet
    c.put(_key("a"), PAYLOAD)
    c.put(_key("b"), {"x": 1})
    (tmp_path / "unrelated.txt").write_text("keep me")
    bad = tmp_path / ("0" * 64 + ".json")
    bad.write_text("{not json")
    es = c.entries()
    assert len(es) == 3
    good = [e for e in es if e["valid"]]
    assert sorted(e["signature"] for e in good) == ["a", "b"]
    for e in good:
        assert e["size"] == Path(e["file"]).stat().st_size and abs(e["created"] - time.time()) < 60
        assert e["digest"] == Path(e["file"]).stem and e["problem"] is None
    (invalid,) = [e for e in es if not e["valid"]]
    assert invalid["signature"] is None and "JSON" in invalid["problem"]
    assert c.clear() == 3
    assert c.entries() == [] and c.get(_key("a")) is None
    assert (tmp_path / "unrelated.txt").exists()


def test_export_import(tmp_path, caplog):
    src = OptionsCache(tmp_path / "src")
    src.put(_key("a"), PAYLOAD)
    src.put(_key("b"), {"x": [1.0, 2.5]})
    bundle = tmp_path / "bundle.json"
    assert src.export(bundle) == 2
    # tamper with one entry of the bundle, and add a junk one
    data = json.loads(bundle.read_text())
    data["entries"][0]["payload"]["extra"] = 1
    tampered_sig = data["entries"][0]["key"]["signature"]
    data["entries"].append({"format": "hierremat-options", "format_version": 1})
    bundle.write_text(json.dumps(data))
    dst = OptionsCache(tmp_path / "dst")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert dst.import_(bundle) == 1
    assert len(_warnings(caplog)) == 2
    fresh = OptionsCache(tmp_path / "dst")
    assert fresh.get(_key(tampered_sig)) is None
    other = "b" if tampered_sig == "a" else "a"
    assert fresh.get(_key(other)) == src.get(_key(other))
    # an export/import of everything is lossless
    assert src.export(bundle) == 2 and fresh.import_(bundle) == 2
    assert OptionsCache(tmp_path / "dst").get(_key("a")) == PAYLOAD
    # a file that is not a bundle at all
    (tmp_path / "junk.json").write_text("[]")
    with pytest.raises(ValueError):
        fresh.import_(tmp_path / "junk.json")


_WRITER = textwrap.dedent(
    """
    import sys
    from hierremat.store.cache import CacheKey, OptionsCache
    d, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    key = CacheKey("shared", "cuda", "dev", "float32", "cm1", "ilp1")
    for i in range(n):
        OptionsCache(d).put(key, {"writer": who, "i": i, "blob": list(range(2000))})
    """
)


def test_concurrent_writers_leave_a_valid_file(tmp_path, caplog):
    n = 150
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), who, str(n)], env=_env())
        for who in ("A", "B")
    ]
    key = CacheKey("shared", "cuda", "dev", "float32", "cm1", "ilp1")
    seen = 0
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        while any(p.poll() is None for p in procs):  # read while they write
            got = OptionsCache(tmp_path).get(key)
            if got is not None:
                seen += 1
                assert got["blob"] == list(range(2000))
        assert all(p.wait() == 0 for p in procs)
        final = OptionsCache(tmp_path).get(key)
    assert _warnings(caplog) == []
    assert final["writer"] in ("A", "B") and final["i"] == n - 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{key.digest()}.json"]  # no temp files left


def _cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "hierremat.cache", *args],
        capture_output=True, text=True, env=_env(**env), cwd=REPO, timeout=60,
    )


def test_cli(tmp_path):
    d = tmp_path / "c"
    c = OptionsCache(d)
    c.put(_key("block-sig-1"), PAYLOAD)
    c.put(_key("block-sig-2"), {"x": 1})
    r = _cli("list", HIERREMAT_CACHE_DIR=str(d))  # directory from the environment
    assert r.returncode == 0, r.stderr
    assert "block-sig-1" in r.stdout and "block-sig-2" in r.stdout and "2 entries" in r.stdout
    r = _cli("--dir", str(d), "list", "--json")
    assert sorted(e["signature"] for e in json.loads(r.stdout)) == ["block-sig-1", "block-sig-2"]
    out = tmp_path / "b.json"
    r = _cli("export", str(out), "--dir", str(d))
    assert r.returncode == 0 and "exported 2" in r.stdout, r.stderr
    r = _cli("--dir", str(d), "clear")
    assert r.returncode == 0 and "removed 2" in r.stdout
    assert "no entries" in _cli("--dir", str(d), "list").stdout
    r = _cli("--dir", str(d), "import", str(out))
    assert r.returncode == 0 and "imported 2" in r.stdout, r.stderr
    assert OptionsCache(d).get(_key("block-sig-1")) == PAYLOAD
    r = _cli("--dir", str(d), "import", str(tmp_path / "missing.json"))
    assert r.returncode == 1 and "error" in r.stderr


def _age(cache: OptionsCache, key: CacheKey, seconds_ago: float) -> None:
    """Set an entry's last use (its file's modification time) to ``seconds_ago``."""
    when = time.time() - seconds_ago
    os.utime(cache.path_for(key), (when, when))


def test_least_recently_used_entries_are_evicted_beyond_the_cap(tmp_path):
    writer = OptionsCache(tmp_path)
    for name in ("a", "b", "c"):
        writer.put(_key(name), PAYLOAD)
    size = writer.path_for(_key("a")).stat().st_size
    _age(writer, _key("a"), 300), _age(writer, _key("b"), 200), _age(writer, _key("c"), 100)
    assert OptionsCache(tmp_path).get(_key("a")) == PAYLOAD  # a read is a use: "a" is now the most recent
    capped = OptionsCache(tmp_path, max_bytes=3 * size)
    capped.put(_key("d"), PAYLOAD)  # four entries over a cap of three: the least recently used one goes
    assert not capped.path_for(_key("b")).exists()
    assert all(capped.path_for(_key(n)).exists() for n in ("a", "c", "d"))
    tiny = OptionsCache(tmp_path, max_bytes=1)
    tiny.put(_key("e"), PAYLOAD)  # the entry just written stays, whatever the cap
    assert [p.name for _, _, p in tiny.usage()] == [tiny.path_for(_key("e")).name]
    assert tiny.get(_key("e")) == PAYLOAD


def test_writes_list_the_directory_only_where_the_cap_may_be_crossed(tmp_path, monkeypatch):
    size = len(canonical_json(cache_module._document(_key("a"), PAYLOAD))) + 1
    capped = OptionsCache(tmp_path, max_bytes=3 * size)
    listings = []
    listed = capped._files
    monkeypatch.setattr(capped, "_files", lambda: listings.append(1) or listed())
    for name in "abc":
        capped.put(_key(name), PAYLOAD)
    assert len(listings) == 1  # the first write; the next two keep within the cap by this process's count
    for name in "de":  # each would cross it: listed, and the least recently used entry goes
        capped.put(_key(name), PAYLOAD)
    assert len(listings) == 3 and len(capped.usage()) == 3
    roomy = OptionsCache(tmp_path, max_bytes=6 * size)
    roomy.put(_key("f"), PAYLOAD)  # its first write, listed: 4 entries
    for name in "gh":  # another process's writes: 6 entries, which roomy's own count does not see
        OptionsCache(tmp_path).put(_key(name), PAYLOAD)
    roomy.put(_key("i"), PAYLOAD)  # 5 by its own count, listed less than RESCAN_SECONDS ago: 7, over the cap
    assert len(roomy.usage()) == 7
    monkeypatch.setattr(cache_module, "RESCAN_SECONDS", 0.0)
    roomy.put(_key("j"), PAYLOAD)  # 6 by its own count, within the cap: listed again for the time alone
    assert len(roomy.usage()) == 6 and roomy.path_for(_key("j")).exists()


def test_cap_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HIERREMAT_CACHE_MAX_BYTES", "1KiB")
    assert OptionsCache(tmp_path).max_bytes == 1024
    OptionsCache(tmp_path).put(_key(), PAYLOAD)
    r = _cli("--dir", str(tmp_path), "list", HIERREMAT_CACHE_MAX_BYTES="2MiB")
    assert r.returncode == 0 and "of a 2.00 MiB cap" in r.stdout, r.stdout + r.stderr
    monkeypatch.setenv("HIERREMAT_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="HIERREMAT_CACHE_MAX_BYTES"):
        OptionsCache(tmp_path)
    with pytest.raises(ValueError, match="max_bytes"):
        OptionsCache(tmp_path, max_bytes=0)


def test_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import hierremat.store.cache, hierremat.cache\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 0, r.stderr
