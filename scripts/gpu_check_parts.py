"""The five parts of scripts/gpu_check.py, each `part(ctx, budget) -> report` (see that file for the contract).

A report is a dict: `status` (passed unless set: failed, incomplete), `detail` (one line), and where there is
something to show `figures` (JSON), `tables` (title -> text) and `skipped` (what the budget left out). A
part raises PartFailed with a message naming what broke; every process it starts is stopped at its budget.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "scripts" / "gpu_check_child.py"
POINT_PREFIX = "CASE_STUDY_GPU_POINT "  # benchmarks/case_study_gpu.py's result line

# How big each part runs. cuda: the figures (ResNet-20 at batch 512; the case study on 1..16 cores);
# cpu: the smallest sizes that still run every line of the same code.
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {"train_steps": 60, "train_batch": 512, "point_steps": 40, "point_warmup": 5, "point_batch": 512,
             "images": 10_000, "shards": 16, "workloads": ("cifar", "chexnet"), "cores": (1, 2, 4, 8, 16),
             "gpu_steps": 20, "gpu_warmup": 3, "quick": False, "point_timeout": 60, "tolerance": 1e-4},
    "cpu": {"train_steps": 2, "train_batch": 16, "point_steps": 2, "point_warmup": 1, "point_batch": 16,
            "images": 256, "shards": 2, "workloads": ("cifar",), "cores": (1,), "gpu_steps": 2, "gpu_warmup": 1,
            "quick": True, "point_timeout": 60, "tolerance": 1e-5},
}


class PartFailed(Exception):
    """A part's check failed; the message names what and, where known, the fix."""


@dataclass
class Context:
    """What every part reads: the interpreter, where things go, the sizes for this device, the deadline."""

    device: str
    python: str
    wheels: Path
    out: Path
    work: Path
    sizes: dict[str, Any]
    deadline: float
    env: dict[str, str] = field(default_factory=dict)
    installed: bool = False
    install_line: str = "not installed"

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run(cmd: Sequence[str], timeout: float, env: dict[str, str], cwd: Path = ROOT) -> tuple[int | None, str]:
    """Run to the end or to `timeout` seconds; (exit status, or None when stopped, and the output). Its own
    process session, so that a stop takes every process it started (a launcher's tasks) with it."""
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever it left behind goes too
            os.killpg(proc.pid, signal.SIGKILL)
    if code is None:
        output, _ = proc.communicate()
    return code, output


def tail(text: str, chars: int = 1500) -> str:
    return text.strip()[-chars:]


def expected_device(ctx: Context) -> str:
    return "cuda:0" if ctx.device == "cuda" else "cpu"


# ------------------------------------------------------------------------------------------------ install


def wheel_files(folder: Path) -> dict[str, tuple[str, Path]]:
    """{distribution name: (version, wheel)}; PartFailed on an empty folder or two wheels of one name."""
    found: dict[str, tuple[str, Path]] = {}
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        name = name.lower().replace("_", "-")
        if name in found:
            raise PartFailed(f"two wheels of {name} in {folder} ({found[name][1].name}, {wheel.name}): pip would "
                             f"refuse both; delete the folder and run make gpu-wheels again")
        found[name] = (version, wheel)
    if "conveyor" not in found:
        raise PartFailed(f"no conveyor wheel in {folder}: run `make gpu-wheels` on the development machine (it "
                         f"downloads what the GPU image lacks and builds conveyor's wheel), then carry the folder")
    return found


