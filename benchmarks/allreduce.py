"""All-reduce benchmark: conveyor's allreduce strategy against a bare hand-written DDP loop, 1 and 2 workers.

    python benchmarks/allreduce.py                        # default: 3 rounds x 4 contenders + 3 paired runs, ~6 min
    python benchmarks/allreduce.py --quick                # 1 round, 10 steps, 1 paired run of 10 pairs (~1.5 min)
    python benchmarks/allreduce.py --paired-only --repeats 3   # the goal's figure alone: 3 paired runs of 40 pairs
    python benchmarks/allreduce.py --steps 50 --repeats 5 --batch 64 --out /tmp/bench-results
    python benchmarks/allreduce.py --model tiny --steps 3 --warmup 1 --repeats 1   # smoke run (tests)

Workload: a ResNet-20-like CNN for 3x32x32 inputs and 10 classes (a 16-channel stem, 3 stages of 3
basic blocks with 16/32/64 channels, BatchNorm, 1x1 projection shortcuts where the shape changes;
272,474 parameters), cross-entropy, SGD with momentum 0.9 and lr 0.1, batch 64 per worker. The
data is a few fixed random batches per worker (seed 1000 + rank) cycled through, so the measurement
is compute + communication and never input. Every worker runs one intra-op thread
(``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``): 2 workers on this 2-core machine.

Contenders, each a fresh set of processes started by this script (no pickle: the worker gets its
settings as a JSON argument and writes its result as a JSON file):

- ``bare_ddp_1``: one process, the plain model (no DDP): the 1-worker baseline;
- ``bare_ddp_2``: two processes, hand-written ``dist.init_process_group("gloo",
  init_method="tcp://127.0.0.1:PORT")`` + ``DistributedDataParallel(model)`` with DDP's defaults;
- ``conveyor_1``: one process with the environment ``conveyor run -n 1`` gives it (strategy
  ``local``), ``conveyor.init()`` + ``job.prepare(model, optimizer)``;
- ``conveyor_2``: two processes with the environment ``conveyor run -n 2`` gives them (the
  launcher's own ``local_plan``: ``task_environment`` on a ``local_cluster``, free ports, secret),
  ``conveyor.init()`` + ``job.prepare(model, optimizer)`` (strategy ``allreduce``).

**Paired (the goal's figure; benchmarks/allreduce_paired.py).** ``--paired-runs`` (default ``--repeats``)
runs of one pair of processes started as for ``conveyor_2``, each holding conveyor's model (``job.prepare``)
and a bare ``DistributedDataParallel(model)`` on the same process group; they take turns step by step for
``--paired-steps`` pairs (order alternating, a barrier after every step, rank 0 timing each), so the drift
of a shared machine, which moved the separate-process ratio from 0.83 to 1.05 between rounds here (issue
22), cancels in each pair. Reported: the median of the per-pair ratios (bare's step time / conveyor's), min,
max, the ratio of the sums, each run's median, and each side's median step and CPU time. The
separate-process rounds below stay as a secondary figure (they also give scaling efficiency and the 1-worker
contenders).

All four run the same step (``zero_grad``, forward, cross-entropy, backward, ``optimizer.step()``):
``--warmup`` untimed steps, then ``--steps`` timed ones between two barriers; rank 0 measures
samples/s = world x batch x steps / wall time between the barriers, and the forward / backward /
optimizer time of each step. Rounds are interleaved (``bare_ddp_1, bare_ddp_2, conveyor_2,
conveyor_1``, then the reverse order, ...) so that the machine's drift hits every contender alike and
the pair that is compared (``bare_ddp_2``, ``conveyor_2``) always runs back to back; the median
per contender is reported and every sample is kept in the JSON.

Share of step time in gradient communication (2 workers, rank 0), with the method named in the output:

- conveyor: ``job.strategy.step.comm_seconds()`` before and after the timed steps (DDP's own runtime timer,
  sampled on every step: from the first bucket's all-reduce launch to backward finding the last one done;
  no Python comm hook), over the timed loop time;
- bare DDP: the timed loop runs DDP's built-in all-reduce, which cannot be timed from outside, so after
  it the same processes run a separate pass (``--comm-steps``) on a fresh DDP model with an
  equivalent hand-written timing comm hook (divide by the world size, ``dist.all_reduce`` async, time
  from the hook's call to its future's completion, overlapping buckets counted once); also, as a
  reference, the median time of a standalone ``dist.all_reduce`` of one float32 tensor of the model's
  gradient size over the median step time of the timed pass ("isolated").

Both numbers include communication that overlaps backward; they are the time the all-reduce took, not
the time it added to the step (and they measure differently: compare them as orders of magnitude).

Table columns: samples/s (median over rounds, min, max, every round), and the medians of rank 0's
per-step wall time, forward, backward (includes the exposed part of the all-reduce) and optimizer
time, its process CPU time per step (all threads: extra work shows here even when wall time is
noisy) and the communication share.

Derived: the paired ``conveyor_2 / bare_ddp_2`` (goal >= 0.99, median of the per-pair ratios), the
separate-process ``conveyor_2 / bare_ddp_2`` (ratio of the medians, and the ratio of each round), scaling
efficiency 1 -> 2 workers = samples/s(2) / (2 x samples/s(1)) for bare DDP and for conveyor, and the
communication shares. Output: an aligned table and a PASS/FAIL line on stdout; JSON (machine, config, every
sample, every run's details, derived values, goal) in ``<out>/allreduce-<timestamp>.json`` and
``<out>/allreduce-latest.json`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from allreduce_paired import derive_paired, format_paired, run_paired  # noqa: E402
from harness import format_goals  # noqa: E402, F401  (the benchmark's PASS/FAIL lines)
from machine import write_results  # noqa: E402

HERE = Path(__file__).resolve()
CONTENDERS_SPEC = (  # round order; odd rounds reversed
    h.Contender("bare_ddp_1", "plain model, one process"),
    h.Contender("bare_ddp_2", "dist.init_process_group('gloo', tcp://) + DistributedDataParallel"),
    h.Contender("conveyor_2", "conveyor.init() with conveyor run's environment for -n 2 (allreduce)"),
    h.Contender("conveyor_1", "conveyor.init() with conveyor run's environment for -n 1 (local)"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)
WORLD = {"bare_ddp_1": 1, "bare_ddp_2": 2, "conveyor_1": 1, "conveyor_2": 2, "paired": 2}
MODELS = {"resnet20": (3, (16, 32, 64)), "tiny": (1, (4, 8, 8))}  # blocks per stage, channels per stage
GOALS = (h.Goal("conveyor_2 / bare_ddp_2 step by step in the same 2 processes (median of per-pair ratios)",
                "conveyor_vs_bare_2_paired", 0.99),)
DATA_BATCHES = 4  # distinct fixed batches per worker, cycled

COMM_METHODS = {
    "conveyor_2": "job.strategy.step.comm_seconds() delta over the timed steps / timed loop time (DDP's own "
                  "runtime timer, every step: first bucket's all-reduce launch to backward finding the last one "
                  "done; includes time that overlaps backward)",
    "bare_ddp_2": "separate pass after the timed steps on a fresh DDP model with an equivalent hand-written "
                  "timing comm hook: union of bucket all-reduce intervals / pass loop time (includes overlap)",
    "bare_ddp_2_isolated": "median standalone dist.all_reduce of one float32 tensor of the model's gradient "
                           "size / median step time of the timed pass (no overlap, no bucketing)",
}


# ==================================================================================================
# Worker side: runs in the processes this script starts.
# ==================================================================================================


def make_model(blocks: int = 3, widths: Sequence[int] = (16, 32, 64), classes: int = 10):
    """ResNet-20-like CNN for 3x32x32 inputs (He et al. 2016, CIFAR variant with projection shortcuts)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.shortcut = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + self.shortcut(x))

    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                               nn.ReLU(inplace=True)]
    cin = widths[0]
    for stage, width in enumerate(widths):
        for i in range(blocks):
            layers.append(Block(cin, width, 2 if stage > 0 and i == 0 else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def count_params(model_name: str) -> int:
    blocks, widths = MODELS[model_name]
    return sum(p.numel() for p in make_model(blocks, widths).parameters())


class CommTimer:
    """A DDP comm hook equivalent to DDP's default all-reduce, timing the union of in-flight intervals."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self.total = 0.0

    def hook(self, state, bucket):  # no annotations: DDP checks them by identity
        import torch.distributed as dist

        tensor = bucket.buffer()
        tensor.div_(self.world_size)
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def done(fut):
            try:
                return fut.value()[0]
            finally:
                with self._lock:
                    self._in_flight -= 1
                    if self._in_flight == 0:
                        self.total += time.perf_counter() - self._since

        return future.then(done)

    def seconds(self) -> float:
        with self._lock:
            return self.total + (time.perf_counter() - self._since if self._in_flight else 0.0)


def _fixed_batches(rank: int, batch: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(DATA_BATCHES)]


def _fresh(model_name: str):
    """The model and its optimizer, seeded alike everywhere (DDP broadcasts rank 0's anyway)."""
    import torch

    torch.manual_seed(0)
    model = make_model(*MODELS[model_name])
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step_fn(model, optimizer, data) -> Callable[[int], None]:
    import torch.nn.functional as F

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def paired_worker(config: dict[str, Any]) -> dict[str, Any]:
    """conveyor's DDP and a bare DDP in one of the 2 processes of a paired run (see allreduce_paired)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import conveyor

    job = conveyor.init()  # the environment conveyor run's launcher plan gave this process
    try:
        data = _fixed_batches(job.rank, config["batch"])
        conv, conv_opt = job.prepare(*_fresh(config["model"]))
        bare_module, bare_opt = _fresh(config["model"])
        bare = DistributedDataParallel(bare_module)  # DDP's defaults, on the group conveyor.init() made
        steps = {"conveyor": _step_fn(conv, conv_opt, data), "bare": _step_fn(bare, bare_opt, data)}
        for i in range(config["warmup"]):
            for step in steps.values():
                step(i)
        wall: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        dist.barrier()
        comm0 = job.strategy.step.comm_seconds()
        for i in range(config["paired_steps"]):
            for name in (("conveyor", "bare") if i % 2 == 0 else ("bare", "conveyor")):
                t, c = time.perf_counter(), time.process_time()
                steps[name](config["warmup"] + i)
                dist.barrier()
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
        return {"rank": job.rank, "strategy": job.strategy.name, "seconds": wall, "cpu_seconds": cpu,
                "comm_s": job.strategy.step.comm_seconds() - comm0,
                "fingerprint": {"conveyor": _fingerprint(conv), "bare": _fingerprint(bare)}}
    finally:
        job.shutdown()


def _train(model, optimizer, data, warmup: int, steps: int, barrier: Callable[[], None],
           comm: Callable[[], float] | None) -> dict[str, Any]:
    """The loop every contender runs: ``warmup`` untimed steps, then ``steps`` timed between barriers."""
    import torch.nn.functional as F

    def step(i: int):
        x, y = data[i % len(data)]
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        return loss, t1 - t0, t2 - t1, t3 - t2

    first_loss = None
    for i in range(warmup):
        loss = step(i)[0]
        if first_loss is None:
            first_loss = float(loss.item())
    fwd, bwd, opt, step_s = [], [], [], []
    barrier()
    start = time.perf_counter()
    cpu0 = time.process_time()
    comm0 = comm() if comm else 0.0
    prev = start
    for i in range(warmup, warmup + steps):
        loss, f, b, o = step(i)
        now = time.perf_counter()
        fwd.append(f)
        bwd.append(b)
        opt.append(o)
        step_s.append(now - prev)
        prev = now
    loop_s = time.perf_counter() - start
    cpu_s = time.process_time() - cpu0
    comm_s = (comm() - comm0) if comm else None
    barrier()
    wall_s = time.perf_counter() - start
    return {
        "wall_s": wall_s, "loop_s": loop_s, "comm_s": comm_s,
        "comm_share": None if comm_s is None else comm_s / loop_s,
        "comm_ms_per_step": None if comm_s is None else 1e3 * comm_s / steps,
        "cpu_ms_per_step": 1e3 * cpu_s / steps,
        "step_ms_median": 1e3 * statistics.median(step_s),
        "forward_ms_median": 1e3 * statistics.median(fwd),
        "backward_ms_median": 1e3 * statistics.median(bwd),
        "optimizer_ms_median": 1e3 * statistics.median(opt),
        "step_ms": [round(1e3 * s, 3) for s in step_s],
        "first_loss": first_loss, "last_loss": float(loss.item()),
    }


def _fingerprint(model) -> float:
    """Sum of every parameter (float64): equal on all ranks when DDP kept them in step."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _isolated_allreduce(numel: int, repeats: int = 20) -> float:
    import torch
    import torch.distributed as dist

    flat = torch.ones(numel)
    times = []
    for i in range(repeats + 3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One contender process: build the model, train, return the result (rank 0 also writes it)."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    contender = config["contender"]
    world = WORLD[contender]
    batch, warmup, steps = config["batch"], config["warmup"], config["steps"]

    def fresh(rank: int):
        return _fresh(config["model"])

    extra: dict[str, Any] = {}
    if contender == "paired":
        result = paired_worker(config)
        result.update({"threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")})
        (Path(config["result_dir"]) / f"rank{result['rank']}.json").write_text(json.dumps(result))
        return result
    if contender.startswith("conveyor"):
        import conveyor

        job = conveyor.init()  # the environment conveyor run's launcher plan gave this process
        try:
            rank = job.rank
            model, optimizer = job.prepare(*fresh(rank))
            extra["strategy"] = job.strategy.name
            extra["model_class"] = type(model).__name__
            extra["ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            comm = job.strategy.step.comm_seconds if job.world_size > 1 else None
            result = _train(model, optimizer, _fixed_batches(rank, batch), warmup, steps, job.barrier, comm)
            result["fingerprint"] = _fingerprint(model)
            if result["comm_share"] is not None:
                result["comm_method"] = COMM_METHODS["conveyor_2"]
        finally:
            job.shutdown()
    elif world == 1:
        rank = 0
        model, optimizer = fresh(rank)
        result = _train(model, optimizer, _fixed_batches(rank, batch), warmup, steps, lambda: None, None)
        result["fingerprint"] = _fingerprint(model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        rank = config["rank"]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank,
                                world_size=world)
        try:
            data = _fixed_batches(rank, batch)
            module, optimizer = fresh(rank)
            model = DistributedDataParallel(module)
            result = _train(model, optimizer, data, warmup, steps, dist.barrier, None)
            result["fingerprint"] = _fingerprint(model)
            # Communication share: a separate pass with an equivalent timing hook on a fresh DDP model.
            if config["comm_steps"] > 0:
                module2, optimizer2 = fresh(rank)
                model2 = DistributedDataParallel(module2)
                timer = CommTimer(world)
                model2.register_comm_hook(None, timer.hook)
                hooked = _train(model2, optimizer2, data, min(warmup, 3), config["comm_steps"], dist.barrier,
                                timer.seconds)
                result["comm_s"] = hooked["comm_s"]
                result["comm_share"] = hooked["comm_share"]
                result["comm_ms_per_step"] = hooked["comm_ms_per_step"]
                result["comm_method"] = COMM_METHODS["bare_ddp_2"]
                result["hook_pass"] = {k: hooked[k] for k in ("loop_s", "wall_s", "comm_s", "step_ms_median",
                                                               "forward_ms_median", "backward_ms_median",
                                                               "optimizer_ms_median", "cpu_ms_per_step")}
                result["hook_pass"]["steps"] = config["comm_steps"]
                result["hook_pass"]["samples_per_s"] = world * batch * config["comm_steps"] / hooked["wall_s"]
            numel = sum(p.numel() for p in module.parameters())
            iso = _isolated_allreduce(numel)
            result["isolated_allreduce_ms"] = 1e3 * iso
            result["isolated_comm_share"] = 1e3 * iso / result["step_ms_median"]
            result["isolated_method"] = COMM_METHODS["bare_ddp_2_isolated"]
            # Rank 0 hosts the tcp:// store: leaving before the others are done with it aborts them at exit.
            dist.barrier()
        finally:
            dist.destroy_process_group()

    result.update(extra)
    result.update({
        "contender": contender, "rank": rank, "world": world, "batch": batch, "steps": steps, "warmup": warmup,
        "samples_per_s": world * batch * steps / result["wall_s"], "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid(),
    })
    out = Path(config["result_dir"]) / f"rank{rank}.json"
    out.write_text(json.dumps(result))
    return result


# ==================================================================================================
# Parent side: starts the contenders, collects, reports.
# ==================================================================================================


class ContenderError(h.ContenderFailed):
    pass


def _base_env() -> dict[str, str]:
    from conveyor.launch import OWNED_VARS

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARS}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _launches(contender: str, config: dict[str, Any], workdir: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each process of ``contender``."""
    from conveyor.launch import RunOptions, free_ports, local_plan

    world = WORLD[contender]
    env = _base_env()
    if contender.startswith("conveyor") or contender == "paired":
        options = RunOptions(script=str(HERE), script_args=("--worker", json.dumps(config)), workers=world,
                             data_dir=str(workdir / "data"), output_dir=str(workdir / "output"),
                             python=sys.executable)
        ports = free_ports(world + 1)  # as `conveyor run`: one per task, one for torch's store
        plan = local_plan(options, ports[:-1], master_port=ports[-1], secret=secrets.token_bytes(32), environ=env)
        return [(list(t.argv), dict(t.env)) for t in plan.tasks]
    port = free_ports(1)[0]
    return [([sys.executable, str(HERE), "--worker", json.dumps({**config, "rank": r, "port": port})], env)
            for r in range(world)]


def run_contender(contender: str, config: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """Start ``contender``'s processes, wait for them, return every rank's result (rank order)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {**config, "contender": contender, "result_dir": str(workdir)}
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for r, (argv, env) in enumerate(_launches(contender, config, workdir)):
            log = workdir / f"rank{r}.log"
            with open(log, "wb") as f:
                procs.append((subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=str(workdir)), log))
        deadline = time.monotonic() + timeout
        failed = None
        for proc, log in procs:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = failed or f"timed out after {timeout:.0f} s"
                break
            if code != 0 and failed is None:
                failed = f"{log.stem} exited with code {code}: {_tail(log)}"
                break
        if failed:
            raise ContenderError(failed)
    finally:
        for proc, _ in procs:  # only our own children, by handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for r in range(WORLD[contender]):
        path = workdir / f"rank{r}.json"
        if not path.exists():
            raise ContenderError(f"rank {r} wrote no result ({path})")
        results.append(json.loads(path.read_text()))
    return results


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def run_rounds(config: dict[str, Any], repeats: int, timeout: float, log: Callable[[str], None] = print,
               contenders: Sequence[str] = CONTENDERS) -> dict[str, Any]:
    """``repeats`` interleaved rounds of every contender; per contender the samples and rank-0 details."""
    with tempfile.TemporaryDirectory(prefix="conveyor-allreduce-bench-") as tmp:
        def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
            ranks = run_contender(c, config, Path(tmp) / f"r{rnd}-{c}", timeout)
            head = dict(ranks[0])
            fps = [rk["fingerprint"] for rk in ranks]
            head["fingerprints"] = fps
            head["ranks_in_sync"] = max(fps) - min(fps) <= 1e-9 * max(1.0, abs(fps[0]))
            return head["samples_per_s"], head

        def describe(sps: float, head: dict[str, Any]) -> str:
            share = head.get("comm_share")
            extra = f", comm {100 * share:.1f} %" if share is not None else ""
            return f"{sps:8.1f} samples/s  (step {head['step_ms_median']:.0f} ms{extra})"

        return h.interleaved_rounds(contenders, repeats, measure, describe=describe, log=log)


def paired_runs(config: dict[str, Any], runs: int, timeout: float) -> list[dict[str, Any] | None]:
    """The paired runs (allreduce_paired), each in fresh processes."""
    with tempfile.TemporaryDirectory(prefix="conveyor-allreduce-paired-") as tmp:
        count = iter(range(runs))
        return run_paired(lambda c, cfg: run_contender(c, cfg, Path(tmp) / f"paired-{next(count)}", timeout),
                          config, runs)


def derive(res: dict[str, Any]) -> dict[str, Any]:
    # Contenders left out (--contenders) count as not measured: NaN everywhere they would appear.
    s = {c: list(res["samples"].get(c, [])) for c in CONTENDERS}
    runs = {c: list(res["runs"].get(c, [])) for c in CONTENDERS}
    med = {c: h.median(v) for c, v in s.items()}

    def field(c: str, key: str) -> list[float | None]:
        return [None if r is None else r.get(key) for r in runs[c]]

    def share(c: str, key: str, method: str) -> dict[str, Any]:
        return {"median": h.median(field(c, key)), "per_round": field(c, key), "method": COMM_METHODS[method]}

    vs = h.paired(s["conveyor_2"], s["bare_ddp_2"])
    eff_bare = h.paired(s["bare_ddp_2"], s["bare_ddp_1"], scale=2)
    eff_conv = h.paired(s["conveyor_2"], s["conveyor_1"], scale=2)
    hook_sps = [None if r is None or "hook_pass" not in r else r["hook_pass"]["samples_per_s"]
                for r in runs["bare_ddp_2"]]
    return {
        "median": med,
        "min": {c: h.lowest(v) for c, v in s.items()},
        "max": {c: h.highest(v) for c, v in s.items()},
        "conveyor_vs_bare_2": h.ratio(med["conveyor_2"], med["bare_ddp_2"]),
        "conveyor_vs_bare_2_per_round": vs,
        "conveyor_vs_bare_2_per_round_median": h.median(vs),
        "conveyor_vs_bare_1": h.ratio(med["conveyor_1"], med["bare_ddp_1"]),
        "scaling_efficiency": {"bare_ddp": h.ratio(med["bare_ddp_2"], 2 * med["bare_ddp_1"]),
                               "conveyor": h.ratio(med["conveyor_2"], 2 * med["conveyor_1"])},
        "scaling_efficiency_per_round": {"bare_ddp": eff_bare, "conveyor": eff_conv},
        "comm_share": {
            "conveyor_2": share("conveyor_2", "comm_share", "conveyor_2"),
            "bare_ddp_2": share("bare_ddp_2", "comm_share", "bare_ddp_2"),
            "bare_ddp_2_isolated": {**share("bare_ddp_2", "isolated_comm_share", "bare_ddp_2_isolated"),
                                    "allreduce_ms_median": h.median(field("bare_ddp_2", "isolated_allreduce_ms"))},
        },
        "bare_ddp_2_with_timing_hook_samples_per_s": {"median": h.median(hook_sps), "per_round": hook_sps},
        "step_breakdown_ms": {c: {**{k: h.median(field(c, f"{k}_ms_median"))
                                     for k in ("step", "forward", "backward", "optimizer")},
                                  "cpu": h.median(field(c, "cpu_ms_per_step")),
                                  "comm": h.median(field(c, "comm_ms_per_step"))} for c in s},
        "ranks_in_sync": {c: all(r["ranks_in_sync"] for r in runs[c] if r is not None) for c in s
                          if WORLD[c] > 1 and any(r is not None for r in runs[c])},
    }


def format_table(res: dict[str, Any], d: dict[str, Any], config: dict[str, Any]) -> str:
    s = {c: res["samples"].get(c, []) for c in CONTENDERS}
    rounds = max(len(v) for v in s.values())
    timed = f"{config['steps']} timed steps x {rounds} round(s)" if rounds else \
        f"{config.get('paired_steps')} pairs per paired run"
    head = (f"allreduce benchmark: {config['model']} CNN ({config['params']:,} params), batch {config['batch']}/"
            f"worker, {config['warmup']} warm-up steps, {timed}, 1 thread/worker, gloo on loopback")
    rows = [("contender", "workers", "samples/s", "min", "max", "step ms", "fwd ms", "bwd ms", "opt ms", "cpu ms",
             "comm %", "per round")]
    for c in ("bare_ddp_1", "bare_ddp_2", "conveyor_1", "conveyor_2"):
        b = d["step_breakdown_ms"][c]
        share = d["comm_share"][c]["median"] if c in d["comm_share"] else None
        rows.append((c, str(WORLD[c]), h.fmt(d["median"][c], ".1f"), h.fmt(d["min"][c], ".1f"),
                     h.fmt(d["max"][c], ".1f"), h.fmt(b["step"], ".0f"), h.fmt(b["forward"], ".0f"),
                     h.fmt(b["backward"], ".0f"), h.fmt(b["optimizer"], ".0f"), h.fmt(b["cpu"], ".0f"),
                     h.fmt(share, ".1f", 100),
                     " ".join(h.fmt(x, ".1f") for x in s[c]) or "skipped"))
    hook = d["bare_ddp_2_with_timing_hook_samples_per_s"]
    if any(x is not None for x in hook["per_round"]):
        rows.append(("bare_ddp_2+hook", "2", h.fmt(hook["median"], ".1f"), "", "", "", "", "", "", "", "",
                     " ".join(h.fmt(x, ".1f") for x in hook["per_round"])))
    lines = [head, ""]
    if "paired" in d:
        lines += [*format_paired(d["paired"], config["batch"]), ""]
        if not rounds:
            return "\n".join([*lines, "separate-process rounds: not run (--paired-only)"])
        lines += ["separate processes (secondary: each contender a fresh set of processes, rounds interleaved):", ""]
    lines += [h.format_rows(rows, left=(0, len(rows[0]) - 1))]
    cs = d["comm_share"]
    lines += [
        "",
        f"conveyor_2 / bare_ddp_2          {h.fmt(d['conveyor_vs_bare_2'], '.3f')}  (separate processes: ratio of "
        f"medians; per round: {' '.join(h.fmt(x, '.3f') for x in d['conveyor_vs_bare_2_per_round'])}; their median "
        f"{h.fmt(d['conveyor_vs_bare_2_per_round_median'], '.3f')})",
        f"conveyor_1 / bare_ddp_1          {h.fmt(d['conveyor_vs_bare_1'], '.3f')}",
        f"scaling efficiency 1->2, bare    {h.fmt(d['scaling_efficiency']['bare_ddp'], '.3f')}  (per round: "
        f"{' '.join(h.fmt(x, '.3f') for x in d['scaling_efficiency_per_round']['bare_ddp'])})",
        f"scaling efficiency 1->2, conveyor {h.fmt(d['scaling_efficiency']['conveyor'], '.3f')} (per round: "
        f"{' '.join(h.fmt(x, '.3f') for x in d['scaling_efficiency_per_round']['conveyor'])})",
        f"comm share, conveyor_2           {h.fmt(cs['conveyor_2']['median'], '.1f', 100)} %  "
        f"[{cs['conveyor_2']['method']}]",
        f"comm share, bare_ddp_2           {h.fmt(cs['bare_ddp_2']['median'], '.1f', 100)} %  "
        f"[{cs['bare_ddp_2']['method']}; that pass ran at {h.fmt(hook['median'], '.1f')} samples/s "
        f"(row bare_ddp_2+hook)]",
        f"comm share, bare_ddp_2 isolated  {h.fmt(cs['bare_ddp_2_isolated']['median'], '.1f', 100)} %  "
        f"(all-reduce {h.fmt(cs['bare_ddp_2_isolated']['allreduce_ms_median'], '.2f')} ms) "
        f"[{cs['bare_ddp_2_isolated']['method']}]",
        f"comm time per step: conveyor_2 {h.fmt(d['step_breakdown_ms']['conveyor_2']['comm'], '.1f')} ms, bare_ddp_2 "
        f"{h.fmt(d['step_breakdown_ms']['bare_ddp_2']['comm'], '.1f')} ms (hook-timed) vs "
        f"{h.fmt(cs['bare_ddp_2_isolated']['allreduce_ms_median'], '.1f')} ms for the isolated all-reduce of the same "
        f"bytes: the rest is overlap with backward and waiting for the slower rank",
        f"ranks in sync (parameter sums equal after training): "
        f"{', '.join(f'{c} {v}' for c, v in d['ranks_in_sync'].items())}",
    ]
    return "\n".join(lines)


def goals(d: dict[str, Any]) -> list[dict[str, Any]]:
    return h.evaluate_goals(GOALS, d)


def machine_info() -> dict[str, Any]:
    return h.machine_start(("torch",))


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    return write_results("allreduce", report, out_dir)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "1 round, 10 steps, 3 warm-up")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender (default 30; --quick 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; --quick 3)")
    p.add_argument("--batch", type=int, default=64, help="batch per worker (default 64)")
    p.add_argument("--comm-steps", type=int, default=None,
                   help="steps of bare DDP's timing-hook pass (default 10; --quick 5; 0 skips it)")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet20",
                   help="resnet20 (default) or tiny (smoke tests)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per contender run before it is stopped (default 60 + 10 per step)")
    p.add_argument("--paired-steps", type=int, default=None,
                   help="pairs of steps (one bare DDP, one conveyor) per paired run (default 40; --quick 10; 0: none)")
    p.add_argument("--paired-runs", type=int, default=None,
                   help="paired runs, each a fresh pair of processes (default: --repeats)")
    p.add_argument("--paired-only", action="store_true",
                   help="only the paired runs, not the separate-process rounds of the contenders")
    p.add_argument("--contenders", type=h.contender_names(CONTENDERS), default=CONTENDERS,
                   help=f"comma-separated subset of {','.join(CONTENDERS)} (default all; the goal needs the "
                   f"2-worker pair, scaling efficiency all four)")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = h.settle(p, p.parse_args(argv), {"steps": (30, 10), "warmup": (5, 3), "repeats": (3, 1),
                                            "comm_steps": (10, 5), "paired_steps": (40, 10)},
                    positive=("steps", "repeats", "batch"), non_negative=("warmup", "comm_steps", "paired_steps"))
    if args.paired_runs is None:
        args.paired_runs = args.repeats
    if args.paired_runs < 1:
        p.error("--paired-runs must be > 0")
    if args.paired_only and not args.paired_steps:
        p.error("--paired-only needs --paired-steps > 0")
    args.contenders = list(args.contenders)  # the interleaving order, not the order given
    if args.timeout is None:
        args.timeout = 60.0 + 10.0 * (args.warmup + max(args.steps + args.comm_steps, 2 * args.paired_steps))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        # The result is on disk and the process group destroyed: skip interpreter finalization, where gloo's
        # threads can still hold work objects and abort the process ("terminate called without an active
        # exception"; pytorch/pytorch PR 179291), which a round would count as a failed contender. Kept although
        # `conveyor run` now forgives that abort (cluster/failure_report): this benchmark starts its processes
        # itself (run_contender), and the bare-DDP contenders never call conveyor.init, so nothing forgives it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    started = time.perf_counter()
    config = {"model": args.model, "params": count_params(args.model), "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "comm_steps": args.comm_steps, "paired_steps": args.paired_steps}
    machine = machine_info()
    print(f"{args.model}: {config['params']:,} params, batch {args.batch}/worker, {args.steps} steps "
          f"(+{args.warmup} warm-up), {args.repeats} round(s), {machine['cores']} cores")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) on {machine['cores']} cores")
    no_rounds = {"samples": {}, "runs": {}, "order": [], "errors": []}
    res = no_rounds if args.paired_only else run_rounds(config, args.repeats, args.timeout, contenders=args.contenders)
    paired = paired_runs(config, args.paired_runs, args.timeout) if args.paired_steps else None
    d = derive(res)
    if paired is not None:
        d["paired"] = derive_paired(paired)
        d["conveyor_vs_bare_2_paired"] = d["paired"]["median"]
    gs = goals(d)
    table = format_table(res, d, config)
    report = {
        "benchmark": "allreduce", "command": h.command_line("allreduce", argv), "machine": h.machine_end(machine),
        "config": {**config, "repeats": args.repeats, "quick": args.quick, "timeout": args.timeout,
                   "contenders_run": [] if args.paired_only else args.contenders, "paired_runs": args.paired_runs,
                   "threads_per_worker": 1, "optimizer": "SGD(lr=0.1, momentum=0.9)",
                   "data": f"{DATA_BATCHES} fixed random batches per worker (seed 1000 + rank), cycled",
                   "contenders": {c.name: c.label for c in CONTENDERS_SPEC},
                   "order": res["order"]},
    }
    report["paired_runs"] = paired
    h.publish_run("allreduce", report, res, d, gs, table, started, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
