"""CIFAR-10 case study, part 1: input-pipeline throughput against the number of workers, old approach against new.

Run through `benchmarks/case_study.py`.

Data: a CIFAR-10 archive in the official binary format (`cifar-10-binary.tar.gz`: 1 label byte + 3,072
bytes of R, G, B planes per record), made up here (smooth images plus noise, which compress in PNG about
as real photos do) and converted by `conveyor.data.cifar.convert_cifar` twice: into one train file (the
old approach's input) and into `--shards` train files (the new approach's). Cached in `<data>/` and remade
only when its manifest does not match.

Every record gets the CIFAR example's own training map (`examples/cifar10/train.py`: parse the Example,
decode the PNG, pad-4 random crop, random flip, normalise to float32 CHW). The accelerator is simulated by
a fixed sleep per batch (`compute_ms`), which frees the CPU as a GPU would: the figure shows only whether
the input keeps up. By default the sleep equals one core's CPU time for one batch's input (`calibrate`):
an accelerator that one core can just keep fed, so the old approach is input-bound from the first worker
on, and the new one can scale until no core per worker is left.

A job of K workers is K processes forked from the driver, each building its pipeline with the same shard
logic as a `conveyor run -n K` task (`shard(K, rank)`); all wait for one "go", consume `warmup` batches, then
`batches` timed batches each, one sleep after each. Job samples/s = K x batches x batch / the slowest
worker's time. Contenders:

- `old`: one reader over the one file, sequential map, small prefetch; the one file cannot be split by
  files, so each worker reads and decodes every record and keeps every K-th (as tf.distribute's DATA
  auto-shard policy does): `TFRecordDataset(file).shuffle().repeat().map(fn).shard(K, r).batch(B).prefetch(1)`.
- `old_sharded`: the same one reader and sequential map, the records sharded before the map (the most
  the old approach can do with one file): `TFRecordDataset(file).shard(K, r).shuffle().repeat().map(fn)...`.
- `new`: `list_files(pattern).shard(K, r).interleave(TFRecordDataset, cycle_length=4,
  num_parallel_calls=AUTOTUNE).shuffle().repeat().map(fn, num_parallel_calls=AUTOTUNE).batch(B).prefetch(AUTOTUNE)`.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import multiprocessing as mp
import os
import shutil
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from conveyor.data import AUTOTUNE, Dataset, TFRecordDataset  # noqa: E402
from conveyor.data.cifar import convert_cifar  # noqa: E402
from conveyor.data.records import TFRecordReader  # noqa: E402
from conveyor.fileio import atomic_write  # noqa: E402
from pipeline_contenders import CpuProbe  # noqa: E402
from pipeline_workloads import make_images  # noqa: E402

HERE = Path(__file__).resolve()
EXAMPLE = HERE.parents[1] / "examples" / "cifar10" / "train.py"
DATA_VERSION = 1
CONTENDERS_SPEC = (
    h.Contender("old", "one file, sequential map, prefetch 1; every worker decodes every record, keeps its share"),
    h.Contender("old_sharded", "one file, sequential map, prefetch 1; records sharded before the map"),
    h.Contender("new", "sharded files, list_files + shard, parallel interleave, shuffle, parallel map (AUTOTUNE), "
                       "batch, prefetch (AUTOTUNE)"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)


# ==================================================================================================
# Data: a made-up archive in the official format, converted by conveyor's CIFAR converter.
# ==================================================================================================


def write_archive(path: Path, train_images: int, seed: int = 0) -> Path:
    """A cifar-10-binary.tar.gz in the official layout: 5 train batches, a test batch, batches.meta.txt."""
    rng = np.random.default_rng(seed)
    test_images = max(10, train_images // 10)
    sizes = [len(part) for part in np.array_split(np.arange(train_images), 5)] + [test_images]
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    members = {"batches.meta.txt": "".join(f"class{i}\n" for i in range(10)).encode()}
    for name, n in zip(names, sizes, strict=True):
        planes = make_images(rng, n, 32).transpose(0, 3, 1, 2).reshape(n, -1)  # HWC -> R, G, B planes
        labels = rng.integers(0, 10, (n, 1), dtype=np.uint8)
        members[name] = np.concatenate([labels, planes], axis=1).tobytes()
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def prepare_data(root: Path, train_images: int, shards: int) -> dict[str, Any]:
    """The one-file and the sharded train files (cached); their paths and the manifest."""
    params = {"version": DATA_VERSION, "train_images": train_images, "shards": shards}
    folder = Path(root) / f"cifar-synthetic-{train_images}-{shards}"
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest["params"] != params or not all(Path(f).is_file() for f in manifest["files"]):
            manifest = None
    except (OSError, ValueError, KeyError):
        manifest = None
    if manifest is None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        archive = write_archive(folder / "cifar-10-binary.tar.gz", train_images)
        convert_cifar(archive, folder / "one-file", 1)
        convert_cifar(archive, folder / "sharded", shards)
        one = sorted(str(p) for p in (folder / "one-file").glob("train-*.tfrecord"))
        sharded = sorted(str(p) for p in (folder / "sharded").glob("train-*.tfrecord"))
        manifest = {"params": params, "one_file": one[0], "pattern": str(folder / "sharded" / "train-*.tfrecord"),
                    "files": [*one, *sharded], "archive_bytes": archive.stat().st_size,
                    "train_bytes": sum(os.path.getsize(f) for f in sharded),
                    "seconds": round(time.perf_counter() - started, 2)}
        atomic_write(manifest_path, json.dumps(manifest, indent=1).encode(), fsync=False)
    return manifest


@functools.cache
def load_example():
    """examples/cifar10/train.py as a module (a script, not a package module), loaded once per process."""
    spec = importlib.util.spec_from_file_location("conveyor_example_cifar10", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calibrate(one_file: str, batch: int, records: int = 512) -> dict[str, Any]:
    """One core's time to turn `batch` records into training examples (a plain loop, no pipeline).

    Counted in CPU seconds of this thread, not wall seconds: on a shared machine the wall time says how much
    of a core the loop got, the CPU time what the work costs on a core of its own.
    """
    parse = load_example().example(training=True)
    with TFRecordReader(one_file) as reader:
        recs = [r for _, r in zip(range(records), reader, strict=False)]
    for r in recs[:32]:  # warm the decoder and the caches
        parse(r)
    wall, cpu = time.perf_counter(), time.thread_time()
    for r in recs:
        parse(r)
    cpu, wall = (time.thread_time() - cpu) / len(recs), (time.perf_counter() - wall) / len(recs)
    return {"records": len(recs), "seconds_per_record": cpu, "seconds_per_batch": cpu * batch,
            "wall_seconds_per_record": wall}


# ==================================================================================================
# Worker side: one process of a job.
# ==================================================================================================


def build_pipeline(contender: str, config: dict[str, Any], parse: Callable) -> Dataset:
    """Worker `rank` of `world`'s pipeline; endless unless `config["epochs"]` says how many."""
    k, r, b, buf, epochs = config["world"], config["rank"], config["batch"], config["shuffle"], config.get("epochs")
    if contender == "old":
        records = TFRecordDataset(config["one_file"]).shuffle(buf, seed=0).repeat(epochs)
        return records.map(parse).shard(k, r).batch(b, drop_remainder=True).prefetch(1)
    if contender == "old_sharded":
        records = TFRecordDataset(config["one_file"]).shard(k, r).shuffle(buf, seed=0).repeat(epochs)
        return records.map(parse).batch(b, drop_remainder=True).prefetch(1)
    files = Dataset.list_files(config["pattern"], shuffle=False).shard(k, r)
    records = files.interleave(TFRecordDataset, cycle_length=4, num_parallel_calls=AUTOTUNE)
    records = records.shuffle(buf, seed=0).repeat(epochs)
    return records.map(parse, num_parallel_calls=AUTOTUNE).batch(b, drop_remainder=True).prefetch(AUTOTUNE)


