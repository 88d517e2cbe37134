"""The `conveyor` command: registry, exit codes, one-line errors, data convert / inspect."""

from __future__ import annotations

import argparse
import io

import numpy as np
import pytest
from PIL import Image

from conveyor.cli import Command, CommandError
from conveyor.cli import main as cli_main
from conveyor.cli.main import build_parser, main
from conveyor.data import FixedLenFeature, TFRecordDataset, parse_single_example


def _one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("conveyor ")


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    assert "data" in capsys.readouterr().out
    assert main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    assert "convert" in out and "inspect" in out
    assert main(["data", "convert", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--shards" in out and "--split" in out and "--image-format" in out


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["data"], ["data", "convert"],
                                  ["data", "convert", "a.npz", "out", "--shards", "many"],
                                  ["data", "convert", "a.npz", "out", "--compression", "lz4"]])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv):
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err, "error:")


def test_registry_takes_new_subcommands(monkeypatch, capsys):
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--code", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        if args.code == 99:
            raise CommandError("the knob is wrong; turn it", exit_code=3)
        return args.code

    hello = Command("hello", "say hello", add_arguments, run)
    monkeypatch.setattr(cli_main, "COMMANDS", (*cli_main.COMMANDS, hello))
    monkeypatch.setattr(cli_main, "build_parser", lambda: build_parser(cli_main.COMMANDS))
    assert main(["hello"]) == 0
    assert main(["hello", "--code", "5"]) == 5
    assert main(["hello", "--code", "99"]) == 3
    _one_line_error(capsys.readouterr().err, "conveyor hello: error: the knob is wrong")


# ------------------------------------------------------------------------------ data convert


def _npz(tmp_path, **arrays):
    path = tmp_path / "src.npz"
    np.savez(path, **arrays)
    return str(path)


def test_convert_npz_then_inspect(tmp_path, capsys):
    src = _npz(tmp_path, x=np.arange(12, dtype=np.float32).reshape(6, 2), y=np.arange(6))
    out = tmp_path / "out"
    assert main(["data", "convert", src, str(out), "--shards", "2", "--compression", "gzip"]) == 0
    assert "6 records in 2 shard(s)" in capsys.readouterr().out
    files = sorted(str(p) for p in out.glob("train-*.tfrecord"))
    assert len(files) == 2 and (out / "dataset.json").exists()
    spec = {"y": FixedLenFeature([], "int64"), "x": FixedLenFeature([2], "float32")}
    rows = [parse_single_example(r, spec) for r in TFRecordDataset(files, compression_type="GZIP")]
    assert sorted(int(r["y"]) for r in rows) == list(range(6))

    assert main(["data", "inspect", *files, "--limit", "2"]) == 0
    text = capsys.readouterr().out
    assert "3 records" in text and "GZIP" in text and "all CRCs OK" in text
    assert "x/shape" in text and "float32" in text
    assert "total: 6 records in 2 files" in text


