"""tracer.recorder.bpfcache without the kernel: what the key depends on, and that an entry is loaded only from a
root-owned directory and file that no one else may write, with its digest and shape intact (it is code loaded into the
kernel as root). tests/integration/test_bpfcache_real.py loads a real entry."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.support.need import need_root
from tracer.recorder import bpfcache

KEY = "k" * 64
KW = {"kernel": "6.1.0 #1 SMP", "bcc": "/usr/lib/libbcc.so.0.26.0 1 2"}


def _entry() -> dict[str, Any]:
    # ld_imm64 r1 = map 0 (two slots), exit
    insns = struct.pack("<BBhi", 0x18, 0x11, 0, 7) + struct.pack("<BBhi", 0, 0, 0, 0)
    insns += struct.pack("<BBhi", 0x95, 0, 0, 0)
    return {
        "maps": [
            {
                "name": "m",
                "type": 1,
                "key_size": 4,
                "value_size": 8,
                "max_entries": 16,
                "flags": 0,
                "key_desc": '"int"',
                "leaf_desc": '"unsigned long long"',
            }
        ],
        "functions": [{"name": "f", "insns": base64.b64encode(insns).decode(), "relocs": [[0, 0]]}],
        "license": "GPL",
        "kern_version": 0,
    }


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    need_root("the cache is root's")
    d = tmp_path / "bpf"
    assert bpfcache.store(d, KEY, _entry())
    return d


def test_key_depends_on_text_flags_kernel_and_bcc() -> None:
    base = bpfcache.cache_key("int x;", ["-DA=1"], **KW)
    assert base == bpfcache.cache_key("int x;", ["-DA=1"], **KW)
    assert base != bpfcache.cache_key("int y;", ["-DA=1"], **KW)
    assert base != bpfcache.cache_key("int x;", ["-DA=2"], **KW)
    assert base != bpfcache.cache_key("int x;", ["-DA=1", "-DB"], **KW)
    assert base != bpfcache.cache_key("int x;", ["-DA=1"], kernel="6.1.0 #2 SMP", bcc=KW["bcc"])
    assert base != bpfcache.cache_key("int x;", ["-DA=1"], kernel=KW["kernel"], bcc="/usr/lib/libbcc.so 1 3")
    # flags are not concatenated ambiguously: ["-DA", "=1"] is another program than ["-DA=1"]
    assert base != bpfcache.cache_key("int x;", ["-DA", "=1"], **KW)


def test_key_of_this_machine_names_its_kernel() -> None:
    release = Path("/proc/sys/kernel/osrelease").read_text().strip()
    assert release in bpfcache._kernel_id()


def test_store_then_load(cache: Path) -> None:
    st = os.stat(cache)
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o700
    f = cache / f"{KEY}.json"
    assert os.stat(f).st_mode & 0o777 == 0o600
    got = bpfcache.load(cache, KEY)
    assert got is not None and got["functions"] == _entry()["functions"] and got["maps"] == _entry()["maps"]
    assert bpfcache.load(cache, "x" * 64) is None  # another key: a miss


def _rewrite(f: Path, edit: Any) -> None:
    outer = json.loads(f.read_text())
    body = json.loads(outer["body"])
    edit(body)
    outer["body"] = json.dumps(body)
    outer["sha256"] = hashlib.sha256(outer["body"].encode()).hexdigest()
    f.write_text(json.dumps(outer))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda f: f.write_bytes(f.read_bytes()[:-40]), id="truncated"),
        pytest.param(lambda f: f.write_bytes(f.read_bytes().replace(b"GPL", b"BSD")), id="digest-mismatch"),
        pytest.param(lambda f: f.write_text("[]"), id="not-an-entry"),
        pytest.param(lambda f: _rewrite(f, lambda b: b.update(key="y" * 64)), id="other-key"),
        pytest.param(lambda f: _rewrite(f, lambda b: b["functions"][0].update(relocs=[[0, 5]])), id="map-index"),
        pytest.param(lambda f: _rewrite(f, lambda b: b["functions"][0].update(relocs=[[2, 0]])), id="reloc-at-end"),
        pytest.param(lambda f: _rewrite(f, lambda b: b["functions"][0].update(insns="AAAA")), id="short-insns"),
        pytest.param(lambda f: _rewrite(f, lambda b: b["maps"][0].update(type="1")), id="map-type"),
    ],
)
def test_corrupt_entry_is_ignored(cache: Path, damage: Any) -> None:
    f = cache / f"{KEY}.json"
    assert bpfcache.load(cache, KEY) is not None
    damage(f)
    assert bpfcache.load(cache, KEY) is None


def test_entry_of_another_owner_is_ignored(cache: Path) -> None:
    f = cache / f"{KEY}.json"
    os.chown(f, 1000, 1000)
    assert bpfcache.load(cache, KEY) is None


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_entry_writable_by_others_is_ignored(cache: Path, mode: int) -> None:
    f = cache / f"{KEY}.json"
    os.chmod(f, mode)
    assert bpfcache.load(cache, KEY) is None
    os.chmod(f, 0o644)  # readable by others is no risk
    assert bpfcache.load(cache, KEY) is not None


def test_symlinked_entry_is_ignored(cache: Path, tmp_path: Path) -> None:
    f = cache / f"{KEY}.json"
    elsewhere = tmp_path / "elsewhere.json"
    f.rename(elsewhere)
    f.symlink_to(elsewhere)
    assert bpfcache.load(cache, KEY) is None


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777])
def test_directory_writable_by_others_is_ignored(cache: Path, mode: int) -> None:
    os.chmod(cache, mode)
    assert bpfcache.load(cache, KEY) is None
    assert not bpfcache.store(cache, "z" * 64, _entry())  # nor written to
    assert not (cache / f"{'z' * 64}.json").exists()


def test_directory_of_another_owner_is_ignored(cache: Path) -> None:
    os.chown(cache, 1000, 1000)
    assert bpfcache.load(cache, KEY) is None
    assert not bpfcache.store(cache, "z" * 64, _entry())


def test_symlinked_directory_is_ignored(cache: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(cache)
    assert bpfcache.load(link, KEY) is None


def test_env_chooses_or_disables_the_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(bpfcache.ENV_DIR, raising=False)
    assert bpfcache.cache_dir() == bpfcache.DEFAULT_DIR
    monkeypatch.setenv(bpfcache.ENV_DIR, str(tmp_path))
    assert bpfcache.cache_dir() == tmp_path
    monkeypatch.setenv(bpfcache.ENV_DIR, "off")
    assert bpfcache.cache_dir() is None


def test_map_references_become_indexes() -> None:
    insns = struct.pack("<BBhi", 0x18, 0x11, 0, 9) + bytes(8)  # r1 = map fd 9
    insns += struct.pack("<BBhi", 0xB7, 0x02, 0, 9)  # r2 = 9: not a map reference
    insns += struct.pack("<BBhi", 0x18, 0x23, 0, 4) + bytes(8)  # r3 = &map fd 4's value
    insns += struct.pack("<BBhi", 0x95, 0, 0, 0)
    assert bpfcache._relocs(insns, {4: 0, 9: 1}) == [(0, 1), (3, 0)]
    with pytest.raises(bpfcache.CacheError):
        bpfcache._relocs(insns, {9: 1})  # fd 4 is no table's: not cacheable


def test_store_keeps_the_newest_entries(cache: Path) -> None:
    keys = [f"{i:064d}" for i in range(bpfcache.KEEP + 2)]
    os.utime(cache / f"{KEY}.json", (1, 1))  # the fixture's entry is the oldest
    for i, k in enumerate(keys):
        assert bpfcache.store(cache, k, _entry())
        os.utime(cache / f"{k}.json", (1000 + i, 1000 + i))  # stored in this order
    left = sorted(p.stem for p in cache.glob("*.json"))
    assert left == sorted(keys[-bpfcache.KEEP :])  # the first entry (KEY's) and the oldest new ones went


def test_directory_in_a_directory_others_may_write_is_ignored(cache: Path) -> None:
    os.chmod(cache.parent, 0o1777)  # as /tmp: another user could have renamed ours and put theirs in its place
    assert bpfcache.load(cache, KEY) is None
    os.chmod(cache.parent, 0o755)
    assert bpfcache.load(cache, KEY) is not None