def source_digest(package: Path) -> dict[str, str]:
    return {str(p.relative_to(package)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(package.rglob("*.py"))}


def check_fresh(site: Path) -> None:
    """The installed conveyor must be this checkout's: a stale wheel would test other code than the tree's."""
    here, there = source_digest(ROOT / "src" / "conveyor"), source_digest(site / "conveyor")
    differ = sorted(k for k in here.keys() | there.keys() if here.get(k) != there.get(k))
    if differ:
        raise PartFailed(f"the conveyor wheel was built from other source than this checkout ({len(differ)} files "
                         f"differ, e.g. {', '.join(differ[:3])}): run `make gpu-wheels` again before the run")


def driver_version() -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi failed ({e})"
    return out.splitlines()[0] if out else "unknown"


def install(ctx: Context, budget: float) -> dict[str, Any]:
    wheels = wheel_files(ctx.wheels)
    site = ctx.work / "site"
    cmd = [ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(site), *(str(w) for _, w in wheels.values())]
    started = time.monotonic()
    code, output = run(cmd, budget * 0.6, ctx.env)
    if code != 0:
        raise PartFailed(f"pip install --no-index of {len(wheels)} wheels failed ({code}): {tail(output)}")
    env = dict(ctx.env, PYTHONPATH=os.pathsep.join(x for x in (str(site), ctx.env.get("PYTHONPATH")) if x))
    code, output = run([ctx.python, str(CHILD), "probe", str(site)], budget - (time.monotonic() - started), env)
    if code != 0:
        why = "stopped at the part's budget" if code is None else f"exit {code}"
        raise PartFailed(f"importing conveyor and torch from the installed wheels: {why}: {tail(output)}")
    probe = json.loads(output.strip().splitlines()[-1])
    if not probe["from_site"]:
        raise PartFailed(f"conveyor imports from {probe['conveyor_file']}, not from the fresh install in {site}")
    if probe["unmet"]:
        raise PartFailed(f"conveyor's requirements unmet: {', '.join(probe['unmet'])}; add them to GPU_NEEDS in "
                         f"the Makefile and run make gpu-wheels again")
    check_fresh(site)
    cuda = f"CUDA {probe['torch_cuda']}" if probe["torch_cuda"] else "no CUDA build"
    gpu = f"{probe['device_name']}{' (bf16)' if probe['bf16'] else ''}" if probe["cuda_available"] else "no GPU"
    ctx.install_line = (f"installed {', '.join(f'{n} {v}' for n, (v, _) in wheels.items())} into {site} (Python "
                        f"{probe['python']}); torch {probe['torch']}, {cuda}, driver {driver_version()}, {gpu}")
    print(ctx.install_line, flush=True)
    if ctx.device == "cuda" and not probe["cuda_available"]:
        raise PartFailed(f"torch {probe['torch']} sees no CUDA device: nothing below could use a GPU")
    ctx.env, ctx.installed = env, True
    return {"detail": ctx.install_line, "figures": probe | {"wheels": {n: v for n, (v, _) in wheels.items()}}}


# ------------------------------------------------------------------------------------------------ tests


def junit_counts(path: Path) -> dict[str, Any]:
    """Counts and skip reasons from pytest's --junitxml file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["skip_reasons"] = sorted({s.get("message", "") for s in suite.iter("skipped")})
    return counts


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def tests(ctx: Context, budget: float) -> dict[str, Any]:
    files = gpu_test_files()
    if not files:
        raise PartFailed("no test file under tests/ has a test marked gpu")
    junit = ctx.work / "junit.xml"
    cmd = [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    code, output = run(cmd, budget, ctx.env)
    counts = junit_counts(junit) if junit.is_file() else {}
    detail = (f"{counts.get('passed', 0)} passed, {counts.get('skipped', 0)} skipped, {counts.get('failures', 0)} "
              f"failed, {counts.get('errors', 0)} errors in {len(files)} files")
    if code is None:
        return {"status": "incomplete", "detail": f"stopped at its budget: {tail(output, 600)}", "skipped": files}
    if code != 0:
        raise PartFailed(f"pytest -m gpu: {detail}: {tail(output)}")
    if ctx.device == "cuda" and not counts.get("passed"):
        raise PartFailed(f"pytest -m gpu ran no test on the GPU ({detail}): {counts.get('skip_reasons')}")
    return {"detail": detail, "figures": counts | {"files": files}}


# ------------------------------------------------------------------------------------------------ train


def example_run(ctx: Context, timeout: float) -> dict[str, Any]:
    """examples/cifar10/train.py --synthetic for a fixed number of steps; its summary's figures."""
    s, out = ctx.sizes, ctx.work / "cifar10"
    cmd = [ctx.python, str(ROOT / "examples" / "cifar10" / "train.py"), "--synthetic", "--epochs", "1",
           "--synthetic-size", str(s["train_batch"] * s["train_steps"]), "--batch-size", str(s["train_batch"]),
           "--max-steps", str(s["train_steps"]), "--log-every", str(s["train_steps"]), "--checkpoint-every", "100000"]
    if ctx.device == "cuda":
        cmd.append("--amp")  # on the CPU it would say so, and the check below would catch it
    env = dict(ctx.env, CONVEYOR_OUTPUT_DIR=str(out), CONVEYOR_DATA_DIR=str(ctx.work / "data"))
    code, output = run(cmd, timeout, env)
    if code != 0:
        raise PartFailed(f"examples/cifar10/train.py --synthetic: {'stopped at its budget' if code is None else code}"
                         f": {tail(output)}")
    if ctx.device == "cuda" and ("runs on the CPU" in output or "has no bfloat16" in output):
        raise PartFailed(f"examples/cifar10/train.py did not train on the GPU in bfloat16: {tail(output, 600)}")
    summary = json.loads((out / "summary.json").read_text())
    if summary["steps"] != s["train_steps"]:
        raise PartFailed(f"the example ran {summary['steps']} steps, not {s['train_steps']}")
    keys = ("samples_per_second", "input_wait_fraction", "accelerator_idle_fraction", "steps", "wall_seconds")
    return {k: summary[k] for k in keys} | {"batch": s["train_batch"], "step_breakdown": summary["step_breakdown"]}


def png_files(ctx: Context, timeout: float) -> list[str]:
    """case_study_input's CIFAR-shaped PNG shards in ctx.work/data (the case study part finds them cached)."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import case_study_input as inp; "
            f"d = inp.prepare_data({str(ctx.work / 'data')!r}, {ctx.sizes['images']}, {ctx.sizes['shards']}); "
            "print(json.dumps([f for f in d['files'] if '/sharded/' in f]))")
    status, output = run([ctx.python, "-c", code], timeout, ctx.env)
    if status != 0:
        raise PartFailed(f"making the CIFAR-shaped PNG shards: {status}: {tail(output)}")
    return json.loads(output.strip().splitlines()[-1])


def feeding_point(ctx: Context, timeout: float) -> dict[str, Any]:
    """One point of benchmarks/case_study_gpu.py: ResNet-20 fed by conveyor's pipeline through
    to_torch(pin_memory=True), GPU busy time from CUDA events."""
    s = ctx.sizes
    started = time.monotonic()
    config = {"workload": "cifar", "feeder": "conveyor", "cores": len(os.sched_getaffinity(0)), "size": 32,
              "batch": s["point_batch"], "files": png_files(ctx, timeout), "device": ctx.device,
              "warmup": s["point_warmup"], "steps": s["point_steps"]}
    left = timeout - (time.monotonic() - started)
    cmd = [ctx.python, str(ROOT / "benchmarks" / "case_study_gpu.py"), "--point", json.dumps(config)]
    code, output = run(cmd, left, ctx.env)
    lines = [x for x in output.splitlines() if x.startswith(POINT_PREFIX)]
    if code != 0 or not lines:
        raise PartFailed(f"case_study_gpu.py --point (ResNet-20, batch {s['point_batch']}): "
                         f"{'stopped at its budget' if code is None else code}: {tail(output)}")
    result = json.loads(lines[-1][len(POINT_PREFIX):])
    if ctx.device == "cuda" and (result["device_name"] == "cpu" or not result["amp"]):
        raise PartFailed(f"the feeding point ran on {result['device_name']} with amp={result['amp']}, not on the "
                         f"GPU in bfloat16")
    return result | {"batch": s["point_batch"], "cores": config["cores"]}


def train(ctx: Context, budget: float) -> dict[str, Any]:
    started = time.monotonic()
    example = example_run(ctx, budget * 0.5)
    point = feeding_point(ctx, budget - (time.monotonic() - started))
    goals = {"gpu_idle_at_most_5pct": point["device_idle_fraction"] <= 0.05,
             "input_wait_at_most_2pct": point["input_wait_fraction"] <= 0.02}
    detail = (f"example: {example['samples_per_second']:.0f} samples/s, input wait "
              f"{example['input_wait_fraction']:.1%}; ResNet-20 batch {point['batch']} fed by conveyor: "
              f"{point['samples_per_second']:.0f} samples/s, GPU idle {point['device_idle_fraction']:.1%}, input "
              f"wait {point['input_wait_fraction']:.1%}")
    if not all(math.isfinite(v) and v > 0 for v in (example["samples_per_second"], point["samples_per_second"])):
        raise PartFailed(f"a rate that is not a positive number: {detail}")
    return {"detail": detail, "figures": {"example": example, "feeding_point": point, "goals_met": goals}}


# ------------------------------------------------------------------------------------------------ case study


def case_study_command(ctx: Context, workload: str, out: Path) -> list[str]:
    s = ctx.sizes
    cores = [k for k in s["cores"] if k <= len(os.sched_getaffinity(0))] or [1]
    return [ctx.python, str(ROOT / "benchmarks" / "case_study.py"), "--parts", "gpu", "--gpu-workloads", workload,
            "--gpu-cores", ",".join(map(str, cores)), "--gpu-device", ctx.device, "--repeats", "1",
            "--gpu-steps", str(s["gpu_steps"]), "--gpu-warmup", str(s["gpu_warmup"]), "--workers", "1",
            "--train-images", str(s["images"]), "--shards", str(s["shards"]), "--timeout", str(s["point_timeout"]),
            "--data", str(ctx.work / "data"), "--out", str(out), *(["--quick"] if s["quick"] else [])]


def case_study_workload(ctx: Context, workload: str, timeout: float) -> dict[str, Any] | None:
    """One workload's run of case_study.py --parts gpu; its gpu_feeding report, or None if stopped."""
    out = ctx.work / f"case_study_{workload}"
    code, output = run(case_study_command(ctx, workload, out), timeout, ctx.env)
    if code is None:
        return None
    if code != 0:
        raise PartFailed(f"case_study.py --parts gpu --gpu-workloads {workload}: {code}: {tail(output)}")
    part = json.loads((out / "case_study-latest.json").read_text())["gpu_feeding"]
    if part.get("skipped"):
        raise PartFailed(f"case_study.py skipped its GPU part: {part['skipped']}")
    if part["errors"]:
        raise PartFailed(f"case_study.py {workload}: {'; '.join(part['errors'])[:1500]}")
    if part.get("plot"):
        ctx.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(part["plot"], ctx.out / f"gpu_feeding_{workload}.png")
    return part


def case_study(ctx: Context, budget: float) -> dict[str, Any]:
    started, done, skipped, tables = time.monotonic(), {}, [], {}
    for workload in ctx.sizes["workloads"]:
        left = budget - (time.monotonic() - started)
        part = case_study_workload(ctx, workload, left) if left >= 20 and not skipped else None
        if part is None:
            skipped.append(workload)
            continue
        d = part["derived"][workload]
        done[workload] = {"ceiling_samples_per_second": d["ceiling_samples_per_second"],
                          "cores_needed": {f: d[f]["cores_needed"] for f in ("conveyor", "dataloader")},
                          "conveyor_vs_dataloader": d["conveyor_vs_dataloader"], "derived": d}
        tables[workload] = part["table"]
    detail = "; ".join(f"{w}: cores to 95% of the ceiling: conveyor {v['cores_needed']['conveyor']}, DataLoader "
                       f"{v['cores_needed']['dataloader']}" for w, v in done.items())
    report = {"detail": detail or "nothing ran", "figures": done, "tables": tables}
    if skipped:
        report |= {"status": "incomplete", "skipped": [f"workload {w} (budget)" for w in skipped]}
    return report


# ------------------------------------------------------------------------------------------------ strategies


# name -> (strategy, workers, conveyor run's flags): three jobs of the same training as the plain reference
JOBS = {"allreduce-1": ("allreduce", 1, ("-n", "1", "--strategy", "allreduce")),
        "ps-sync-2-shared": ("ps-sync", 2, ("-n", "2", "--ps", "1", "--strategy", "ps-sync", "--share-gpus")),
        "allreduce-2-shared": ("allreduce", 2, ("-n", "2", "--strategy", "allreduce", "--share-gpus"))}


def strategy_runs(ctx: Context, base: Path) -> dict[str, list[str]]:
    """name -> command: the plain reference and the JOBS."""
    runs = {"reference": [ctx.python, str(CHILD), "reference", str(base / "reference.json")]}
    for name, (_, _, flags) in JOBS.items():
        runs[name] = [ctx.python, "-m", "conveyor", "run", *flags, "--output-dir", str(base / name / "output"),
                      "--data-dir", str(base / "data"), "--timeout", "60", "--max-restarts", "0", "--linger", "5",
                      str(CHILD), "task", str(base / name)]
    return runs


def check_job(ctx: Context, name: str, folder: Path, reference: list[float]) -> list[str]:
    """What is wrong with one job's ranks: strategy, devices, backends, parameters against the reference."""
    strategy, world, _ = JOBS[name]
    want = expected_device(ctx)
    backend = "nccl" if ctx.device == "cuda" and world == 1 else "gloo"  # shared GPUs: gloo (no NCCL)
    problems = []
    for rank in range(world):
        path = folder / f"rank{rank}.json"
        if not path.is_file():
            return [f"{name}: rank {rank} wrote no result"]
        r = json.loads(path.read_text())
        if not Path(r["conveyor_file"]).resolve().is_relative_to((ctx.work / "site").resolve()):
            problems.append(f"{name} rank {rank}: imported conveyor from {r['conveyor_file']}, not the fresh install")
        if r["strategy"] != strategy or r["world_size"] != world:
            problems.append(f"{name} rank {rank}: ran {r['strategy']} with {r['world_size']} ranks")
        if r["device"] != want or r["param_devices"] != [want] or r["batch_devices"] != [want]:
            problems.append(f"{name} rank {rank}: device {r['device']}, parameters on {r['param_devices']}, batches "
                            f"on {r['batch_devices']}; expected {want} for all")
        if r["backend"] != backend or (world == 1 and r["one_rank_group"] != backend):
            problems.append(f"{name} rank {rank}: backend {r['backend']}, one-rank group {r['one_rank_group']}; "
                            f"expected {backend}")
        gap = max(abs(a - b) for a, b in zip(r["params"], reference, strict=True))
        if not gap <= ctx.sizes["tolerance"]:
            problems.append(f"{name} rank {rank}: parameters differ from one process's by {gap:.2e} (tolerance "
                            f"{ctx.sizes['tolerance']:.0e})")
    return problems


def strategies(ctx: Context, budget: float) -> dict[str, Any]:
    base = ctx.work / "strategies"
    runs = strategy_runs(ctx, base)
    for name in runs:
        (base / name).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(runs)) as pool:  # side by side: four small jobs, one GPU, many cores
        results = dict(zip(runs, pool.map(lambda cmd: run(cmd, budget - 2, ctx.env), runs.values()), strict=True))
    broken = [f"{n}: {'stopped at its budget' if c is None else f'exit {c}'}: {tail(o, 800)}"
              for n, (c, o) in results.items() if c != 0]
    if broken:
        raise PartFailed("; ".join(broken))
    ref = json.loads((base / "reference.json").read_text())
    if ref["device"] != expected_device(ctx) or ref["param_devices"] != [expected_device(ctx)]:
        raise PartFailed(f"the reference trained on {ref['param_devices']}, not {expected_device(ctx)}")
    problems = [p for name in JOBS for p in check_job(ctx, name, base / name, ref["params"])]
    if problems:
        raise PartFailed("; ".join(problems))
    return {"detail": f"allreduce (1 rank, {'NCCL' if ctx.device == 'cuda' else 'gloo'} group), ps-sync (2 workers "
                      f"sharing the device) and allreduce (2 sharing, gloo) equal one process within "
                      f"{ctx.sizes['tolerance']:.0e}, all on {expected_device(ctx)}"}


PARTS = {"install": install, "tests": tests, "train": train, "case_study": case_study, "strategies": strategies}
