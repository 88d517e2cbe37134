"""Pipeline-parallel benchmark: conveyor's pipeline strategy against one process, two free halves and a bare loop.

    python benchmarks/pipeline_parallel.py                 # 2048 x 64 MLP + Adam, 2 rounds, ~12 min on 2 cores
    python benchmarks/pipeline_parallel.py --quick         # tiny MLP, M = 16 only, 1 round (a test runs it, ~20 s)
    python benchmarks/pipeline_parallel.py --repeats 3 --steps 8 --four-stages --out /tmp/bench-results
    python benchmarks/pipeline_parallel.py --device cuda   # on a host with >= 2 GPUs: one process per GPU, NCCL

Workload: an ``nn.Sequential`` of ``--depth`` blocks, each ``Linear(W, W)`` + ReLU (the last a plain
Linear), W = ``--width``; MSE against a fixed random target; ``Adam(lr=1e-4, fused=True)``. Default W
2048, depth 64: 269M parameters, whose parameters, gradients and Adam's two moments take 4.3 GB in one
process — big enough that the ~220 MB every process pays for importing torch (and ~75 MB more for
``torch.distributed.pipelining``) does not decide the memory ratio, as it did at 67M (0.70). One fixed
batch of ``--batch`` rows (default 256, divisible by every M). Every process runs one intra-op thread
(``OMP_NUM_THREADS=MKL_NUM_THREADS=1`` and ``torch.set_num_threads(1)``). Adam is the fused kernel
because the default one makes ~10 passes over memory per parameter and, with two processes at once,
its time varied 2-4x with what the other process was doing, which drowned the pipelines' comparison.

Contenders, each a fresh set of processes started by this script (settings as a JSON argument, results
as JSON files), all doing ``--warmup`` untimed steps then ``--steps`` timed ones; samples/s = batch x
steps / the timed wall time (2 processes: between two barriers, on rank 0). Every one builds the whole
model (seed 0), as a user's script does; the 2-process ones keep their half (cut before block D/2):

- ``one_process``: the whole model in one process (``zero_grad``, forward, loss, backward, ``step``).
- ``two_halves``: 2 processes, each training its half alone on the whole batch at once (the second
  half's input needs its gradient, as a pipeline's later stage computes it): the same work as
  one_process with nothing crossing, no microbatches and no bubble. Its rate over 2 x one_process is
  how fast two processes run at once on this machine, the ceiling of any 2-process pipeline.
- ``bare_pipelining``: 2 processes, ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:P")``,
  a static ``PipelineStage`` (example tensors for one microbatch) and ``Schedule1F1B(stage, M,
  loss_fn, scale_grads=True)``; a step is ``zero_grad``, ``schedule.step(...)``, ``optimizer.step()`` —
  the loop torch's documentation shows.
- ``conveyor_pipeline``: 2 processes with the environment ``conveyor run -n 2 --strategy pipeline
  --stages 2 --microbatches M --schedule 1f1b --split D/2`` gives them (the launcher's ``local_plan``),
  ``conveyor.init()``, ``job.prepare(model, optimizer)``, ``job.train_step(...)``.

The throughput rounds use M = ``--microbatches`` (default 2: microbatches of 128 rows; on one CPU
thread a 2048-wide Linear with fewer rows is bound by reading its weights and adding each microbatch's
weight gradient into ``.grad``, so smaller microbatches cost more per sample — the sweep's samples/s
column shows it) and are interleaved (order reversed every other round); medians and per-round paired
ratios are reported. The ideal is S (1 - (S-1)/(M+S-1)) x one_process.

conveyor against the bare loop is also measured **paired** (``--paired-steps``, default 8): both in one pair
of processes started as ``conveyor run`` starts them — conveyor's stage through ``job.prepare``, and a second
copy of the model's half under a bare ``PipelineStage`` + ``Schedule1F1B`` on the default group — one step
of each in turn (order alternating), a barrier after every step, rank 0 timing each. Separate runs of the two
differed by up to 10 % per round here from the machine alone (other processes, one core slower than the
other for a while), which the paired steps share; the throughput goal is judged on them.

Measured besides (all from inside the processes):

- **Memory**: each process's resident set from ``/proc/self/status`` (VmRSS at phases: after the imports,
  with the whole model built, after the cut; VmHWM for the peaks of set-up and of training, the peak
  reset in between through ``/proc/self/clear_refs``). Not ``getrusage(...).ru_maxrss``, which Linux
  carries over ``execve``: a child started by a large parent reported the parent's peak as its own.
  one_process is "1 stage", the largest conveyor_pipeline process "2 stages" (and a 4-stage conveyor
  run with ``--four-stages``, or when the machine has >= 4 cores).
- **Bubble**: conveyor runs for M in ``--sweep`` (default 2, 4, 8, 16) x (gpipe, 1f1b); after the
  warm-up the stage runner's counters are zeroed, so conveyor's own ``report()`` figures cover the
  timed steps only: per stage its compute (forward, loss, backward chunks) and its idle share of the
  window every stage shares, from the latest stage's schedule start to the latest one's end (see
  docs/architecture.md, Pipeline parallelism, for why that window and not each stage's schedule call),
  next to (S-1)/(M+S-1). That theory assumes equal stages; each row also shows the theory with the
  run's measured stage costs, (M-1) c_max + sum(c) for the window, so a gap from one process computing
  slower than the other (on a shared machine, other processes' load lands unevenly) is told apart
  from what the pipeline adds. Waiting for a stage that started the step late is shown apart.
- **Activation memory of stage 0**, in the same sweep runs: one more step under
  ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes autograd holds for backward (each
  saved tensor once, the stage's parameters excluded), live from pack until the graph frees them. Its peak, in
  units of one microbatch's saved bytes (the step's total / M), is how many microbatches' activations
  the stage holds at once: the quantity 1F1B bounds by S and GPipe does not. Chosen over RSS growth
  because CPU RSS includes allocator caching and Adam's temporaries, and torch tracks no CPU memory.

``--device cuda`` runs every process on its own GPU (rank r on ``cuda:r``; one_process on ``cuda:0``), the
2-process groups on NCCL, and compares peak GPU memory (``torch.cuda.max_memory_allocated``, reset when set-up
ends) beside the RSS. It needs 2 GPUs (4 for the 4-stage run): NCCL refuses two ranks on one GPU, so stages
cannot share one. With fewer the run is skipped and its JSON says why. Without ``--device cuda`` the processes
see no GPU (``CUDA_VISIBLE_DEVICES=""``), so the CPU figures mean the same on a GPU host.

Output: aligned tables and PASS/FAIL goal lines on stdout; JSON (machine incl. load average, config,
every sample, derived values, goals) in ``<out>/pipeline_parallel-<timestamp>.json`` and
``<out>/pipeline_parallel-latest.json`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from machine import write_results  # noqa: E402

NAME = "pipeline_parallel"
HERE = Path(__file__).resolve()
CONTENDERS_SPEC = (  # round order; odd rounds reversed, so the compared pair always runs back to back
    h.Contender("one_process", "whole model, one process, one thread"),
    h.Contender("two_halves", "each of 2 processes trains its half alone, whole batch: the 2-process ceiling"),
    h.Contender("bare_pipelining", "hand-written PipelineStage + Schedule1F1B loop, 2 processes, gloo"),
    h.Contender("conveyor_pipeline", "conveyor --strategy pipeline --stages 2, schedule 1f1b, 2 processes"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)
SCHEDULES = ("gpipe", "1f1b")
STAGES = 2
LINKS = {"cpu": "gloo on 127.0.0.1", "cuda": "NCCL, one GPU per process"}
GOALS = (
    h.Goal("memory: largest process with 2 stages / one-process peak RSS", "memory_ratio_2", 0.6, "<="),
    h.Goal("bubble: max |measured - (S-1)/(M+S-1)| over stages, schedules, M >= 4", "bubble_max_gap", 0.05, "<="),
    h.Goal("throughput: conveyor_pipeline / bare_pipelining, step by step in the same 2 processes",
           "conveyor_vs_bare_paired", 0.97),
    h.Goal("throughput: conveyor_pipeline / (S x (1 - bubble) x one_process)", "conveyor_vs_ideal", 0.85),
    h.Goal("activations: 1F1B stage 0 at the largest M, microbatches held (about S)", "act_1f1b", 1.25 * STAGES,
           "<="),
    h.Goal("activations: GPipe stage 0 at the largest M, microbatches held / M (about 1)", "act_gpipe_share", 0.9),
)


# ==================================================================================================
# Worker side: runs in the processes this script starts.
# ==================================================================================================


def make_model(width: int, depth: int):
    """The same deep MLP in every process (fixed seed): blocks "0".."depth-1", each Linear + ReLU but the last."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)]
    return nn.Sequential(*blocks, nn.Linear(width, width))