def worker(config: dict[str, Any], conn: Connection) -> None:
    """Say "ready", wait for "go", warm up, time `batches` batches with a sleep after each, send the result.

    The pipeline starts only after "go" (its work starts on the first `next`), so no worker fills its buffers
    while waiting for the others, and every timed window starts after the same warm-up. Messages are JSON
    bytes on the pipe; an exception is sent as {"error": traceback}.
    """
    it = None
    try:
        it = iter(build_pipeline(config["contender"], config, load_example().example(training=True)))
        compute = config["compute_ms"] / 1000
        conn.send_bytes(b'"ready"')
        if not conn.poll(config["timeout"]) or json.loads(conn.recv_bytes()) != "go":
            return  # the driver gave up on this measurement
        for _ in range(config["warmup"]):
            next(it)
            time.sleep(compute)
        waited = 0.0
        started = time.perf_counter()
        for _ in range(config["batches"]):
            t0 = time.perf_counter()
            images, labels = next(it)
            waited += time.perf_counter() - t0
            if images.shape != (config["batch"], 3, 32, 32) or len(labels) != config["batch"]:
                raise RuntimeError(f"batch of shape {images.shape}, {len(labels)} labels")
            time.sleep(compute)
        elapsed = time.perf_counter() - started
        conn.send_bytes(json.dumps({"rank": config["rank"], "seconds": elapsed, "input_wait_seconds": waited}).encode())
        conn.poll(config["timeout"])  # stay alive (and countable) until the driver has read every worker's CPU time
    except BaseException:
        conn.send_bytes(json.dumps({"error": traceback.format_exc()[-1500:]}).encode())
        raise
    finally:
        if it is not None:
            it.close()