def test_convert_with_keys_rename_and_splits(tmp_path):
    src = _npz(tmp_path, x_train=np.zeros((10, 2, 2), np.uint8), y_train=np.arange(10), y_test=np.arange(3))
    out = tmp_path / "out"
    argv = ["data", "convert", src, str(out), "--keys", "image=x_train,label=y_train", "--image-key", "image",
            "--split", "train=0.6", "--split", "val=0.4", "--seed", "1"]
    assert main(argv) == 0
    files = sorted(str(p) for p in out.glob("*.tfrecord"))
    names = [f.rsplit("/", 1)[1] for f in files]
    assert names == ["train-00000-of-00001.tfrecord", "val-00000-of-00001.tfrecord"]
    spec = {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64")}
    rows = [parse_single_example(r, spec) for r in TFRecordDataset(files)]
    assert sorted(int(r["label"]) for r in rows) == list(range(10))
    assert np.asarray(Image.open(io.BytesIO(rows[0]["image"]))).shape == (2, 2)


def test_convert_image_folder(tmp_path, capsys):
    for c in ("b", "a"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        Image.new("RGB", (3, 3), (1, 2, 3)).save(tmp_path / "imgs" / c / "0.png")
    out = tmp_path / "out"
    assert main(["data", "convert", str(tmp_path / "imgs"), str(out), "--image-format", "jpeg"]) == 0
    assert (out / "classes.txt").read_text() == "a\nb\n"
    assert main(["data", "convert", str(tmp_path / "imgs"), str(out), "--image-key", "x"]) == 2
    _one_line_error(capsys.readouterr().err, "--image-key")


@pytest.mark.parametrize("make, needles", [
    (lambda p: str(p / "missing.npz"), ["missing.npz", "no such file"]),
    (lambda p: _npz(p, x=np.zeros(3), y=np.zeros(4)), ["x: 3", "y: 4"]),
    (lambda p: str((p / "notes.txt").write_text("x") and p / "notes.txt"), ["neither an .npz"]),
])
def test_bad_sources_are_one_line_and_exit_2(tmp_path, capsys, make, needles):
    assert main(["data", "convert", make(tmp_path), str(tmp_path / "out")]) == 2
    _one_line_error(capsys.readouterr().err, "conveyor data: error:", *needles)


def test_bad_split_is_exit_2(tmp_path, capsys):
    src = _npz(tmp_path, x=np.zeros(3))
    assert main(["data", "convert", src, str(tmp_path / "out"), "--split", "train"]) == 2
    _one_line_error(capsys.readouterr().err, "NAME=FRACTION")
    assert main(["data", "convert", src, str(tmp_path / "out"), "--split", "a=0.5", "--split", "b=0.2"]) == 2
    _one_line_error(capsys.readouterr().err, "sum to 0.7")


def test_unreadable_image_names_the_file(tmp_path, capsys):
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    assert main(["data", "convert", str(tmp_path / "imgs"), str(tmp_path / "out")]) == 2
    _one_line_error(capsys.readouterr().err, "broken.jpg")
    assert not list((tmp_path / "out").glob("*.tfrecord"))


# ------------------------------------------------------------------------------ data inspect


def test_inspect_reports_a_damaged_file_and_exits_1(tmp_path, capsys):
    src = _npz(tmp_path, y=np.arange(5))
    out = tmp_path / "out"
    assert main(["data", "convert", src, str(out)]) == 0
    path = out / "train-00000-of-00001.tfrecord"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF  # the last record's data CRC
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["data", "inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert "DAMAGED after 4 good records" in captured.out
    _one_line_error(captured.err, str(path), "CRC", "byte offset")


def test_inspect_missing_file_is_exit_2(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path / "nope.tfrecord")]) == 2
    _one_line_error(capsys.readouterr().err, "nope.tfrecord")


def test_inspect_shows_non_example_records(tmp_path, capsys):
    from conveyor.data import TFRecordWriter

    path = tmp_path / "raw.tfrecord"
    with TFRecordWriter(path, "ZLIB") as w:
        w.write(b"\xff\xff\xff")
    assert main(["data", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 records" in out and "ZLIB" in out and "not a tf.train.Example" in out


@pytest.mark.parametrize(("make", "kind"), [("char", "character device"), ("fifo", "FIFO")])
def test_inspect_says_what_a_non_regular_file_is(tmp_path, capsys, make, kind):
    import os

    if make == "char":
        path = "/dev/zero"
    else:
        path = str(tmp_path / "pipe")
        os.mkfifo(path)
    assert main(["data", "inspect", path]) == 2
    err = capsys.readouterr().err
    _one_line_error(err, path, kind, "not a regular file")
    assert "no such file" not in err


def test_inspect_with_the_wrong_compression_says_which_to_pass(tmp_path, capsys):
    from conveyor.data import TFRecordWriter

    path = tmp_path / "data.tfrecord.gz"
    with TFRecordWriter(path, "GZIP") as w:
        w.write(b"abc")
    assert main(["data", "inspect", str(path), "--compression", "none"]) == 1
    err = capsys.readouterr().err
    _one_line_error(err, str(path), "compression_type='GZIP'")
    assert "rewrite" not in err
    assert main(["data", "inspect", str(path)]) == 0
    assert "1 records" in capsys.readouterr().out