def make_batch(width: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def make_optimizer(params):
    import torch

    # fused: torch's one-pass CPU kernel. The default Adam makes ~10 passes over memory per parameter, and
    # with two processes at once its time varied 2-4x with what the other one was doing, drowning the comparison.
    return torch.optim.Adam(params, lr=1e-4, fused=True)


class Memory:
    """This process's resident memory, MB: at named phases (VmRSS) and its peaks (VmHWM), from /proc/self/status.

    Not ``getrusage(...).ru_maxrss``: Linux carries that over ``execve``, so a process started by a larger
    parent reports the parent's peak as its own. When set-up ends, the peak is reset (``/proc/self/clear_refs``),
    which tells the peak of set-up (building the model, cutting it) from the peak of training."""

    def __init__(self, device: Any = None) -> None:
        self.phases: dict[str, float] = {}
        self.setup_peak: float | None = None
        self.reset = False
        self.device = device if device is not None and device.type == "cuda" else None
        self.gpu_setup_peak: float | None = None

    @staticmethod
    def _status(key: str) -> float:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) / 1024  # kB
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best there is

    def mark(self, phase: str) -> None:
        self.phases[phase] = self._status("VmRSS")

    def setup_done(self) -> None:
        self.mark("ready")
        self.setup_peak = self._status("VmHWM")
        if self.device is not None:
            import torch
            torch.cuda.synchronize(self.device)
            self.gpu_setup_peak = torch.cuda.max_memory_allocated(self.device) / 2**20
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            pass  # the training peak is then the whole run's

    def report(self) -> dict[str, Any]:
        train = self._status("VmHWM")
        peak = max(train, self.setup_peak or 0.0)
        out = {"peak_rss_mb": peak, "setup_peak_rss_mb": self.setup_peak, "train_peak_rss_mb": train,
               "rss_mb": dict(self.phases), "peak_reset": self.reset}
        if self.device is not None:
            import torch
            gpu_train = torch.cuda.max_memory_allocated(self.device) / 2**20
            out |= {"peak_gpu_mb": max(gpu_train, self.gpu_setup_peak or 0.0), "train_peak_gpu_mb": gpu_train}
        return out


class SavedBytes:
    """Bytes autograd saves for backward, live from pack until the graph drops them. A tensor saved twice
    (one layer's output is the next one's input) counts once; parameters (and their views) are the model,
    not activations. Keyed by the tensor's own bytes, not its storage: a microbatch is a view into the
    whole batch's storage."""

    def __init__(self, params) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[tuple[int, int], list[int]] = {}
        self.live = self.peak = self.total = 0

    def pack(self, t):
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in self.skip:
            return t
        size = t.numel() * t.element_size()
        key = (t.data_ptr(), size)
        if key not in self.refs:
            self.refs[key] = [size, 0]
            self.live += size
            self.total += size
            self.peak = max(self.peak, self.live)
        self.refs[key][1] += 1
        return _Held(t, self, key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: tuple[int, int]) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]


