"""The whole "new approach" pipeline over TFRecord files: semantics, resume, interruption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from conveyor.data import (
    AUTOTUNE,
    Dataset,
    FixedLenFeature,
    TFRecordDataset,
    TFRecordWriter,
    encode_example,
    parse_single_example,
)
from resume_check import assert_resumes, canon

FEATURES = {"x": FixedLenFeature([3], "float32"), "label": FixedLenFeature([], "int64")}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    for s in range(4):
        with TFRecordWriter(str(d / f"train-{s:05d}-of-00004.tfrecord")) as w:
            for i in range(s * 100, s * 100 + 25 + 5 * s):  # uneven shards
                w.write(encode_example({"x": np.full(3, i, np.float32), "label": i}))
    return str(d / "train-*.tfrecord")


def parse(record):
    ex = parse_single_example(record, FEATURES)
    return ex["x"] + np.random.random(3).astype(np.float32) * 0, ex["label"]


def augment(record):
    x, label = parse(record)
    return x + np.float32(np.random.randint(0, 100)), label


def new_approach(pattern, parallel: bool, fn=parse, rank=0, world=1):
    par = AUTOTUNE if parallel else None
    files = Dataset.list_files(pattern, shuffle=False).shard(world, rank)
    return (files.shuffle(4, seed=1)
                 .interleave(lambda f: TFRecordDataset(f), cycle_length=2, block_length=3, num_parallel_calls=par)
                 .shuffle(16, seed=2)
                 .repeat(2)
                 .map(fn, num_parallel_calls=par)
                 .batch(8, drop_remainder=False)
                 .prefetch(AUTOTUNE if parallel else 1))


def labels_of(ds):
    return [int(v) for batch in ds for v in batch[1]]


def test_every_record_once_per_epoch(shards):
    got = labels_of(new_approach(shards, parallel=True))
    every = [i for s in range(4) for i in range(s * 100, s * 100 + 25 + 5 * s)]
    assert sorted(got) == sorted(every * 2)
    assert sorted(got[:len(every)]) == sorted(every)  # shuffle().repeat() keeps epochs apart


def test_parallel_equals_sequential(shards):
    seq = [canon(b) for b in new_approach(shards, parallel=False)]
    par = [canon(b) for b in new_approach(shards, parallel=True)]
    assert seq == par


def test_workers_split_the_files(shards):
    parts = [labels_of(new_approach(shards, parallel=True, rank=r, world=2)) for r in range(2)]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(labels_of(new_approach(shards, parallel=True)))


@pytest.mark.parametrize("parallel", [False, True])
def test_whole_pipeline_resumes_exactly(shards, parallel):
    assert_resumes(lambda: new_approach(shards, parallel), ks=[0, 1, 7, 18, 19, 37])


def test_random_augmentation_pipeline_resumes_exactly(shards):
    assert_resumes(lambda: new_approach(shards, True, fn=augment), ks=[0, 5, 21], seed=7)


def test_unordered_pipeline_resumes_without_loss(shards):
    def make():
        files = Dataset.list_files(shards, shuffle=False)
        return (files.interleave(lambda f: TFRecordDataset(f), cycle_length=2, num_parallel_calls=2,
                                 deterministic=False)
                .map(parse, num_parallel_calls=2, deterministic=False).batch(5).unbatch().prefetch(2))

    assert_resumes(make, ks=[0, 3, 40, 101], deterministic=False)


def test_state_refuses_a_different_pipeline(shards):
    it = iter(new_approach(shards, parallel=False))
    next(it)
    state = it.state_dict()
    other = iter(new_approach(shards, parallel=False).take(3))
    with pytest.raises(ValueError, match="different pipeline"):
        other.load_state_dict(state)


SIGINT_SCRIPT = textwrap.dedent("""
    import sys, time
    from conveyor.data import Dataset, AUTOTUNE
    def slow(x):
        time.sleep(0.001)
        return x
    ds = Dataset.range(10**9).map(slow, num_parallel_calls=2).batch(4).prefetch(AUTOTUNE)
    for i, _ in enumerate(ds):
        if i == 5:
            print("running", flush=True)
""")


@pytest.mark.multiprocess
def test_ctrl_c_leaves_no_process(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(SIGINT_SCRIPT)
    # A terminal's foreground job has Ctrl-C's default action. Run from a background job of a non-interactive
    # shell (`bash .ci/run &`), this process inherits SIGINT ignored, and so would the script, whose Python
    # then installs no KeyboardInterrupt handler and ignores the signal: give it the terminal's disposition.
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == b"running"
    kids = psutil.Process(proc.pid).children(recursive=True)
    assert len(kids) == 2
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running 20 s after Ctrl-C; its stderr:\n{proc.stderr.read().decode()[-3000:]}")
    assert b"KeyboardInterrupt" in proc.stderr.read()
    deadline = time.monotonic() + 5
    while any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.multiprocess
def test_killed_consumer_leaves_no_worker(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(SIGINT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"running"
    kids = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
