"""Sharded data parallelism: memory and speed of ``--strategy fsdp`` against DDP and a bare FSDP2 loop (2 ranks).

    python benchmarks/sharded.py [--size-gb 1.0] [--steps 3] [--quick]    # table + results/sharded-*.json

The model: ``--depth`` residual blocks ``relu(Linear(w, w)) + x`` (depth from ``--size-gb`` of fp32
parameters), Adam, a batch of ``--batch`` rows per rank, gloo on CPU, 2 ranks as ``conveyor run -n 2
--strategy fsdp`` starts them. Contenders, each in a FRESH pair of processes so that each rank's peak RSS
(``VmHWM``) is its own: ``ddp`` (torch's DistributedDataParallel loop), ``conveyor`` (``conveyor.init``,
``job.prepare``), ``bare_fsdp2`` (``fully_shard`` per block, then the root; Adam over the shards), and
``pipeline_fsdp`` (``--strategy pipeline --stages 2 --shard-stages``: 4 processes, 2 replicas a stage). Each rank
measures its memory parts from RSS at phase boundaries of three untimed steps (``measured_parts``: parameters,
gradients, Adam state, activations, communication buffers), the peak reset per phase (/proc/self/clear_refs);
the bytes its shard holds by numel are shown beside them as a check. Then ``--steps`` timed steps.
Speed: ``paired``, one more pair holding a conveyor and a bare FSDP2 copy of the model, one step of each
in turn (order alternating, a barrier after every step), rank 0 timing each; per pair bare / conveyor. An A/A
run (``--paired bare,bare``) showed the first-built copy ~4% slower at load 3-6, so (unless ``--quick`` or
``--paired``) a second pair builds bare first and the ratios of both build orders are pooled.
Goals: largest-rank peak RSS of conveyor <= 0.6x DDP's; conveyor >= 0.97x bare FSDP2, paired median.
Every pair runs with ``MALLOC_MMAP_THRESHOLD_=131072`` unless set: glibc's dynamic threshold otherwise keeps
freed 8-16 MiB shard-sized blocks in its heap, and FSDP's peak RSS grew to DDP's (0.99x) on later steps.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402

HERE = Path(__file__).resolve()
NAME = "sharded"
WIDTH = 2048
CONTENDERS = (
    h.Contender("ddp", "torch DistributedDataParallel, Adam"),
    h.Contender("conveyor", "conveyor.init('fsdp'); job.prepare(model, Adam)"),
    h.Contender("bare_fsdp2", "fully_shard per block + root, Adam over the shards"),
    h.Contender("pipeline_fsdp", "--strategy pipeline --stages 2 --shard-stages: 4 processes (2 stages x 2 shards)"),
)
#: processes per contender's run: pipeline x FSDP needs 2 replicas a stage (2 stages x 1 shard is refused)
PROCESSES = {"pipeline_fsdp": 4}
GOALS = (
    h.Goal("memory: conveyor fsdp largest-rank peak RSS / DDP's", "memory_ratio", 0.6, "<="),
    h.Goal("speed: conveyor fsdp / bare FSDP2, paired median per-step ratio", "paired_median", 0.97),
)


# ==================================================================================================
# Worker side: one process of a pair.
# ==================================================================================================


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``) in bytes, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line: run the benchmark on Linux")


def make_model(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x)) + x

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Net()


def _bare_fsdp2(model: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _init(kind: str) -> Any:
    """Bring the default process group up (conveyor's job for ``conveyor`` and ``pipeline_fsdp``, else torch's),
    imports included."""
    import torch.distributed as dist

    if kind in ("conveyor", "pipeline_fsdp"):
        import conveyor

        return conveyor.init("fsdp" if kind == "conveyor" else "pipeline")  # pipeline: the launcher's flags
    import torch.distributed.fsdp  # noqa: F401  (FSDP2/DTensor imports belong to the baseline, not the parameters)

    dist.init_process_group("gloo")
    return None


def _wrap(kind: str, model: Any, job: Any) -> tuple[Any, Any]:
    """(model, optimizer) of one contender; ``_init`` brought the default process group up."""
    import torch

    if kind in ("conveyor", "pipeline_fsdp"):
        return job.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        model = _bare_fsdp2(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _step(model: Any, optimizer: Any, x: Any) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def _square_mean(outputs: Any, _targets: Any) -> Any:
    """Every contender's loss: the outputs' mean square (the pipeline's last stage is given it as ``loss_fn``)."""
    return outputs.square().mean()


def _build(kind: str, width: int, depth: int) -> Any:
    """The model: ``pipeline_fsdp`` the same blocks (same parameters) as an ``nn.Sequential``, which ``--stages``
    cuts, the others ``make_model``'s."""
    from torch import nn

    model = make_model(width, depth)
    return nn.Sequential(*model.layers) if kind == "pipeline_fsdp" else model


def _held_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """The bytes this rank's parameters, gradients and Adam state hold, counted by numel (local shards)."""
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in model.parameters()]
    state = [local(v) for s in optimizer.state.values() for v in s.values() if getattr(v, "dim", lambda: 0)() > 0]
    return {"parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(local(p.grad).numel() * 4 for p in model.parameters() if p.grad is not None),
            "optimizer_state": sum(t.numel() * t.element_size() for t in state)}


