"""TFRecordDataset: files in order, the three compressions, parallel reads, damage, resume."""

from __future__ import annotations

import os
import re
import threading

import pytest

from conveyor.data.base import AUTOTUNE
from conveyor.data.errors import DataLossError, InvalidArgumentError
from conveyor.data.pipeline import Dataset, TFRecordDataset
from conveyor.data.records import TFRecordWriter
from resume_check import assert_resumes

COMPRESSIONS = [None, "GZIP", "ZLIB"]
SIZES = {"f0": 4, "f1": 0, "f2": 3, "f3": 6}  # f1 is an empty file


def write_files(directory, compression) -> dict[str, list[bytes]]:
    out = {}
    for name, n in SIZES.items():
        path = os.path.join(directory, f"{name}.tfrecord")
        records = [f"{name}-record-{i}".encode() * (i + 1) for i in range(n)]
        with TFRecordWriter(path, compression) as w:
            for r in records:
                w.write(r)
        out[path] = records
    return out


@pytest.fixture(params=COMPRESSIONS, ids=["none", "gzip", "zlib"])
def files(request, tmp_path):
    return request.param, write_files(str(tmp_path), request.param)


def round_robin(lists: list[list[bytes]], cycle: int) -> list[bytes]:
    """§6 with block_length 1 (what num_parallel_reads means), over lists."""
    pending, cur, out = list(lists), [None] * cycle, []
    ci, end = 0, False
    while not end or any(c is not None for c in cur):
        if cur[ci] is not None:
            if cur[ci]:
                out.append(cur[ci].pop(0))
            else:
                cur[ci] = None
            ci = (ci + 1) % cycle
        elif pending:
            cur[ci] = list(pending.pop(0))
        else:
            end = True
            ci = (ci + 1) % cycle
    return out


def test_reads_files_in_order(files):
    compression, contents = files
    expected = [r for records in contents.values() for r in records]
    out = list(TFRecordDataset(list(contents), compression_type=compression))
    assert out == expected
    assert all(type(r) is bytes for r in out)


def test_file_names_as_bytes_single_str_and_dataset(tmp_path):
    contents = write_files(str(tmp_path), None)
    paths = list(contents)
    expected = [r for records in contents.values() for r in records]
    assert list(TFRecordDataset([os.fsencode(p) for p in paths])) == expected
    assert list(TFRecordDataset(paths[0])) == contents[paths[0]]
    listed = Dataset.list_files(os.path.join(str(tmp_path), "*.tfrecord"), shuffle=False)
    assert list(TFRecordDataset(listed)) == expected
    assert list(TFRecordDataset(paths, compression_type="")) == expected


@pytest.mark.parametrize("num_parallel_reads", [2, 3, AUTOTUNE])
def test_parallel_reads_interleave_the_files(files, num_parallel_reads):
    compression, contents = files
    paths = list(contents)
    out = list(TFRecordDataset(paths, compression_type=compression, num_parallel_reads=num_parallel_reads))
    sequential = Dataset.from_tensor_slices(paths).interleave(
        lambda p: TFRecordDataset(p, compression_type=compression),
        cycle_length=num_parallel_reads, block_length=1)
    assert out == list(sequential)
    if num_parallel_reads != AUTOTUNE:
        assert out == round_robin(list(contents.values()), num_parallel_reads)


