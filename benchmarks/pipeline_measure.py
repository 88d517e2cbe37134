"""The input-pipeline benchmark's measurements: the idle fraction and memory runs over the new approach,
the guard that stops a runaway one, and one workload measured end to end in interleaved rounds.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from conveyor.data.records import TFRecordReader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from machine import cpu_cores, loadavg  # noqa: E402
from pipeline_contenders import (  # noqa: E402
    CpuProbe,
    batch_len,
    parallel_dataset,
    run_dataloader,
    run_parallel,
    run_parallel_plain,
    run_sequential,
    run_single_thread,
    run_tfdata,
    tensorflow_available,
)
from pipeline_workloads import Workload, file_pattern, generate_workload  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Idle fraction and memory (over the new approach)
# ---------------------------------------------------------------------------------------------


def measure_idle(files: Sequence[str], wl: Workload, parallel_rate: float, n_batches: int,
                 warmup_batches: int = 2, busy_fraction: float = 0.8, block: int = 60,
                 calibrate: int = 16, drain: int = 16, fixed_sleep: float | None = None) -> dict[str, Any]:
    """A consumer that 'computes' by sleeping `busy_fraction` x the pipeline's per-batch time; the
    idle fraction is its time blocked in next() over its wall time.

    The machine's speed drifts by tens of percent within a minute, so a per-batch time measured
    in an earlier phase would make the consumer too fast or too slow. The run is therefore made of
    blocks: `drain` batches at full speed empty the pipeline's buffers (batches taken from a
    buffer would make it look faster than it produces), `calibrate` more measure its current
    per-batch time T, then `block` batches sleep `busy_fraction` x T each; only the sleeping
    batches count. `parallel_rate` (from the timed rounds) is kept for reference.

    With `fixed_sleep` the consumer sleeps that long per batch instead (no calibration): used for
    S = 80 % of the per-batch CPU work (batch size / single-thread rate), an accelerator that is
    slower than the parallel pipeline. With S = 80 % of the pipeline's own per-batch wall time the
    consumer is *faster* than the pipeline, so it must wait at least 20 % of the time.
    """
    it = iter(parallel_dataset(file_pattern(files), wl))
    try:
        for _ in range(warmup_batches):
            next(it)
        waited = wall = longest = slept = 0.0
        counted = 0
        sleeps = []
        with CpuProbe() as probe:
            while counted < n_batches:
                if fixed_sleep is None:
                    for _ in range(drain):
                        next(it)
                    t0 = time.perf_counter()
                    for _ in range(calibrate):
                        next(it)[0].shape  # noqa: B018
                    sleep = busy_fraction * (time.perf_counter() - t0) / calibrate
                else:
                    sleep = fixed_sleep
                sleeps.append(sleep)
                start = time.perf_counter()
                for _ in range(min(block, n_batches - counted)):
                    t0 = time.perf_counter()
                    batch = next(it)
                    w = time.perf_counter() - t0
                    waited += w
                    longest = max(longest, w)
                    batch[0].shape  # noqa: B018
                    time.sleep(sleep)
                    slept += sleep
                    counted += 1
                wall += time.perf_counter() - start
    finally:
        it.close()
    return {"batch_time_s": statistics.median(sleeps) / busy_fraction, "sleep_s": statistics.median(sleeps),
            "busy_fraction": busy_fraction, "batches": counted, "block": block, "calibrate": calibrate,
            "drain": drain, "fixed_sleep": fixed_sleep is not None,
            "reference_batch_time_s": wl.batch_size / parallel_rate, "wait_s": waited, "wall_s": wall,
            "longest_wait_s": longest, "idle_fraction": waited / wall, "cpu": probe.result}


def tree_rss(proc: psutil.Process | None = None) -> int:
    """Resident memory of a process plus all its descendants, in bytes."""
    proc = proc or psutil.Process()
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total


def tree_pss(proc: psutil.Process | None = None) -> int:
    """Proportional set size of a process plus its descendants, in bytes: pages shared between
    forked processes counted once (RSS counts them in every process); RSS where PSS is unknown."""
    proc = proc or psutil.Process()
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        try:
            try:
                total += p.memory_full_info().pss
            except (AttributeError, psutil.AccessDenied):
                total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return total


class TreeRSSSampler:
    """Samples `tree_rss()` every `interval` seconds in a thread; keeps the peak per `phase`."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.phase: Any = None
        self.peaks: dict[Any, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> None:
        with self._lock:
            try:
                rss = tree_rss(self._proc)
            except psutil.Error:
                return
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            self.samples += 1

    def set_phase(self, phase: Any) -> None:
        """Switch phase, sampling at the boundary (so even a short phase has a sample)."""
        if phase != self.phase:
            self.sample()
            with self._lock:
                self.phase = phase
            self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeRSSSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure_memory(files: Sequence[str], wl: Workload, epochs: int = 5, interval: float = 0.05,
                   records_per_epoch: int | None = None) -> dict[str, Any]:
    """Peak RSS of the whole process tree per epoch over `epochs` epochs of the new approach
    (`.repeat(epochs)` on the record stream, so the workers live across epochs)."""
    if records_per_epoch is None:
        records_per_epoch = sum(1 for f in files for _ in TFRecordReader(f))
    mb = 1 / 2**20
    base = tree_rss()
    delivered = 0
    t0 = time.perf_counter()
    with TreeRSSSampler(interval) as sampler:
        sampler.set_phase(0)
        it = iter(parallel_dataset(list(files), wl, repeat=epochs))
        try:
            for batch in it:
                batch[0].shape  # noqa: B018
                delivered += batch_len(batch)
                sampler.set_phase(min(epochs - 1, delivered // records_per_epoch))
        finally:
            it.close()
        sampler.set_phase("after")
    seconds = time.perf_counter() - t0
    if delivered != epochs * records_per_epoch:
        raise AssertionError(f"memory run delivered {delivered} records, expected {epochs * records_per_epoch}")
    peaks = [sampler.peaks.get(e, 0) * mb for e in range(epochs)]
    first, last = peaks[0], peaks[-1]
    return {"epochs": epochs, "records_per_epoch": records_per_epoch, "files": len(files),
            "interval_s": interval, "samples": sampler.samples, "seconds": seconds,
            "records_per_s": delivered / seconds, "baseline_mb": base * mb,
            "peak_mb_per_epoch": peaks, "peak_mb": max(peaks), "after_close_mb": sampler.peaks["after"] * mb,
            "growth_mb": last - first, "grows": bool(last > first * 1.05 + 20)}


# ---------------------------------------------------------------------------------------------
# One workload, end to end
# ---------------------------------------------------------------------------------------------


class GuardTripped(RuntimeError):
    """A measurement was stopped by its `Guard` (memory or time limit)."""


class Guard:
    """Stops a measurement that runs away, so a broken pipeline cannot take the machine down.

    A thread checks every `interval` seconds the PSS of the whole process tree and the elapsed
    time; past `max_rss` bytes or `timeout` seconds it signals the main thread (SIGUSR1), whose
    handler raises `GuardTripped` there while the guard is active. The measured code's own
    `finally` blocks then close the pipeline and its workers. Outside the main thread (no signal
    handlers there) the guard only watches and reports nothing.
    """

    def __init__(self, what: str, max_rss: int | None, timeout: float | None, interval: float = 0.25):
        self.what = what
        self.max_rss = max_rss
        self.timeout = timeout
        self.interval = interval
        self.reason: str | None = None
        self.peak_rss = 0
        self._active = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None

    def _handler(self, signum, frame) -> None:
        if self._active and self.reason is not None:
            self._active = False
            raise GuardTripped(self.reason)

    def _run(self) -> None:
        t0 = time.perf_counter()
        proc = psutil.Process()
        while not self._stop.wait(self.interval):
            try:
                rss = tree_pss(proc)
            except psutil.Error:
                continue
            self.peak_rss = max(self.peak_rss, rss)
            elapsed = time.perf_counter() - t0
            if self.max_rss is not None and rss > self.max_rss:
                self.reason = (f"{self.what}: stopped after {elapsed:.0f} s, the process tree's memory reached "
                               f"{rss / 2**30:.1f} GB (limit {self.max_rss / 2**30:.1f} GB)")
            elif self.timeout is not None and elapsed > self.timeout:
                self.reason = f"{self.what}: stopped after {elapsed:.0f} s (time limit {self.timeout:.0f} s)"
            if self.reason is not None:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
                return

    def __enter__(self) -> Guard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGUSR1, self._handler)
            self._active = True
            self._thread = threading.Thread(target=self._run, name="bench-guard", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(signal.SIGUSR1, self._previous)


def _median(xs: Sequence[float]) -> float | None:
    return h.or_none(h.median(xs))


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    return h.or_none(h.ratio(a, b))


@dataclasses.dataclass
class RunSettings:
    """How one workload is measured (from the command line)."""

    n_records: int | None = None        # records per measurement (default: the workload's)
    repeats: int = 3
    warmup_batches: int = 2
    idle_batches: int | None = None     # default: 60 % of an epoch, at least 30
    memory_epochs: int = 5              # 0: no memory run
    dataloader_workers: int = 2
    with_tfdata: bool | None = None     # default: when TensorFlow is installed
    parallel_plain: bool = True
    max_rss: int | None = None          # bytes for the process tree (default `default_max_rss()`)
    timeout: float | None = None        # seconds (default 10x the single-thread time, >= 60 s)
    progress: bool = True


class Measurer:
    """Runs each measurement of one workload under a `Guard`; a stopped or failing one becomes an error."""

    def __init__(self, wl: Workload, settings: RunSettings, log: Callable[[str], None]) -> None:
        self.wl, self.log = wl, log
        self.max_rss = default_max_rss() if settings.max_rss is None else settings.max_rss
        self.timeout = settings.timeout
        self.single_rates: list[float] = []  # the time limit follows the single-thread rate measured so far
        self.errors: list[str] = []

    def time_limit(self, records: float) -> float:
        if self.timeout is not None:
            return self.timeout
        single = _median(self.single_rates)
        return max(60.0, 10 * records / single) if single else 600.0

    def guarded(self, what: str, fn: Callable[[], Any], records: float) -> tuple[Any, str | None]:
        try:
            with Guard(f"{self.wl.name} {what}", self.max_rss, self.time_limit(records)):
                return fn(), None
        except (GuardTripped, Exception) as e:  # a failing contender is reported, not fatal
            msg = str(e) if isinstance(e, GuardTripped) else f"{self.wl.name} {what}: {type(e).__name__}: {e}"
        gc.collect()  # the failed pipeline's frames may hold a lot of memory in reference cycles
        self.errors.append(msg)
        return None, msg


def _runners(files: Sequence[str], wl: Workload, s: RunSettings,
             parallel_stats: dict[str, Any]) -> dict[str, Callable[[dict], float]]:
    """Each contender of the workload as `run(info) -> records/s`, in round order."""
    n, warm = s.n_records, s.warmup_batches
    runners: dict[str, Callable[[dict], float]] = {
        "single_thread": lambda info: run_single_thread(files, wl, n, warm, info)}
    if s.parallel_plain:
        runners["parallel_plain"] = lambda info: run_parallel_plain(files, wl, n, warm, info)
    runners["sequential"] = lambda info: run_sequential(files, wl, n, warm, info)
    runners["parallel"] = lambda info: run_parallel(files, wl, n, warm, info, stats_out=parallel_stats)
    runners["dataloader"] = lambda info: run_dataloader(files, wl, n, warm, info, num_workers=s.dataloader_workers)
    if s.with_tfdata:
        runners["tfdata"] = lambda info: run_tfdata(files, wl, n, warm, info)
    return runners


def measure_rounds(runners: dict[str, Callable[[dict], float]], m: Measurer, s: RunSettings) -> dict[str, Any]:
    """Interleaved rounds of the contenders (the same order every round); samples and their CPU accounting."""

    def measure(name: str, rnd: int) -> tuple[float, dict[str, Any]]:
        info: dict[str, Any] = {"round": rnd + 1}
        rate, err = m.guarded(name, lambda: runners[name](info), s.n_records)
        if err is not None:
            info["error"] = err
            raise h.ContenderFailed(err, info)
        if name == "single_thread":
            m.single_rates.append(rate)
        return rate, info

    def describe(rate: float, info: dict[str, Any]) -> str:
        return (f"{rate:,.0f} records/s (other processes + steal: "
                f"{info.get('other_cores', 0) + info.get('steal_cores', 0):.2f} cores)")

    return h.interleaved_rounds(list(runners), s.repeats, measure, describe=describe, reverse_odd=False,
                                log=lambda line: m.log(f"[{m.wl.name}] {line.strip()}"))


def derive(samples: dict[str, list[float]], cores: int) -> dict[str, Any]:
    """The limit (cores x single thread) and the ratios between contenders: of medians and per round."""
    med = {k: _median(v) for k, v in samples.items()}
    limit = cores * med["single_thread"] if med["single_thread"] else None

    def round_ratios(a: str, b: str, scale: float = 1.0) -> list[float | None]:
        return [h.or_none(x) for x in h.paired(samples[a], samples[b], scale)]

    per_round = {
        "parallel_vs_limit": round_ratios("parallel", "single_thread", cores),
        "parallel_vs_dataloader": round_ratios("parallel", "dataloader"),
        "parallel_vs_sequential": round_ratios("parallel", "sequential"),
    }
    if "parallel_plain" in samples:
        per_round["parallel_plain_vs_limit"] = round_ratios("parallel_plain", "single_thread", cores)
    return {
        "cores": cores,
        "limit": limit,
        "parallel_vs_limit": ratio_or_none(med["parallel"], limit),
        "parallel_vs_dataloader": ratio_or_none(med["parallel"], med["dataloader"]),
        "parallel_vs_sequential": ratio_or_none(med["parallel"], med["sequential"]),
        "dataloader_vs_limit": ratio_or_none(med["dataloader"], limit),
        "sequential_vs_limit": ratio_or_none(med["sequential"], limit),
        "tfdata_vs_parallel": ratio_or_none(med.get("tfdata"), med["parallel"]),
        "parallel_plain_vs_limit": ratio_or_none(med.get("parallel_plain"), limit),
        "parallel_vs_parallel_plain": ratio_or_none(med["parallel"], med.get("parallel_plain")),
        "per_round": per_round,
        "per_round_median": {k: _median(v) for k, v in per_round.items()},
    }


def measure_idle_pair(files: Sequence[str], wl: Workload, med: dict[str, float | None], total: int,
                      s: RunSettings, m: Measurer) -> tuple[dict | None, dict | None]:
    """The idle fraction over the parallel approach, with S = 80 % of its per-batch wall time and with
    S = 80 % of the per-batch CPU work; (None, None) when the parallel approach has no rate."""
    if not med["parallel"]:
        return None, None
    batches = s.idle_batches or max(30, int(0.6 * total / wl.batch_size))
    records = batches * wl.batch_size * 1.5
    idle, err = m.guarded("idle", lambda: measure_idle(files, wl, med["parallel"], batches, s.warmup_batches),
                          records)
    if idle is None:
        m.log(f"[{wl.name}] idle FAILED: {err}")
        idle = {"error": err}
    else:
        m.log(f"[{wl.name}] idle: {idle['idle_fraction']:.1%} of {idle['wall_s']:.1f} s "
              f"(sleep {idle['sleep_s'] * 1e3:.1f} ms/batch, {batches} batches)")
    if not med.get("single_thread"):
        return idle, {"error": "no single-thread rate"}
    cpu_sleep = 0.8 * wl.batch_size / med["single_thread"]
    idle_cpu, err = m.guarded(
        "idle (S = 80 % of CPU work)",
        lambda: measure_idle(files, wl, med["parallel"], batches, s.warmup_batches, fixed_sleep=cpu_sleep), records)
    if idle_cpu is None:
        m.log(f"[{wl.name}] idle (S = 80 % of CPU work) FAILED: {err}")
        return idle, {"error": err}
    idle_cpu["batch_time_s"] = cpu_sleep / 0.8
    m.log(f"[{wl.name}] idle with S = 80 % of the per-batch CPU work: {idle_cpu['idle_fraction']:.1%} "
          f"(sleep {cpu_sleep * 1e3:.1f} ms/batch)")
    return idle, idle_cpu


def measure_memory_run(files: Sequence[str], manifest: dict, wl: Workload, s: RunSettings, m: Measurer,
                       cores: int) -> dict[str, Any] | None:
    """The memory run over the workload's first `memory_shards` files; None when `memory_epochs` is 0."""
    if not s.memory_epochs:
        return None
    mem_files = files[: max(1, min(wl.memory_shards, len(files)))]
    names = {os.path.basename(f) for f in mem_files}
    per_epoch = sum(sh["records"] for sh in manifest["shards"] if sh["file"] in names)
    memory, err = m.guarded("memory", lambda: measure_memory(mem_files, wl, s.memory_epochs,
                                                             records_per_epoch=per_epoch),
                            per_epoch * s.memory_epochs / cores)
    if memory is None:
        m.log(f"[{wl.name}] memory FAILED: {err}")
        return {"error": err}
    m.log(f"[{wl.name}] memory: peak per epoch " + ", ".join(f"{p:.0f}" for p in memory["peak_mb_per_epoch"])
          + f" MB ({memory['records_per_epoch']:,} records/epoch)")
    return memory


def run_workload(wl: Workload, data_root: Path, settings: RunSettings | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything for one workload: generation, interleaved rounds of contenders, idle, memory.

    Every measurement runs under a `Guard` (see `RunSettings.max_rss` and `.timeout`). A stopped or
    failing measurement is recorded as an error, not a rate.
    """
    s = dataclasses.replace(settings or RunSettings())
    s.n_records = s.n_records or wl.records
    s.with_tfdata = tensorflow_available() if s.with_tfdata is None else s.with_tfdata
    files, manifest = generate_workload(wl, data_root, progress=s.progress)
    total = sum(sh["records"] for sh in manifest["shards"])
    cores = cpu_cores()
    log(f"[{wl.name}] {total:,} records in {len(files)} shards; {s.n_records:,} records per measurement, "
        f"{s.repeats} round(s), batch {wl.batch_size}")
    m = Measurer(wl, s, log)
    parallel_stats: dict[str, Any] = {}
    load_before = loadavg()
    rounds = measure_rounds(_runners(files, wl, s, parallel_stats), m, s)
    samples = rounds["samples"]
    med = {k: _median(v) for k, v in samples.items()}
    idle, idle_cpu = measure_idle_pair(files, wl, med, total, s, m)
    memory = measure_memory_run(files, manifest, wl, s, m, cores)
    return {
        "workload": {**wl.describe(), "records_total": total, "data_dir": str(Path(files[0]).parent),
                     "generation_seconds": manifest.get("generation_seconds")},
        "n_records": s.n_records, "repeats": s.repeats, "warmup_batches": s.warmup_batches,
        "dataloader_workers": s.dataloader_workers, "max_rss_bytes": m.max_rss,
        "tfdata": "measured" if s.with_tfdata else "skipped (TensorFlow not installed)",
        "samples": samples, "sample_info": rounds["runs"], "errors": m.errors,
        "load_average": {"before": load_before, "after": loadavg()},
        "median": med,
        "min": {k: h.or_none(h.lowest(v)) for k, v in samples.items()},
        "max": {k: h.or_none(h.highest(v)) for k, v in samples.items()},
        "derived": derive(samples, cores), "idle": idle, "idle_cpu": idle_cpu, "memory": memory,
        "parallel_stats": parallel_stats,
    }


def default_max_rss() -> int:
    """Memory guard for the process tree (PSS): 25 % of the machine's RAM, between 2 and 4 GB. A
    healthy run of either workload stays well under 2 GB."""
    return int(min(4 * 2**30, max(2 * 2**30, 0.25 * psutil.virtual_memory().total)))


# ---------------------------------------------------------------------------------------------