class Meter:
    """RSS at named marks and the peak RSS since the previous ``reset`` (VmHWM, which writing 5 to
    /proc/self/clear_refs resets), keeping the process's peak over all resets in ``peak``."""

    def __init__(self) -> None:
        self.level: dict[str, int] = {}
        self.high: dict[str, int] = {}
        self.peak = rss_bytes("VmHWM")

    def reset(self) -> None:
        self.peak = max(self.peak, rss_bytes("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")

    def mark(self, name: str) -> None:
        self.level[name], self.high[name] = rss_bytes(), rss_bytes("VmHWM")
        self.peak = max(self.peak, self.high[name])


def phased_step(model: Any, optimizer: Any, x: Any, meter: Meter, step: int) -> None:
    """One step cut at its phase boundaries, the peak reset before each phase (forward, backward, optimizer)."""
    meter.reset()
    loss = model(x).square().mean()
    meter.mark(f"forward{step}")
    meter.reset()
    loss.backward()
    del loss  # the graph, and with it the saved activations, goes with the loss
    meter.mark(f"backward{step}")
    meter.reset()
    optimizer.step()
    meter.mark(f"optimizer{step}")
    optimizer.zero_grad(set_to_none=True)
    meter.mark(f"zeroed{step}")


def phased_pipeline_step(job: Any, optimizer: Any, x: Any, meter: Meter, step: int) -> None:
    """``phased_step`` under pipeline x FSDP: torch's schedule runs every microbatch's forward and backward in one
    call, so the forward mark is taken where it starts; its activations fall in the backward's transient (comm)."""
    import torch

    runner = job.strategy.runner
    meter.reset()
    meter.mark(f"forward{step}")
    meter.reset()
    loss = runner.train(x, torch.zeros(len(x), 1), _square_mean)  # the stage's reduce-scatter at its end
    meter.mark(f"backward{step}")
    meter.reset()
    optimizer.step()
    meter.mark(f"optimizer{step}")
    runner.end_step(loss)
    optimizer.zero_grad(set_to_none=True)
    meter.mark(f"zeroed{step}")


def measured_parts(level: dict[str, int], high: dict[str, int]) -> dict[str, int]:
    """Memory parts from RSS at the phase boundaries of ``memory_worker``'s three untimed steps, in bytes.

    parameters: RSS growth from before the model is built to the lesser of built and wrapped (FSDP's
    sharding frees the whole blocks; DDP's wrapping adds buckets); optimizer_state: growth during the first
    ``optimizer.step`` (Adam's moments are created there); the third step is the steady one (DDP rebuilds its
    buckets in the second's forward): activations, its forward's growth; gradients, growth from before its
    forward to after its backward (the graph freed); standing buffers, what its start holds besides the
    baseline, parameters and optimizer state (DDP: its gradient buckets); transients, each phase's peak
    above the larger of its start and end; communication_buffers: the standing buffers plus the larger
    forward/backward transient (FSDP: the all-gathered blocks and reduce-scatter buffers).
    """
    start = level["zeroed2"]

    def transient(phase: str, before: int) -> int:
        return max(0, high[phase] - max(before, level[phase]))

    parts = {"baseline": level["base"], "parameters": min(level["built"], level["wrapped"]) - level["base"],
             "optimizer_state": level["optimizer1"] - level["backward1"],
             "activations": level["forward3"] - start, "gradients": level["backward3"] - start,
             "forward_transient": transient("forward3", start),
             "backward_transient": transient("backward3", level["forward3"]),
             "optimizer_transient": transient("optimizer1", level["backward1"])}
    parts["standing_buffers"] = start - level["base"] - parts["parameters"] - parts["optimizer_state"]
    parts["communication_buffers"] = parts["standing_buffers"] + max(parts["forward_transient"],
                                                                     parts["backward_transient"])
    return parts


def memory_worker(config: dict[str, Any]) -> dict[str, Any]:
    """One contender alone in this process: RSS by phase, the measured parts, peak RSS, seconds per step."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kind = config["contender"]
    job = _init(kind)
    meter = Meter()
    meter.mark("base")  # the interpreter, torch and the process group: what every part is measured above
    model = _build(kind, config["width"], config["depth"])
    meter.mark("built")
    model, optimizer = _wrap(kind, model, job)
    meter.mark("wrapped")  # construction and sharding's own peak is high["wrapped"]
    x = torch.randn(config["batch"], config["width"], generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in (1, 2, 3):  # not timed: the 1st creates Adam's state, the 3rd is a steady step (measured_parts)
        if kind == "pipeline_fsdp":
            phased_pipeline_step(job, optimizer, x, meter, step)
        else:
            phased_step(model, optimizer, x, meter, step)
    dist.barrier()
    meter.reset()
    times = []
    for _ in range(config["steps"]):
        start = time.perf_counter()
        if kind == "pipeline_fsdp":
            job.train_step(model, optimizer, _square_mean, x, torch.zeros(len(x), 1))
        else:
            _step(model, optimizer, x)
        dist.barrier()
        times.append(time.perf_counter() - start)
    meter.mark("end")
    return {"rank": dist.get_rank(), "rss": meter.level, "rss_peak_in_phase": meter.high,
            "parts": measured_parts(meter.level, meter.high), "peak_rss": meter.peak, "seconds": times,
            "held": _held_bytes(model, optimizer)}


SIDES = ("conveyor", "bare", "conveyor_untimed")  # the kinds of copy `--paired` may pair


def _side(kind: str, job: Any, width: int, depth: int) -> tuple[Any, Any]:
    """(model, optimizer) of one side of the paired run: ``conveyor`` (``job.prepare``), ``conveyor_untimed``
    (the same, its collectives set back to FSDP2's own defaults: the timing hooks' cost) or ``bare``."""
    import torch

    model = make_model(width, depth)
    if kind == "bare":
        model = _bare_fsdp2(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = job.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    if kind == "conveyor_untimed":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(DefaultAllGather())
                module.set_custom_reduce_scatter(DefaultReduceScatter())
    return model, optimizer


def side_labels(kinds: list[str]) -> list[str]:
    """The paired sides' names: their kinds, a repeated kind numbered (``bare``, ``bare2``: the A/A run)."""
    return [k if k not in kinds[:i] else f"{k}{i + 1}" for i, k in enumerate(kinds)]


def paired_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Two copies of the model in this process (``--paired``; default a conveyor fsdp and a bare FSDP2 one),
    one step of each in turn, the order swapped every pair; the first side is built first."""
    import torch
    import torch.distributed as dist

    import conveyor

    torch.set_num_threads(1)
    job = conveyor.init("fsdp")
    kinds = list(config.get("sides") or ("conveyor", "bare"))
    labels = side_labels(kinds)
    sides = {label: _side(kind, job, config["width"], config["depth"])
             for label, kind in zip(labels, kinds, strict=True)}
    x = torch.randn(config["batch"], config["width"], generator=torch.Generator().manual_seed(dist.get_rank()))
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    for i in range(1 + config["steps"]):  # the first pair warms both up and is not counted
        for side in (labels if i % 2 == 0 else labels[::-1]):
            dist.barrier()
            start = time.perf_counter()
            _step(*sides[side], x)
            dist.barrier()
            if i > 0:
                seconds[side].append(time.perf_counter() - start)
    comm = {k: v / (1 + config["steps"]) for k, v in job.strategy.step.clock.seconds().items()}  # per step
    return {"rank": dist.get_rank(), "sides": labels, "seconds": seconds, "conveyor_comm_per_step": comm}


def worker_main(config: dict[str, Any]) -> None:
    result = paired_worker(config) if config["contender"] == "paired" else memory_worker(config)
    out = Path(config["result_dir"]) / f"rank{result['rank']}.json"
    out.write_text(json.dumps(result))


# ==================================================================================================
# Parent side: starts each pair, collects, reports.
# ==================================================================================================


def _launches(config: dict[str, Any], workdir: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each of the run's processes, as `conveyor run -n 2 --strategy fsdp` gives them (``pipeline_fsdp``:
    `conveyor run -n 4 --strategy pipeline --stages 2 --shard-stages`)."""
    from conveyor.launch import OWNED_VARS, RunOptions, free_ports, local_plan

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARS and not k.startswith("CONVEYOR_")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed blocks go back to the OS (module docstring)
    shape: dict[str, Any] = {"workers": 2, "strategy": "fsdp"}
    if config["contender"] == "pipeline_fsdp":
        shape = {"workers": PROCESSES["pipeline_fsdp"], "strategy": "pipeline", "stages": 2, "shard_stages": True}
    options = RunOptions(script=str(HERE), script_args=("--worker", json.dumps(config)), **shape,
                         data_dir=str(workdir / "data"), output_dir=str(workdir / "output"), python=sys.executable)
    ports = free_ports(shape["workers"] + 1)
    plan = local_plan(options, ports[:-1], master_port=ports[-1], secret=secrets.token_bytes(32), environ=env)
    return [(list(t.argv), dict(t.env)) for t in plan.tasks]


def run_pair(config: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """Run one pair (``pipeline_fsdp``: 4 processes) to its end; every rank's results, or ``ContenderFailed`` with
    the logs' tails."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = {**config, "result_dir": str(workdir)}
    procs = []
    for r, (argv, env) in enumerate(_launches(config, workdir)):
        log = open(workdir / f"rank{r}.log", "wb")  # closed below
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    end, codes = time.monotonic() + timeout, []
    try:
        for proc, _ in procs:
            codes.append(proc.wait(timeout=max(0.1, end - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes.append(None)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            log.close()
    if codes != [0] * len(procs):
        tails = " || ".join((workdir / f"rank{r}.log").read_text(errors="replace")[-600:] for r in range(len(procs)))
        raise h.ContenderFailed(f"{config['contender']}: exit codes {codes} (None: timed out): {tails}")
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(len(procs))]


def _pair_ratios(run: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    """One paired run's per-pair ratios, other side's time / the conveyor side's (bare / conveyor in either build
    order), or for two same-kind sides (A/A) the 2nd-built's / the 1st-built's; and (denominator, numerator)."""
    s, labels = run[0]["seconds"], list(run[0].get("sides") or ["conveyor", "bare"])
    if labels[1].startswith("conveyor") and not labels[0].startswith("conveyor"):
        labels.reverse()
    return [b / c for c, b in zip(s[labels[0]], s[labels[1]], strict=True)], labels


def derive(memory: dict[str, list[dict[str, Any]] | None], paired: list[dict[str, Any]] | None,
           swapped: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Largest-rank peak RSS and median steps/s per contender, the memory ratio and the paired ratios (those of
    ``swapped``, the run with the other build order, pooled in: each order's bias cancels the other's)."""
    out: dict[str, Any] = {"peak_rss_bytes": {}, "steps_per_second": {}}
    out["parts_bytes"] = {}  # the measured parts of each contender's largest rank (the one its goal judges)
    for name, ranks in memory.items():
        if ranks:
            largest = max(ranks, key=lambda r: r["peak_rss"])
            out["peak_rss_bytes"][name] = largest["peak_rss"]
            out["parts_bytes"][name] = largest["parts"]
            out["steps_per_second"][name] = 1 / h.median(ranks[0]["seconds"])
    peak = out["peak_rss_bytes"]
    out["memory_ratio"] = h.ratio(peak.get("conveyor"), peak.get("ddp"))
    out["memory_ratio_bare"] = h.ratio(peak.get("bare_fsdp2"), peak.get("ddp"))
    out["memory_ratio_pipeline_fsdp"] = h.ratio(peak.get("pipeline_fsdp"), peak.get("ddp"))  # 4 processes, not 2
    rate = out["steps_per_second"]
    out["speed_vs_ddp"] = h.ratio(rate.get("conveyor"), rate.get("ddp"))
    if paired:
        s = paired[0]["seconds"]
        ratios, labels = _pair_ratios(paired)
        if swapped:
            out["paired_median_by_build_order"] = [h.median(ratios), h.median(_pair_ratios(swapped)[0])]
            ratios = ratios + _pair_ratios(swapped)[0]
            s = {k: v + swapped[0]["seconds"][k] for k, v in s.items()}
        out |= {"paired_sides": labels, "paired_ratios": ratios, "paired_median": h.median(ratios),
                "paired_step_ms": {k: 1e3 * h.median(v) for k, v in s.items()},
                "conveyor_comm_per_step": paired[0]["conveyor_comm_per_step"]}
    return out


PARTS = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers")
HOW = """parts measured from RSS at phase boundaries (MALLOC_MMAP_THRESHOLD_ frees large blocks to the OS), GiB:
  base = after imports and the process group, before the model; params = growth from base to the lesser of
  built and wrapped; adam = growth in the 1st optimizer.step; grads = growth from before the 3rd (steady)
  step's forward to after its backward (graph freed); activations = growth in its forward; comm = the steady
  step's standing RSS less base, params and adam (DDP's buckets) + its largest forward/backward peak above the
  phase's ends (FSDP: gathered blocks, reduce-scatter buffers); adam tmp = the 1st optimizer.step's peak above
  its end; (n) = the same by numel; pipeline_fsdp: 4 processes (2 stages x 2 shards, 1/4 of the model each),
  its schedule runs forward and backward together: activations are in its comm, 0 shown;
  sum = base + the five parts; PEAK = VmHWM over the whole run"""


def table(memory: dict[str, list[dict[str, Any]] | None], d: dict[str, Any]) -> str:
    """One row per contender and rank: the measured parts (numel's figure beside), their sum, peak RSS, steps/s."""
    gib = 2 ** 30
    rows: list[Any] = [("contender", "rank", "base", "params (n)", "grads (n)", "adam (n)", "activations", "comm",
                        "adam tmp", "sum", "PEAK RSS", "steps/s")]
    for name, ranks in memory.items():
        for r in ranks or []:
            parts, held = r["parts"], r["held"]

            def both(k: str, parts: dict[str, int] = parts, held: dict[str, int] = held) -> str:
                return f"{parts[k] / gib:.2f} ({held[k] / gib:.2f})"

            rows.append((name, str(r["rank"]), h.fmt(parts["baseline"] / gib, ".2f"),
                         *(both(k) for k in ("parameters", "gradients", "optimizer_state")),
                         h.fmt(parts["activations"] / gib, ".3f"), h.fmt(parts["communication_buffers"] / gib, ".2f"),
                         h.fmt(parts["optimizer_transient"] / gib, ".2f"),
                         h.fmt((parts["baseline"] + sum(parts[k] for k in PARTS)) / gib, ".2f"),
                         h.fmt(r["peak_rss"] / gib, ".2f"), h.fmt(1 / h.median(r["seconds"]), ".3f")))
    lines = [h.format_rows(rows, left=(0,)), HOW, "",
             f"largest-rank peak RSS / DDP's: conveyor {h.fmt(d['memory_ratio'], '.3f')}, bare FSDP2 "
             f"{h.fmt(d['memory_ratio_bare'], '.3f')}, pipeline x FSDP (4 processes) "
             f"{h.fmt(d.get('memory_ratio_pipeline_fsdp'), '.3f')}; conveyor steps/s / DDP's "
             f"{h.fmt(d['speed_vs_ddp'], '.3f')} (separate pairs)"]
    if "paired_median" in d:
        ms, (one, two) = d["paired_step_ms"], d["paired_sides"]
        lines.append(f"paired (same 2 processes, {len(d['paired_ratios'])} pairs): {two} {ms[two]:.0f} ms, "
                     f"{one} {ms[one]:.0f} ms per step; {two} / {one} median {d['paired_median']:.3f} "
                     f"(each pair: {h.fmt_all(d['paired_ratios'], '.3f')}); conveyor's timed collectives per step: "
                     + ", ".join(f"{k} {v:.3f} s" for k, v in d["conveyor_comm_per_step"].items()))
        if "paired_median_by_build_order" in d:
            lines.append("paired median by build order (conveyor built first, bare built first): "
                         + h.fmt_all(d["paired_median_by_build_order"], ".3f"))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Any:
    p = h.parser(__doc__, "a tiny model (width 256, 4 blocks), 2 steps: a smoke run, not figures")
    p.add_argument("--size-gb", type=float, default=None, help="fp32 parameter GiB of the model (default 1.0)")
    p.add_argument("--width", type=int, default=None, help=f"block width (default {WIDTH})")
    p.add_argument("--batch", type=int, default=None, help="rows per rank per step (default 8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender and pairs (default 3)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per pair of processes (default 3600: a 1 GiB fsdp pair took >1200 s at load 25-40)")
    p.add_argument("--contenders", type=h.contender_names([c.name for c in CONTENDERS]), default=None,
                   help="memory contenders to run (default all)")
    p.add_argument("--paired", type=_sides, default=None,
                   help=f"the paired run's two sides, built in this order: {', '.join(SIDES)} (default conveyor,bare; "
                        f"bare,bare: an A/A run, whose ratio shows what position alone does)")
    p.add_argument("--worker", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.worker:
        return args
    args = h.settle(p, args, {"size_gb": (1.0, 0.001), "width": (WIDTH, 256), "batch": (8, 4), "steps": (3, 2),
                              "timeout": (3600.0, 120.0), "repeats": (1, 1),
                              "contenders": (tuple(c.name for c in CONTENDERS),) * 2},
                    positive=("size_gb", "width", "batch", "steps", "timeout"))
    args.depth = max(2, round(args.size_gb * 2 ** 30 / (4 * (args.width ** 2 + args.width))))
    return args


def _sides(text: str) -> tuple[str, str]:
    import argparse

    kinds = tuple(k.strip() for k in text.split(","))
    if len(kinds) != 2 or not set(kinds) <= set(SIDES):
        raise argparse.ArgumentTypeError(f"--paired {text}: give two of {', '.join(SIDES)}, e.g. bare,bare")
    return kinds  # type: ignore[return-value]


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    import tempfile

    started, errors = time.perf_counter(), []
    machine = h.machine_start(("torch",), uptime=_uptime())
    config = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps,
              "sides": list(args.paired or ("conveyor", "bare"))}
    params = args.depth * (args.width ** 2 + args.width)
    print(f"model: {args.depth} blocks of width {args.width}: {params * 4 / 2 ** 30:.3f} GiB fp32 parameters; "
          f"uptime: {machine['uptime']}")
    memory: dict[str, list[dict[str, Any]] | None] = {}
    paired: dict[str, Any] = {}
    swap = [] if args.quick or args.paired else ["paired_swapped"]  # the other build order (module docstring)
    with tempfile.TemporaryDirectory(prefix="conveyor-sharded-") as tmp:
        for name in [*args.contenders, "paired", *swap]:
            print(f"  {name} ...", flush=True)
            sides = config["sides"][::-1] if name == "paired_swapped" else config["sides"]
            kind = "paired" if name.startswith("paired") else name  # paired_swapped: the paired run, other order
            try:
                got = run_pair({**config, "sides": sides, "contender": kind}, Path(tmp) / name, args.timeout)
            except h.ContenderFailed as e:
                errors.append(str(e)[:2000])
                got = None
            if name.startswith("paired"):
                paired[name] = got
            else:
                memory[name] = got
    d = derive(memory, paired.get("paired"), paired.get("paired_swapped"))
    goals = h.evaluate_goals(GOALS, d)
    text = table(memory, d)
    machine = h.machine_end(machine) | {"uptime_end": _uptime()}
    report = {"benchmark": NAME, "command": h.command_line(NAME, argv), "config": {**config, "parameters": params},
              "machine": machine, "contenders": [c.shown() for c in CONTENDERS], "memory_runs": memory,
              "paired_run": paired.get("paired"), "paired_swapped_run": paired.get("paired_swapped"),
              "derived": d, "goals": goals, "all_pass": all(g["pass"] for g in goals),
              "errors": errors, "table": text, "wall_seconds": time.perf_counter() - started}
    h.publish(NAME, report, h.format_goals(goals), args.out, details=f"uptime: {machine['uptime_end']}")
    return 0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
