"""conveyor.fileio: atomic_write never shows a partial file, follows the umask; one codec for bytes in JSON."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import conveyor.fileio as fileio
from conveyor.data.elements import from_json, to_json
from conveyor.fileio import atomic_write, bytes_from_json, bytes_to_json, umask_mode


def _leftovers(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


@pytest.mark.parametrize("existing", [True, False])
def test_a_crash_mid_write_leaves_the_old_file_or_none(tmp_path, monkeypatch, existing):
    target = tmp_path / "summary.json"
    if existing:
        target.write_bytes(b"old")
    real = fileio.write_file

    def torn(path, data, **kw):
        real(path, data[: len(data) // 2], **kw)  # half the bytes reach the disk, then the crash
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(fileio, "write_file", torn)
    with pytest.raises(OSError, match="simulated"):
        atomic_write(target, b"new contents")
    assert (target.read_bytes() == b"old") if existing else not target.exists()
    assert _leftovers(tmp_path, target.name) == []  # the temporary file is gone too


def test_a_failed_rename_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    target.write_bytes(b"step-00000001\n")

    def replace(src, dst):
        raise OSError("crash before the rename (simulated)")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="simulated"):
        atomic_write(target, b"step-00000002\n")
    monkeypatch.undo()
    assert target.read_bytes() == b"step-00000001\n" and _leftovers(tmp_path, "latest") == []


def test_replaces_in_one_rename_of_a_finished_hidden_file(tmp_path, monkeypatch):
    target = tmp_path / "out" / "trace.json"  # missing parent folders are made
    seen = []
    real = os.replace

    def replace(src, dst):
        seen.append((Path(src).name, Path(src).read_bytes(), dst.exists() and dst.read_bytes()))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    atomic_write(target, b"first")
    atomic_write(target, b"second", fsync=False)
    monkeypatch.undo()
    assert target.read_bytes() == b"second" and _leftovers(target.parent, target.name) == []
    # the temp file is complete when it is renamed, and until then readers see the old bytes
    assert [(old, new) for _, new, old in seen] == [(False, b"first"), (b"first", b"second")]
    assert all(name.startswith(".tmp-trace.json-") for name, _, _ in seen)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        assert umask_mode() == 0o666 & ~umask
        fresh = atomic_write(tmp_path / "fresh", b"x")
        (tmp_path / "replaced").write_bytes(b"old")
        os.chmod(tmp_path / "replaced", 0o600)
        replaced = atomic_write(tmp_path / "replaced", b"y")  # the new file's mode, not the old one's
        exact = atomic_write(tmp_path / "exact", b"z", mode=0o640)
    finally:
        os.umask(old)
    assert oct(fresh.stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert oct(replaced.stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert oct(exact.stat().st_mode & 0o777) == oct(0o640)



def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write/fsync raise it: no file named


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    # "[Errno 28] No space left on device" alone: the user could not tell which file, nor which disk
    if os.path.exists("/dev/full"):  # a real ENOSPC from the kernel, on flush
        with pytest.raises(OSError, match=r"No space left on device: '/dev/full'") as e:
            fileio.write_file("/dev/full", b"x", fsync=False)
        assert e.value.errno == errno.ENOSPC and e.value.filename == "/dev/full"
    monkeypatch.setattr(fileio.os, "fsync", _disk_full)
    target = tmp_path / "summary.json"
    with pytest.raises(OSError) as e:
        atomic_write(target, b"{}")
    assert e.value.errno == errno.ENOSPC and isinstance(e.value.filename, str)
    assert Path(e.value.filename).parent == tmp_path and "summary.json" in e.value.filename
    assert not target.exists() and _leftovers(tmp_path, "") == []
    with pytest.raises(OSError, match=rf"No space left on device: '{tmp_path}'"):
        fileio.sync_dir(tmp_path)


def test_an_error_that_names_a_file_is_raised_as_it_is(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        fileio.write_file(tmp_path / "no" / "such", b"x")
    assert e.value.filename == str(tmp_path / "no" / "such") and e.value.__cause__ is None

def test_fileio_needs_only_the_standard_library():
    code = "import sys, conveyor.fileio; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------------
# bytes in JSON


def test_bytes_codec_round_trips_and_refuses_damage():
    for data in (b"", b"\x00\xff", bytes(range(256)), bytearray(b"abc")):
        text = bytes_to_json(data)
        assert json.loads(json.dumps(text)) == text and bytes_from_json(text) == bytes(data)
    assert bytes_to_json(b"\x00\xff") == "AP8="  # standard base64 with padding: the format already on disk
    for damaged in ("AP8", "AP8=!", "A P8="):
        with pytest.raises(ValueError):
            bytes_from_json(damaged)
    with pytest.raises(TypeError):
        bytes_from_json(5)


def test_elements_keep_their_json_form():
    """Iterator states written before the shared codec still load: same keys, same base64."""
    assert to_json(b"\x00\xff") == {"b": "AP8="}
    assert to_json(np.array([1, 2], dtype="<u2")) == {"nd": "AQACAA==", "dtype": "<u2", "shape": [2]}
    assert from_json({"b": "AP8="}) == b"\x00\xff"
    back = from_json({"nd": "AQACAA==", "dtype": "<u2", "shape": [2]})
    assert back.tolist() == [1, 2] and back.dtype == np.dtype("<u2")


def test_format_bytes_for_people():
    from conveyor.fileio import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 2**20, 3 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3072.0 GiB"]