class _Held:
    """A saved tensor; when autograd frees it, its storage stops counting."""

    def __init__(self, tensor, owner: SavedBytes, key: tuple[int, int]) -> None:
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self) -> None:
        self.owner.release(self.key)


def saved_activations(step: Callable[[], Any], params, microbatches: int) -> dict[str, float]:
    """One `step` under saved_tensors_hooks: the peak of live saved bytes, and in microbatches."""
    import gc

    import torch

    counter = SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        step()
    gc.collect()
    per_mb = counter.total / microbatches
    return {"peak_bytes": counter.peak, "total_bytes": counter.total, "per_microbatch_bytes": per_mb,
            "peak_microbatches": counter.peak / per_mb if per_mb else None, "left_live_bytes": counter.live}


def timed_steps(step: Callable[[], Any], warmup: int, steps: int, barrier: Callable[[], None],
                after_warmup: Callable[[], None] = lambda: None, device: Any = None) -> dict[str, Any]:
    """`warmup` untimed steps, then `steps` timed ones between two barriers; on a GPU each step's time
    includes its kernels (synchronized after each)."""
    if device is not None and device.type == "cuda":
        import torch
        step = _synchronized(step, lambda: torch.cuda.synchronize(device))
    for _ in range(warmup):
        step()
    after_warmup()
    barrier()
    times, start = [], time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    barrier()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "step_ms": [1e3 * x for x in times], "step_ms_median": 1e3 * sorted(times)[len(times) // 2]}


def _synchronized(step: Callable[[], Any], sync: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        step()
        sync()
    return run


def device_of(config: dict[str, Any]):
    """This process's device: its own GPU (cuda:rank) with --device cuda, else the CPU."""
    import torch

    if config.get("device") != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", config.get("rank", 0))
    torch.cuda.set_device(device)
    return device


def run_one_process(config: dict[str, Any], mem: Memory) -> dict[str, Any]:
    from torch import nn

    device = mem.device or device_of(config)
    model = make_model(config["width"], config["depth"]).to(device)
    optimizer = make_optimizer(model.parameters())
    x, y = (t.to(device) for t in make_batch(config["width"], config["batch"]))
    mem.mark("built")
    mem.setup_done()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    return {"rank": 0, **timed_steps(step, config["warmup"], config["steps"], lambda: None, device=device)}


@contextlib.contextmanager
def _two_processes(config: dict[str, Any]):
    """A plain group of the 2 processes, gloo (NCCL on GPUs); rank 0 hosts the tcp:// store, so it leaves last."""
    import torch.distributed as dist

    backend = "nccl" if config.get("device") == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{config['port']}", rank=config["rank"],
                            world_size=STAGES)
    try:
        yield dist
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _own_half(config: dict[str, Any], mem: Memory):
    """The whole model built, this rank's half of the blocks kept (the other half freed), Adam over it."""
    from torch import nn

    blocks = list(make_model(config["width"], config["depth"]))
    mem.mark("built")
    cut = config["split"]
    module = nn.Sequential(*(blocks[:cut] if config["rank"] == 0 else blocks[cut:])).to(device_of(config))
    del blocks
    return module, make_optimizer(module.parameters())


def run_two_halves(config: dict[str, Any], mem: Memory) -> dict[str, Any]:
    """Each process trains its half alone, whole batch at once: the same work as one_process split in two with
    nothing crossing, no microbatches and no bubble — what two processes can do at once on this machine."""
    from torch import nn

    with _two_processes(config) as dist:
        module, optimizer = _own_half(config, mem)
        device = device_of(config)
        x, y = (t.to(device) for t in make_batch(config["width"], config["batch"]))
        x.requires_grad_(config["rank"] > 0)  # as a later pipeline stage, which computes its input's gradient
        mem.setup_done()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(module(x), y).backward()
            optimizer.step()

        return {"rank": config["rank"], **timed_steps(step, config["warmup"], config["steps"], dist.barrier,
                                                      device=device)}


def bare_loop_step(config: dict[str, Any], mem: Memory, rank: int, x, y) -> Callable[[], None]:
    """The loop a user writes from torch's pipelining docs, on the default process group: this rank's half of
    the model, a static stage, Schedule1F1B; returns one training step."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    m = config["microbatches"]
    module, optimizer = _own_half({**config, "rank": rank}, mem)
    example = torch.empty(config["batch"] // m, config["width"], device=x.device)
    stage = PipelineStage(module, rank, STAGES, x.device, input_args=example.clone().requires_grad_(rank > 0),
                          output_args=example.clone().requires_grad_())
    schedule = Schedule1F1B(stage, m, loss_fn=nn.functional.mse_loss, scale_grads=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        optimizer.step()

    return step


def run_bare(config: dict[str, Any], mem: Memory) -> dict[str, Any]:
    with _two_processes(config) as dist:
        device = device_of(config)
        x, y = (t.to(device) for t in make_batch(config["width"], config["batch"]))
        step = bare_loop_step(config, mem, config["rank"], x, y)
        mem.setup_done()
        return {"rank": config["rank"], **timed_steps(step, config["warmup"], config["steps"], dist.barrier,
                                                      device=device)}


def run_conveyor(config: dict[str, Any], mem: Memory) -> dict[str, Any]:
    from torch import nn

    import conveyor

    job = conveyor.init()  # the environment conveyor run's launcher plan gave this process
    try:
        model = make_model(config["width"], config["depth"])  # the whole model, as a user's script builds it
        mem.mark("built")
        model, optimizer = job.prepare(model, make_optimizer(model.parameters()))  # keeps this stage's layers
        x, y = (t.to(job.device) for t in make_batch(config["width"], config["batch"]))
        runner = job.strategy.runner
        mem.setup_done()

        def step() -> None:
            job.train_step(model, optimizer, nn.functional.mse_loss, x, y)

        def reset() -> None:  # the summary's figures then cover the timed steps only
            runner.seconds = {k: 0 for k in runner.seconds}

        result = {"rank": job.rank, "stage": job.strategy.stage, "device": str(job.device),
                  **timed_steps(step, config["warmup"], config["steps"], job.barrier, reset, device=job.device)}
        result["figures"] = job.strategy.report({})["pipeline"]
        if config.get("activations"):
            result["activations"] = saved_activations(step, list(model.parameters()), runner.microbatches)
        return result
    finally:
        job.shutdown()


def run_paired(config: dict[str, Any], mem: Memory) -> dict[str, Any]:
    """conveyor's pipeline and the bare loop in the same 2 processes, one step of each in turn (the order
    alternating), a barrier after every step: each step's time on rank 0 is the whole pipeline's, and both
    see the same machine at the same moment, which separate runs on a shared 2-core machine do not."""
    import torch
    from torch import nn

    import conveyor

    job = conveyor.init()
    try:
        model = make_model(config["width"], config["depth"])
        model, optimizer = job.prepare(model, make_optimizer(model.parameters()))
        rank, device = job.rank, job.device
        x, y = (t.to(device) for t in make_batch(config["width"], config["batch"]))
        bare_step = bare_loop_step(config, mem, rank, x, y)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

        steps = {"conveyor": lambda: job.train_step(model, optimizer, nn.functional.mse_loss, x, y),
                 "bare": bare_step}
        for _ in range(config["warmup"]):
            for step in steps.values():
                step()
        job.barrier()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(config["steps"]):
            for name in (("conveyor", "bare") if i % 2 == 0 else ("bare", "conveyor")):
                t = time.perf_counter()
                steps[name]()
                sync()
                job.barrier()
                times[name].append(time.perf_counter() - t)
        return {"rank": rank, "paired_seconds": times, "wall_s": sum(times["conveyor"])}
    finally:
        job.shutdown()


def worker(config: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    import conveyor  # noqa: F401  (every contender pays the same import floor)

    # The conveyor contender's device is conveyor's choice (its own GPU by local rank); the others', this one's.
    mem = Memory(device_of({**config, "rank": config.get("rank", int(os.environ.get("LOCAL_RANK", 0)))}))
    mem.mark("import")
    run = {"one_process": run_one_process, "two_halves": run_two_halves,
           "bare_pipelining": run_bare, "paired": run_paired}.get(config["contender"], run_conveyor)
    result = run(config, mem)
    result.update({**mem.report(), "threads": torch.get_num_threads(),
                   "samples_per_s": config["batch"] * config["steps"] / result["wall_s"]})
    (Path(config["result_dir"]) / f"rank{result['rank']}.json").write_text(json.dumps(result))


# ==================================================================================================
# Parent side: starts the runs, collects, reports.
# ==================================================================================================


def _base_env(device: str) -> dict[str, str]:
    from conveyor.launch import OWNED_VARS

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARS and not k.startswith("CONVEYOR_")}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return env if device == "cuda" else env | {"CUDA_VISIBLE_DEVICES": ""}


def _launches(config: dict[str, Any], workdir: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each process of the run `config` describes."""
    from conveyor.launch import RunOptions, free_ports, local_plan

    env, kind = _base_env(config.get("device", "cpu")), config["contender"]
    if kind == "one_process":
        return [([sys.executable, str(HERE), "--worker", json.dumps(config)], env)]
    if kind in ("two_halves", "bare_pipelining"):
        port = free_ports(1)[0]
        return [([sys.executable, str(HERE), "--worker", json.dumps({**config, "rank": r, "port": port})], env)
                for r in range(STAGES)]
    stages = config["stages"]
    options = RunOptions(script=str(HERE), script_args=("--worker", json.dumps(config)), workers=stages,
                         strategy="pipeline", stages=stages, microbatches=config["microbatches"],
                         schedule=config["schedule"], split=str(config["split"]) if stages == 2 else None,
                         data_dir=str(workdir / "data"), output_dir=str(workdir / "output"), python=sys.executable)
    ports = free_ports(stages + 1)  # as `conveyor run`: one per task, one for torch's store
    plan = local_plan(options, ports[:-1], master_port=ports[-1], secret=secrets.token_bytes(32), environ=env)
    return [(list(t.argv), dict(t.env)) for t in plan.tasks]


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def run_processes(config: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """Start the run's processes, wait for them (killing our own on failure), return every rank's result."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {**config, "result_dir": str(workdir)}
    procs: list[tuple[subprocess.Popen, Path]] = []
    failed = None
    try:
        for r, (argv, env) in enumerate(_launches(config, workdir)):
            log = workdir / f"rank{r}.log"
            with open(log, "wb") as f:
                procs.append((subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, cwd=str(workdir)), log))
        deadline = time.monotonic() + timeout
        for proc, log in procs:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"timed out after {timeout:.0f} s"
                break
            if code != 0:
                failed = f"{log.stem} exited with code {code}: {_tail(log)}"
                break
    finally:
        for proc, _ in procs:  # only our own children, by handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        raise h.ContenderFailed(failed)
    paths = [workdir / f"rank{r}.json" for r in range(len(procs))]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise h.ContenderFailed(f"no result from {', '.join(missing)}")
    return [json.loads(p.read_text()) for p in paths]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A run as kept in the JSON: rank 0's rate and step time, every rank's peak RSS."""
    head = ranks[0]
    keep = {k: head[k] for k in ("samples_per_s", "wall_s", "step_ms", "step_ms_median") if k in head}
    keep["peak_rss_mb"] = [r["peak_rss_mb"] for r in ranks]
    if all("peak_gpu_mb" in r for r in ranks):
        keep["peak_gpu_mb"] = [r["peak_gpu_mb"] for r in ranks]
    keep["memory"] = [{k: r.get(k) for k in ("setup_peak_rss_mb", "train_peak_rss_mb", "rss_mb", "peak_reset")}
                      for r in ranks]
    keep["threads"] = [r["threads"] for r in ranks]
    for key in ("figures", "activations"):
        found = [r[key] for r in ranks if key in r and r.get("stage", 0) == 0]
        if found:
            keep[key] = found[0]
    return keep


def run_rounds(config: dict[str, Any], repeats: int, timeout: float, tmp: Path,
               contenders: Sequence[str] = CONTENDERS) -> dict[str, Any]:
    """Interleaved throughput rounds (1F1B, M = --microbatches) with every process's peak RSS."""

    def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
        cfg = {**config, "contender": c, "stages": STAGES, "schedule": "1f1b", "activations": True}
        run = summarize(run_processes(cfg, tmp / f"r{rnd}-{c}", timeout))
        return run["samples_per_s"], run

    def describe(sps: float, run: dict[str, Any]) -> str:
        rss = ", ".join(f"{x:.0f}" for x in run["peak_rss_mb"])
        return f"{sps:8.1f} samples/s  (step {run['step_ms_median']:.0f} ms, peak RSS {rss} MB)"

    return h.interleaved_rounds(contenders, repeats, measure, describe=describe)


def run_sweep(config: dict[str, Any], sweep: Sequence[int], timeout: float, tmp: Path,
              done: dict[str, Any] | None = None) -> dict[str, Any]:
    """conveyor for every (schedule, M): its own per-stage figures and stage 0's saved activations.
    `done`: runs already made ({"1f1b/8": run}: the throughput rounds' last conveyor run), not repeated."""
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for m in sweep:
            key = f"{schedule}/{m}"
            if done and key in done:
                out[key] = {**done[key], "from": "throughput rounds"}
                continue
            cfg = {**config, "contender": "conveyor_pipeline", "stages": STAGES, "schedule": schedule,
                   "microbatches": m, "activations": True}
            try:
                out[key] = summarize(run_processes(cfg, tmp / f"sweep-{schedule}-{m}", timeout))
                fig = out[key]["figures"]
                shown = " ".join(h.fmt(s["bubble_fraction"], ".3f") for s in fig["per_stage"])
                print(f"  sweep {key:<8} bubble per stage {shown} (theory {fig['theoretical_bubble_fraction']:.3f}), "
                      f"stage 0 holds {h.fmt(out[key]['activations']['peak_microbatches'], '.2f')} microbatches")
            except h.ContenderFailed as e:
                out[key] = {"error": str(e)}
                print(f"  sweep {key:<8} FAILED: {e}")
    return out


def run_paired_steps(config: dict[str, Any], steps: int, timeout: float, tmp: Path) -> dict[str, Any]:
    """conveyor against the bare loop step by step in the same processes (run_paired): rank 0's step times,
    each pair's bare / conveyor time, and the ratio of their sums (conveyor's throughput / bare's)."""
    cfg = {**config, "contender": "paired", "stages": STAGES, "schedule": "1f1b", "steps": steps}
    try:
        seconds = run_processes(cfg, tmp / "paired", timeout)[0]["paired_seconds"]
    except h.ContenderFailed as e:
        print(f"  paired steps FAILED: {e}")
        return {"error": str(e)}
    ratio = sum(seconds["bare"]) / sum(seconds["conveyor"])
    per_pair = [b / c for c, b in zip(seconds["conveyor"], seconds["bare"], strict=True)]
    print(f"  paired steps: conveyor / bare throughput {ratio:.3f} over {steps} pairs "
          f"(per pair {' '.join(f'{r:.3f}' for r in per_pair)})")
    return {"steps": steps, "seconds": seconds, "per_pair": per_pair, "conveyor_vs_bare": ratio}


def run_four_stages(config: dict[str, Any], timeout: float, tmp: Path) -> dict[str, Any]:
    cfg = {**config, "contender": "conveyor_pipeline", "stages": 4, "schedule": "1f1b",
           "microbatches": max(config["microbatches"], 4)}
    try:
        return summarize(run_processes(cfg, tmp / "four-stages", timeout))
    except h.ContenderFailed as e:
        return {"error": str(e)}


# ------------------------------------------------------------------------------------ derived values

_PHASES = ("import", "built", "ready")


def _largest_process(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each run's process with the largest peak RSS; medians over the runs of its peak, phases and part peaks."""
    picked = []
    for run in runs:
        peaks = run.get("peak_rss_mb") or []
        if not peaks:
            continue
        i = max(range(len(peaks)), key=peaks.__getitem__)
        mem = (run.get("memory") or [{}] * len(peaks))[i]
        picked.append({"peak_rss_mb": peaks[i], "setup_peak_rss_mb": mem.get("setup_peak_rss_mb"),
                       "train_peak_rss_mb": mem.get("train_peak_rss_mb"),
                       **{f"{ph}_rss_mb": (mem.get("rss_mb") or {}).get(ph) for ph in _PHASES}})
    keys = ("peak_rss_mb", "setup_peak_rss_mb", "train_peak_rss_mb", *(f"{ph}_rss_mb" for ph in _PHASES))
    return {k: h.median(p[k] for p in picked) for k in keys}


def theory(stages: int, m: int) -> float:
    return (stages - 1) / (m + stages - 1)


def cost_aware_theory(compute: Sequence[float], m: int) -> list[float]:
    """Each stage's idle share when the stages' compute per step is `compute`, not equal as (S-1)/(M+S-1)
    assumes: the window is then the slowest stage's M microbatches plus one microbatch of each other stage
    (the fill and the drain), (M-1) c_max + sum(c) with c a stage's compute per microbatch."""
    window = ((m - 1) * max(compute) + sum(compute)) / m
    return [1 - c / window for c in compute]


def _bubble_rows(sweep: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """Per (schedule, M): each stage's measured bubble and its gap to theory; the largest gap at M >= 4."""
    rows, gaps = [], []
    for key, run in sweep.items():
        schedule, m = key.split("/")
        fig = run.get("figures")
        if fig is None:
            rows.append({"schedule": schedule, "microbatches": int(m), "error": run.get("error")})
            continue
        stages = fig["per_stage"]
        gap = max((h.gap(s["bubble_fraction"], fig["theoretical_bubble_fraction"]) for s in stages),
                  default=float("nan"))
        compute = [1e3 * s["compute_seconds_per_step"] for s in stages]
        expected = cost_aware_theory(compute, int(m))
        cost_gap = max(h.gap(st["bubble_fraction"], e) for st, e in zip(stages, expected, strict=True))
        rows.append({"schedule": schedule, "microbatches": int(m), "theory": fig["theoretical_bubble_fraction"],
                     "measured": [s["bubble_fraction"] for s in stages],
                     "compute_ms": compute, "cost_aware": expected,
                     "max_gap_cost_aware": cost_gap,
                     "wait_ms": [1e3 * s["send_recv_wait_seconds_per_step"] for s in stages],
                     "start_wait_ms": [1e3 * (s.get("start_wait_seconds_per_step") or 0.0) for s in stages],
                     "max_gap": gap, "activations": run.get("activations"),
                     "samples_per_s": run.get("samples_per_s")})
        if int(m) >= 4:
            gaps.append(gap)
    # a failed (schedule, M) at M >= 4 leaves the goal unmeasured rather than passing on the rest
    failed = any("error" in r and r["microbatches"] >= 4 for r in rows)
    return rows, (float("nan") if failed or not gaps else max(h.finite(gaps) or [float("nan")]))


def _activations(rows: list[dict[str, Any]], schedule: str) -> dict[str, Any] | None:
    """Stage 0's saved activations at the largest M the sweep ran for `schedule`."""
    mine = [r for r in rows if r["schedule"] == schedule and r.get("activations")]
    if not mine:
        return None
    top = max(mine, key=lambda r: r["microbatches"])
    return {"microbatches": top["microbatches"], **top["activations"]}


def derive(res: dict[str, Any], sweep: dict[str, Any], four: dict[str, Any] | None, m: int,
           paired: dict[str, Any] | None = None) -> dict[str, Any]:
    s = {c: list(res["samples"].get(c, [])) for c in CONTENDERS}
    runs = {c: [r for r in res["runs"].get(c, []) if r is not None] for c in CONTENDERS}
    med = {c: h.median(v) for c, v in s.items()}
    memory = {c: _largest_process(runs[c]) for c in CONTENDERS}
    if four and "peak_rss_mb" in four:
        memory["conveyor_4_stages"] = _largest_process([four])
    peak = {c: m["peak_rss_mb"] for c, m in memory.items()}
    gpu_peak = {c: h.median(max(r["peak_gpu_mb"]) for r in runs[c] if "peak_gpu_mb" in r) for c in CONTENDERS}
    ideal = STAGES * (1 - theory(STAGES, m))
    rows, max_gap = _bubble_rows(sweep)
    for r in rows:  # each sweep run's rate against its own ideal, S (1 - b(M)) one_process
        r["vs_ideal"] = h.ratio(r.get("samples_per_s"), STAGES * (1 - theory(STAGES, r["microbatches"]))
                                * med["one_process"])
    act = {sch: _activations(rows, sch) for sch in SCHEDULES}
    a1, ag = act["1f1b"], act["gpipe"]
    four_peak = peak.get("conveyor_4_stages")
    above = {c: m["peak_rss_mb"] - m["import_rss_mb"] for c, m in memory.items()}
    return {
        "median_samples_per_s": med, "min": {c: h.lowest(v) for c, v in s.items()},
        "max": {c: h.highest(v) for c, v in s.items()},
        "step_ms": {c: h.median(r["step_ms_median"] for r in runs[c]) for c in CONTENDERS},
        "peak_rss_mb": peak, "memory": memory,
        "peak_rss_mb_4_stages": four_peak,
        "peak_gpu_mb": gpu_peak, "memory_ratio_2_gpu": h.ratio(gpu_peak["conveyor_pipeline"], gpu_peak["one_process"]),
        "memory_ratio_2": h.ratio(peak["conveyor_pipeline"], peak["one_process"]),
        "memory_ratio_2_bare": h.ratio(peak["bare_pipelining"], peak["one_process"]),
        "memory_ratio_4": h.ratio(four_peak, peak["one_process"]),
        "memory_ratio_2_above_import": h.ratio(above["conveyor_pipeline"], above["one_process"]),
        "conveyor_vs_bare": h.ratio(med["conveyor_pipeline"], med["bare_pipelining"]),
        "conveyor_vs_bare_paired": (paired or {}).get("conveyor_vs_bare"),
        "conveyor_vs_bare_per_pair": (paired or {}).get("per_pair", []),
        "conveyor_vs_bare_per_round": h.paired(s["conveyor_pipeline"], s["bare_pipelining"]),
        "ideal_speedup": ideal,
        "conveyor_vs_ideal": h.ratio(med["conveyor_pipeline"], ideal * med["one_process"]),
        "conveyor_vs_ideal_per_round": h.paired(s["conveyor_pipeline"], s["one_process"], scale=ideal),
        "bare_vs_ideal": h.ratio(med["bare_pipelining"], ideal * med["one_process"]),
        "two_process_efficiency": h.ratio(med["two_halves"], STAGES * med["one_process"]),
        "conveyor_vs_halves": h.ratio(med["conveyor_pipeline"], (1 - theory(STAGES, m)) * med["two_halves"]),
        "bubble": rows, "bubble_max_gap": max_gap, "activations_stage0": act,
        "bubble_max_gap_cost_aware": max(h.finite(r.get("max_gap_cost_aware") for r in rows if r["microbatches"] >= 4)
                                         or [float("nan")]),
        "act_1f1b": a1["peak_microbatches"] if a1 else None,
        "act_gpipe_share": ag["peak_microbatches"] / ag["microbatches"] if ag and ag["peak_microbatches"] else None,
    }


# ------------------------------------------------------------------------------------ report


def _throughput_rows(res: dict[str, Any], d: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("contender", "procs", "samples/s", "min", "max", "step ms", "per round")]
    for c in CONTENDERS:
        procs = "1" if c == "one_process" else str(STAGES)
        rows.append((c, procs, h.fmt(d["median_samples_per_s"][c], ".1f"), h.fmt(d["min"][c], ".1f"),
                     h.fmt(d["max"][c], ".1f"), h.fmt(d["step_ms"][c], ".0f"),
                     h.fmt_all(res["samples"].get(c, []), ".1f") or "skipped"))
    return rows


def _memory_rows(d: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("RSS MB, largest process", "peak", "x one_process", "after imports", "model built", "after the cut",
             "set-up peak", "training peak")]
    base = d["memory"]["one_process"]["peak_rss_mb"]
    parts = ("import", "built", "ready", "setup_peak", "train_peak")
    for name, m in d["memory"].items():
        rows.append((name, h.fmt(m["peak_rss_mb"], ".0f"), h.fmt(h.ratio(m["peak_rss_mb"], base), ".3f"),
                     *(h.fmt(m[f"{k}_rss_mb"], ".0f") for k in parts)))
    return rows


def _sweep_rows(d: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("schedule", "M", "theory", "stage 0", "stage 1", "max gap", "with these costs", "gap to it",
             "compute ms/step", "wait ms/step",
             "start wait ms/step", "samples/s", "x S(1-b) one_process", "stage-0 act. (microbatches)")]
    for r in d["bubble"]:
        if "error" in r:
            rows.append((r["schedule"], str(r["microbatches"]), f"FAILED: {r['error']}"))
            continue
        act = r["activations"] or {}
        rows.append((r["schedule"], str(r["microbatches"]), h.fmt(r["theory"], ".3f"),
                     *(h.fmt(x, ".3f") for x in r["measured"]), h.fmt(r["max_gap"], ".3f"),
                     " / ".join(h.fmt(x, ".3f") for x in r["cost_aware"]), h.fmt(r["max_gap_cost_aware"], ".3f"),
                     " / ".join(h.fmt(x, ".0f") for x in r["compute_ms"]),
                     " / ".join(h.fmt(x, ".0f") for x in r["wait_ms"]),
                     " / ".join(h.fmt(x, ".0f") for x in r["start_wait_ms"]),
                     h.fmt(r.get("samples_per_s"), ".1f"), h.fmt(r.get("vs_ideal"), ".3f"),
                     f"{h.fmt(act.get('peak_microbatches'), '.2f')} ({h.fmt(act.get('peak_bytes'), '.1f', 1e-6)} MB)"))
    return rows


def format_table(res: dict[str, Any], d: dict[str, Any], config: dict[str, Any], repeats: int) -> str:
    m = config["microbatches"]
    head = (f"pipeline_parallel benchmark: MLP {config['depth']} x Linear({config['width']}) + Adam "
            f"({config['params']:,} params, {config['state_mb']:.0f} MB params+grads+Adam), batch {config['batch']}, "
            f"{config['steps']} timed steps after {config['warmup']} warm-up, {repeats} round(s), "
            f"1 thread/process, {LINKS[config.get('device', 'cpu')]}"
            f"; pipelines: 2 stages cut before block {config['split']}, 1F1B, M={m}")
    four = d["peak_rss_mb_4_stages"]
    lines = [head, "", h.format_rows(_throughput_rows(res, d), left=(0, 8)), "",
             f"conveyor_pipeline / bare_pipelining     {h.fmt(d['conveyor_vs_bare'], '.3f')}  (separate runs, ratio of "
             f"medians; per round {h.fmt_all(d['conveyor_vs_bare_per_round'], '.3f')})",
             f"  the same, step by step in one pair of processes {h.fmt(d['conveyor_vs_bare_paired'], '.3f')}  (per "
             f"pair {h.fmt_all(d['conveyor_vs_bare_per_pair'], '.3f') or 'not run'})",
             f"conveyor_pipeline / (S(1-b) one_process) {h.fmt(d['conveyor_vs_ideal'], '.3f')}  (S(1-b) = "
             f"{d['ideal_speedup']:.3f}; per round {h.fmt_all(d['conveyor_vs_ideal_per_round'], '.3f')}; bare "
             f"{h.fmt(d['bare_vs_ideal'], '.3f')})",
             f"two_halves / (S one_process)            {h.fmt(d['two_process_efficiency'], '.3f')}  (how fast two "
             f"processes run at once on this machine, each against one alone: the ceiling of the line above)",
             f"conveyor_pipeline / ((1-b) two_halves)  {h.fmt(d['conveyor_vs_halves'], '.3f')}  (the pipeline's "
             f"own losses: microbatches, sends, imbalance)",
             "", h.format_rows(_memory_rows(d), left=(0,)), "",
             f"peak RSS, largest process: 1 stage {h.fmt(d['peak_rss_mb']['one_process'], '.0f')} MB, 2 stages "
             f"{h.fmt(d['peak_rss_mb']['conveyor_pipeline'], '.0f')} MB (x{h.fmt(d['memory_ratio_2'], '.3f')}; bare "
             f"x{h.fmt(d['memory_ratio_2_bare'], '.3f')}; above the imports x"
             f"{h.fmt(d['memory_ratio_2_above_import'], '.3f')}), 4 stages "
             + (f"{four:.0f} MB (x{h.fmt(d['memory_ratio_4'], '.3f')})" if four else "not run (--four-stages)"),
             *([f"peak GPU memory, largest process: 1 stage {h.fmt(d['peak_gpu_mb']['one_process'], '.0f')} MB, "
                f"2 stages {h.fmt(d['peak_gpu_mb']['conveyor_pipeline'], '.0f')} MB "
                f"(x{h.fmt(d['memory_ratio_2_gpu'], '.3f')})"] if config.get("device") == "cuda" else []),
             "", "bubble (conveyor's summary figures over the timed steps; wait = send/recv wait) and stage 0's "
             "saved activations (saved_tensors_hooks, one extra step):", "",
             h.format_rows(_sweep_rows(d), left=(0,)), "",
             f"largest gap at M >= 4: to (S-1)/(M+S-1) {h.fmt(d['bubble_max_gap'], '.3f')}, to the theory with each "
             f"run's measured stage costs {h.fmt(d['bubble_max_gap_cost_aware'], '.3f')} (what sends, latency and "
             f"jitter add; the rest of the first is one stage computing longer than the other)"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "tiny MLP (256 wide, 4 blocks), batch 32, M 16 only, 1 round, 2 steps")
    p.add_argument("--width", type=int, default=None, help="Linear width (default 2048; --quick 256)")
    p.add_argument("--depth", type=int, default=None, help="blocks (default 64; --quick 4)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default 256; --quick 32)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default 6; --quick 2): with 3, one core running a few %% slower than the "
                   "other for a few seconds decided the bubble's gap to theory")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1; --quick 1)")
    p.add_argument("--microbatches", type=int, default=None, help="M of the throughput rounds (default 2; --quick 16)")
    p.add_argument("--sweep", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                   help="M of the bubble sweep, comma-separated (default 2,4,8,16; --quick 16)")
    p.add_argument("--paired-steps", type=int, default=None,
                   help="steps of each in the paired conveyor/bare run (default 8; --quick 2; 0: not run)")
    p.add_argument("--four-stages", action="store_true", help="also a 4-stage run (memory), even on < 4 cores")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before it is stopped (default 900)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default; the processes see no GPU) or cuda: one GPU per process, NCCL (needs 2 GPUs)")
    p.add_argument("--contenders", type=h.contender_names(CONTENDERS), default=CONTENDERS,
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = h.settle(p, p.parse_args(argv), {"width": (2048, 256), "depth": (64, 4), "batch": (256, 32),
                                            "steps": (6, 2), "warmup": (1, 1), "microbatches": (2, 16),
                                            "sweep": ((2, 4, 8, 16), (16,)), "repeats": (2, 1), "timeout": (900, 120),
                                            "paired_steps": (8, 2)},
                    positive=("width", "depth", "batch", "steps", "microbatches", "repeats", "timeout"),
                    non_negative=("warmup", "paired_steps"))
    for m in (args.microbatches, *args.sweep):
        if m < 1 or args.batch % m:
            p.error(f"--batch {args.batch} must be divisible by every M (got M = {m})")
    if args.depth < 2 * STAGES:
        p.error(f"--depth {args.depth}: at least {2 * STAGES} blocks for the 4-stage run")
    args.contenders = list(args.contenders)
    return args


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    started = time.perf_counter()
    params = args.depth * (args.width * args.width + args.width)
    config = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "microbatches": args.microbatches, "split": args.depth // 2,
              "params": params, "state_mb": 16 * params / 1e6, "device": args.device}
    machine = h.machine_start(("torch",))
    gpus = cuda_devices() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < STAGES:
        reason = (f"--device cuda needs {STAGES} GPUs (one process per GPU: NCCL refuses two ranks on one GPU); "
                  f"this machine has {gpus}")
        print(f"skipped: {reason}")
        report = {"benchmark": NAME, "command": h.command_line(NAME, argv), "machine": h.machine_end(machine),
                  "config": config, "skipped": reason}
        path = write_results(NAME, report, args.out)
        print(f"JSON: {path}")
        return 0
    four_wanted = (args.four_stages or machine["cores"] >= 4) and (args.device == "cpu" or gpus >= 4)
    print(f"MLP {args.depth} x {args.width}: {params:,} params ({config['state_mb']:.0f} MB with grads and Adam), "
          f"batch {args.batch}, {args.repeats} round(s), {machine['cores']} cores, load {machine['loadavg_start']}")
    with tempfile.TemporaryDirectory(prefix="conveyor-pipeline-bench-") as tmp:
        res = run_rounds(config, args.repeats, args.timeout, Path(tmp), args.contenders)
        paired = run_paired_steps(config, args.paired_steps, args.timeout, Path(tmp)) if args.paired_steps else None
        last = [r for r in res["runs"].get("conveyor_pipeline", []) if r is not None and "figures" in r]
        sweep = run_sweep(config, args.sweep, args.timeout, Path(tmp),
                          {f"1f1b/{args.microbatches}": last[-1]} if last else None)
        four = run_four_stages(config, args.timeout, Path(tmp)) if four_wanted else None
    d = derive(res, sweep, four, args.microbatches, paired)
    gs = h.evaluate_goals(GOALS, d)
    table = format_table(res, d, config, args.repeats)
    report = {
        "benchmark": NAME, "command": h.command_line(NAME, argv), "machine": h.machine_end(machine),
        "config": {**config, "repeats": args.repeats, "quick": args.quick, "sweep": list(args.sweep),
                   "timeout": args.timeout, "threads_per_process": 1, "optimizer": "Adam(lr=1e-4, fused=True)",
                   "stages": STAGES, "schedule_throughput": "1f1b", "four_stages": four_wanted,
                   "contenders": {c.name: c.label for c in CONTENDERS_SPEC}, "order": res["order"],
                   "activation_method": "saved_tensors_hooks: live saved bytes (each tensor once, "
                                        "parameters excluded), peak / (step total / M)"},
        "sweep": sweep, "four_stages": four, "paired": paired,
    }
    h.publish_run(NAME, report, res, d, gs, table, started, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