def damage(path: str, record: int = 1) -> None:
    """Flip a byte inside the data of the given record of an uncompressed file."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        pos = 0
        for _ in range(record):
            n = int.from_bytes(data[pos:pos + 8], "little")
            pos += 12 + n + 4
        data[pos + 12] ^= 0xFF
        f.seek(0)
        f.write(data)


@pytest.mark.parametrize("num_parallel_reads", [None, 2])
def test_damaged_file_raises_data_loss_naming_the_file(tmp_path, num_parallel_reads):
    contents = write_files(str(tmp_path), None)
    paths = list(contents)
    bad = paths[2]
    damage(bad, record=1)
    it = iter(TFRecordDataset(paths, num_parallel_reads=num_parallel_reads))
    got = []
    with pytest.raises(DataLossError) as excinfo:
        for r in it:
            got.append(r)
    it.close()
    assert excinfo.value.path == bad
    assert bad in str(excinfo.value)
    assert contents[bad][0] in got and contents[bad][1] not in got


def test_truncated_compressed_file_raises_data_loss(tmp_path):
    contents = write_files(str(tmp_path), "GZIP")
    path = list(contents)[3]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(DataLossError, match=path):
        list(TFRecordDataset(list(contents), compression_type="GZIP"))


def test_missing_file_names_the_file(tmp_path):
    contents = write_files(str(tmp_path), None)
    missing = os.path.join(str(tmp_path), "nope.tfrecord")
    it = iter(TFRecordDataset([list(contents)[0], missing]))
    assert len([next(it) for _ in range(4)]) == 4
    with pytest.raises(FileNotFoundError, match="nope.tfrecord") as excinfo:
        next(it)
    assert excinfo.value.filename == missing
    it.close()



def _within(seconds: float, fn, release=None):
    """``fn()``'s result or error, failing the test if it blocks longer than ``seconds`` (then
    ``release()`` unblocks it, so that the thread ends)."""
    done: dict = {}

    def run():
        try:
            done["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            done["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if release is not None:
            release()
        thread.join(10)
        pytest.fail(f"blocked for {seconds} s")
    if "error" in done:
        raise done["error"]
    return done["result"]


def _fifo(tmp_path, name="pipe.tfrecord"):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    path = str(tmp_path / name)
    os.mkfifo(path)
    return path, lambda: os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer that comes and goes


@pytest.mark.parametrize("num_parallel_reads", [None, 2])
def test_a_fifo_in_the_file_list_is_refused_not_waited_on(tmp_path, num_parallel_reads):
    # A FIFO blocked its reader until some writer came: forever, if none did.
    contents = write_files(str(tmp_path), None)
    fifo, release = _fifo(tmp_path)
    ds = TFRecordDataset([list(contents)[0], fifo], num_parallel_reads=num_parallel_reads)
    with pytest.raises(InvalidArgumentError, match=rf"{re.escape(fifo)} is a FIFO \(named pipe\), not a regular file: "
                                                   rf"TFRecord files are read from regular files only"):
        _within(20, lambda: list(ds), release)


def test_a_device_is_refused_as_not_a_file(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    with pytest.raises(InvalidArgumentError, match="/dev/zero is a character device, not a regular file"):
        _within(20, lambda: list(TFRecordDataset(["/dev/zero"])))


def test_list_files_refuses_a_fifo_it_matches(tmp_path):
    write_files(str(tmp_path), None)
    fifo, release = _fifo(tmp_path, "f9.tfrecord")
    pattern = os.path.join(str(tmp_path), "*.tfrecord")
    with pytest.raises(InvalidArgumentError, match=rf"{re.escape(fifo)} \(matched by {re.escape(pattern)}\) is a FIFO "
                                                   r"\(named pipe\), "
                                                   r"not a regular file: .*narrow the pattern"):
        _within(20, lambda: list(Dataset.list_files(pattern, shuffle=False).interleave(TFRecordDataset)), release)
    os.unlink(fifo)
    assert len(list(Dataset.list_files(pattern, shuffle=False))) == len(SIZES)  # folders and files still match

@pytest.mark.parametrize("bad", ["gzip", "SNAPPY", "zip", 3])
def test_invalid_compression_type(bad):
    with pytest.raises(InvalidArgumentError, match="compression_type"):
        TFRecordDataset(["x.tfrecord"], compression_type=bad)


def test_invalid_num_parallel_reads():
    with pytest.raises(InvalidArgumentError):
        TFRecordDataset(["x.tfrecord"], num_parallel_reads=0)


def test_resume_mid_file_and_across_file_boundaries(files):
    compression, contents = files
    paths = list(contents)
    # 13 records: f0 has 0..3, f1 none, f2 4..6, f3 7..12.
    assert_resumes(lambda: TFRecordDataset(paths, compression_type=compression),
                   ks=[0, 1, 3, 4, 5, 7, 10, 12, 13])


def test_resume_parallel_reads(files):
    compression, contents = files
    paths = list(contents)
    assert_resumes(lambda: TFRecordDataset(paths, compression_type=compression, num_parallel_reads=2),
                   ks=[0, 2, 5, 8, 12, 13])


def test_resume_after_shuffled_file_list_and_record_shuffle(tmp_path):
    contents = write_files(str(tmp_path), "ZLIB")
    pattern = os.path.join(str(tmp_path), "*.tfrecord")

    def make():
        files = Dataset.list_files(pattern, seed=3)
        return TFRecordDataset(files, compression_type="ZLIB", num_parallel_reads=3).shuffle(4, seed=1)

    assert sorted(make()) == sorted(r for records in contents.values() for r in records)
    assert_resumes(make, ks=[0, 3, 6, 11])