# ==================================================================================================
# Driver side: one measurement = one job of K worker processes.
# ==================================================================================================


class Job:
    """K worker processes forked from this one (the example and its imports are loaded once, here), each with a
    pipe; stopped on every exit path. Forking keeps start-up to milliseconds: a worker would otherwise spend
    seconds importing torch (the example's module imports it) before its pipeline starts."""

    def __init__(self, configs: Sequence[dict[str, Any]]):
        ctx = mp.get_context("fork")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for config in configs:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(config, theirs), name=f"case-study-worker-{config['rank']}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def collect(self, deadline: float) -> list[Any]:
        """One message from every worker, in rank order; ContenderFailed naming the worker that failed."""
        got: dict[int, Any] = {}
        while len(got) < len(self.conns):
            pending = [c for r, c in enumerate(self.conns) if r not in got]
            ready = mp_wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [r for r in range(len(self.conns)) if r not in got]
                raise h.ContenderFailed(f"timed out waiting for worker(s) {late}")
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    message = json.loads(conn.recv_bytes())
                except EOFError:
                    self.procs[rank].join(5)
                    raise h.ContenderFailed(f"worker {rank} exited (status {self.procs[rank].exitcode})") from None
                if isinstance(message, dict) and "error" in message:
                    raise h.ContenderFailed(f"worker {rank} failed: {message['error'].strip()}")
                got[rank] = message
        return [got[r] for r in range(len(self.conns))]

    def send(self, word: str) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(json.dumps(word).encode())
            except OSError:
                pass  # that worker is gone; collect() says so

    def stop(self) -> None:
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def run_point(contender: str, world: int, settings: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One job: (job samples/s, its details)."""
    base = {key: settings[key] for key in ("one_file", "pattern", "batch", "shuffle", "compute_ms", "warmup",
                                           "batches", "timeout")}
    job = Job([{**base, "contender": contender, "world": world, "rank": r} for r in range(world)])
    try:
        job.collect(time.monotonic() + settings["timeout"])
        with CpuProbe() as probe:
            job.send("go")
            workers = job.collect(time.monotonic() + settings["timeout"])
        job.send("bye")
    finally:
        job.stop()
    slowest = max(w["seconds"] for w in workers)
    rate = world * settings["batches"] * settings["batch"] / slowest
    idle = [w["input_wait_seconds"] / w["seconds"] for w in workers]
    return rate, {"samples_per_second": rate, "slowest_seconds": slowest, "workers": workers,
                  "accelerator_idle_fraction": float(np.mean(idle)), "cores_used": probe.result["own_cores"],
                  "other_cores": probe.result["other_cores"], "steal_cores": probe.result["steal_cores"]}


# ==================================================================================================
# Rounds, derived values, table.
# ==================================================================================================


def point(contender: str, world: int) -> str:
    return f"{contender}@{world}"


def run_rounds(contenders: Sequence[str], workers: Sequence[int], settings: dict[str, Any],
               repeats: int) -> dict[str, Any]:
    """Every (contender, K) per round; the contenders of one K back to back, so their ratio sees the same machine."""
    names = [point(c, k) for k in workers for c in contenders]

    def measure(name: str, rnd: int) -> tuple[float, dict[str, Any]]:
        contender, _, world = name.partition("@")
        return run_point(contender, int(world), settings)

    def describe(rate: float, run: dict[str, Any]) -> str:
        return (f"{rate:.0f} samples/s, accelerator idle {run['accelerator_idle_fraction']:.0%}, "
                f"{run['cores_used']:.2f} cores used (other processes {run['other_cores']:.2f})")

    return h.interleaved_rounds(names, repeats, measure, describe=describe)


def derive(res: dict[str, Any], contenders: Sequence[str], workers: Sequence[int],
           settings: dict[str, Any], cores: int) -> dict[str, Any]:
    """Medians per (contender, K); speedup and efficiency against the smallest K, new against each old, per round."""
    s, runs, base = res["samples"], res["runs"], min(workers)

    def per_k(fn: Callable[[str, int], Any]) -> dict[str, dict[str, Any]]:
        return {c: {str(k): fn(c, k) for k in workers} for c in contenders}

    def run_median(key: str) -> dict[str, dict[str, Any]]:
        return per_k(lambda c, k: h.median([r and r[key] for r in runs[point(c, k)]]))

    speedup = per_k(lambda c, k: h.median(h.paired(s[point(c, k)], s[point(c, base)])))
    batch_s = settings["compute_ms"] / 1000
    d = {
        "baseline_workers": base,
        "samples_per_second": per_k(lambda c, k: h.median(s[point(c, k)])),
        "speedup": speedup,
        "efficiency": {c: {key: h.ratio(v, int(key) / base) for key, v in sp.items()} for c, sp in speedup.items()},
        "accelerator_idle_fraction": run_median("accelerator_idle_fraction"),
        "cores_used": run_median("cores_used"),
        "other_cores": run_median("other_cores"),
        "other_cores_overall": h.median([r and r["other_cores"] for v in runs.values() for r in v]),
        "bounds": {"accelerator": {str(k): k * settings["batch"] / batch_s for k in workers},
                   "all_cores_decoding": cores * settings["batch"] / settings["calibration"]["seconds_per_batch"]},
    }
    if "new" in contenders:
        d["new_vs"] = {old: {str(k): h.median(h.paired(s[point("new", k)], s[point(old, k)])) for k in workers}
                       for old in contenders if old != "new"}
    return d


def format_table(res: dict[str, Any], d: dict[str, Any], contenders: Sequence[str], workers: Sequence[int],
                 settings: dict[str, Any], cores: int) -> str:
    cal = settings["calibration"]
    head = (f"input pipeline: CIFAR-shaped PNG TFRecords ({settings['train_images']:,} train images; 1 file for "
            f"old*, {settings['shards']} for new), the CIFAR example's training map, batch {settings['batch']}; "
            f"accelerator = "
            f"sleep {settings['compute_ms']:.1f} ms per batch (one core's CPU time for a batch's input, measured: "
            f"{cal['seconds_per_batch'] * 1000:.1f} ms); {settings['batches']} timed batches per worker after "
            f"{settings['warmup']}; {cores} cores\n"
            f"samples/s = K x batches x batch / slowest worker's time; speedup against {d['baseline_workers']} "
            f"worker(s), same round; medians over rounds")
    rows = [("contender", "workers", "samples/s", "speedup", "efficiency", "accel. idle", "cores used", "others",
             "per round")]
    for c in contenders:
        for k in workers:
            key = str(k)
            rows.append((c, key, h.fmt(d["samples_per_second"][c][key], ".0f"), h.fmt(d["speedup"][c][key], ".2f"),
                         h.fmt(d["efficiency"][c][key], ".0%"), h.fmt(d["accelerator_idle_fraction"][c][key], ".0%"),
                         h.fmt(d["cores_used"][c][key], ".2f"), h.fmt(d["other_cores"][c][key], ".2f"),
                         h.fmt_all(res["samples"][point(c, k)], ".0f")))
    lines = [head, "", h.format_rows(rows, left=(0, 8))]
    bounds = d["bounds"]
    lines.append("bounds: accelerator (K x batch / sleep) " + ", ".join(
        f"{k}: {v:.0f}" for k, v in bounds["accelerator"].items())
        + f"; every core decoding (cores x batch / one core's batch time) {bounds['all_cores_decoding']:.0f}")
    for old, by_k in d.get("new_vs", {}).items():
        lines.append(f"new / {old} (paired per round, median): "
                     + ", ".join(f"{k} worker(s) {h.fmt(v, '.2f')}" for k, v in by_k.items()))
    lines.append("(others = cores busy with other processes on the machine during the measurement)")
    return "\n".join(lines)

