"""The pipeline-parallel benchmark's worker side: what runs in the processes `pipeline_parallel.py` starts
(`--worker CONFIG`): the model, the memory and saved-activation probes, and one function per contender.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = 2  # pipeline stages of the benchmark's runs


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
