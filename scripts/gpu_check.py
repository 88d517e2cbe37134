"""`make gpu-check`: every CUDA path of conveyor in one command, made for a lent GPU machine's few minutes.

    python3 scripts/gpu_check.py --out OUT                    # on the GPU machine (make gpu-check GPU_OUT=OUT)
    python3 scripts/gpu_check.py --out OUT --device cpu       # the same parts, tiny, on the CPU (make test does)

Parts, in order, each with a time budget it never runs past (a part that runs out is stopped and reports
what it did not run; parts after a failed install are skipped, having nothing to run with):

1. `install`: the wheels in --wheels (`make gpu-wheels` fills it) installed offline (`pip install --no-index
   --no-deps --target`) into a fresh folder put first on PYTHONPATH; checks that conveyor imports from it,
   that its requirements are met, and that it was built from this checkout's source; one line says what.
2. `tests`: pytest -m gpu over the test files that have the marker.
3. `train`: examples/cifar10/train.py --synthetic through the Trainer (bf16 on CUDA), and one point of
   benchmarks/case_study_gpu.py (ResNet-20, batch 512, conveyor's pipeline, to_torch(pin_memory=True)).
4. `case_study`: benchmarks/case_study.py --parts gpu, one workload per run, on the cores given.
5. `strategies`: one plain process against allreduce with one rank (a one-rank NCCL group on CUDA), ps-sync
   with two workers sharing the GPU, and allreduce with two (gloo); parameters equal within a tolerance,
   parameters and batches on the expected device.

Writes OUT/gpu_check.json and OUT/gpu_check.md (both described in docs/gpu_check.md); exits 0 when every part
passed, else 1, naming the part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_check_parts as parts  # noqa: E402

# conveyor.cluster.variables' PORT_RANGE_VAR and FAST_EXIT_VAR, by name: this script runs before conveyor is installed
_MACHINE_VARS = ("CONVEYOR_PORT_RANGE", "CONVEYOR_FAST_EXIT")

# Seconds per part on the GPU machine: 480 in all, the limit, inside one 600 s call. A part may also use
# what the parts before it left unused.
BUDGETS = {"install": 45, "tests": 60, "train": 100, "case_study": 215, "strategies": 60}
PARTS = tuple(BUDGETS)


def run_part(name: str, fn: Callable[[parts.Context, float], dict[str, Any]], ctx: parts.Context,
             reserve: float) -> dict:
    """One part within what is left of the whole but `reserve` (the later parts' budgets): its own budget and
    whatever the parts before it did not use. Its report, whatever it raised."""
    budget = ctx.left() - reserve
    if name != "install" and not ctx.installed:
        return {"status": "skipped", "seconds": 0.0, "budget": budget,
                "detail": "not run: conveyor was not installed (see the install part)"}
    if budget < 5:
        return {"status": "incomplete", "seconds": 0.0, "budget": budget,
                "detail": "not run: the check's time budget was spent", "skipped": [name]}
    print(f"\n== {name} (budget {budget:.0f} s)", flush=True)
    started = time.monotonic()
    try:
        report = fn(ctx, budget)
    except parts.PartFailed as e:
        report = {"status": "failed", "detail": str(e)}
    except Exception as e:  # a bug in the check itself must still leave a report naming the part
        report = {"status": "failed", "detail": f"{type(e).__name__}: {e}"}
    report = {"status": "passed", **report, "seconds": round(time.monotonic() - started, 1), "budget": budget}
    print(f"{name}: {report['status']} in {report['seconds']:.0f} s: {report.get('detail', '')}", flush=True)
    return report


def make_context(args: argparse.Namespace) -> parts.Context:
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    # No job's variables leak in (output folder, task, secret); how the machine runs processes does: the free-port
    # range (the parallel suite gives each worker its own) and the quick exit (the suite's tasks take it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") or k in _MACHINE_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run proves the code, and no GPU may leak into it
    return parts.Context(device=args.device, python=args.python, wheels=args.wheels.resolve(),
                         out=args.out.resolve(), work=work, sizes=parts.SIZES[args.device],
                         deadline=time.monotonic() + args.budget, env=env)


def verdict(report: dict[str, Any]) -> list[str]:
    """One line per part that did not pass, naming it."""
    return [f"{name}: {r['status']}: {r.get('detail', '')}" for name, r in report["parts"].items()
            if r["status"] != "passed"]


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu-check on {report['device']}: {report['result']}", "",
             f"{report['install_line']}", "",
             f"Started {report['started']}; {report['wall_seconds']:.0f} s of a {report['budget']:.0f} s budget.",
             "", "| part | status | seconds | budget | detail |", "| --- | --- | --- | --- | --- |"]
    for name, r in report["parts"].items():
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.0f} | {r['budget']:.0f} | {detail} |")
    for name, r in report["parts"].items():
        if r.get("skipped"):
            lines += ["", f"{name} did not run: {', '.join(map(str, r['skipped']))}"]
        for title, text in r.get("tables", {}).items():
            lines += ["", f"## {name}: {title}", "", "```", text.rstrip(), "```"]
        if r.get("figures"):
            lines += ["", f"## {name}: figures", "", "```json", json.dumps(r["figures"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def write_reports(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; fails without one) or cpu: every part, tiny, to prove the script")
    p.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels", help="the wheels (make gpu-wheels)")
    p.add_argument("--python", default=sys.executable, help="the interpreter to install into and test with")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole check (default {sum(BUDGETS.values())}, parts scaled to it)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)} (install always runs)")
    args = p.parse_args(argv)
    chosen = {x.strip() for x in args.parts.split(",") if x.strip()}
    if chosen - set(PARTS):
        p.error(f"--parts: unknown {', '.join(sorted(chosen - set(PARTS)))}; choose from {', '.join(PARTS)}")
    args.parts = ("install", *(x for x in PARTS[1:] if x in chosen))
    args.budget = args.budget or float(sum(BUDGETS[x] for x in args.parts))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = make_context(args)
    scale = args.budget / sum(BUDGETS[x] for x in args.parts)
    started, stamp = time.monotonic(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    report: dict[str, Any] = {"device": args.device, "started": stamp, "budget": args.budget, "parts": {},
                              "python": args.python, "wheels": str(ctx.wheels), "install_line": "not installed"}
    try:
        for i, name in enumerate(args.parts):
            reserve = sum(BUDGETS[later] for later in args.parts[i + 1:]) * scale
            report["parts"][name] = run_part(name, parts.PARTS[name], ctx, reserve)
            report["install_line"] = ctx.install_line
    finally:
        shutil.rmtree(ctx.work, ignore_errors=True)
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    failed = verdict(report)
    report["result"] = "FAILED" if failed else "passed"
    write_reports(report, ctx.out)
    print(f"\n{report['install_line']}\nreports: {ctx.out / 'gpu_check.json'}, {ctx.out / 'gpu_check.md'}")
    if failed:
        print("gpu-check FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(f"gpu-check passed on {args.device} in {report['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
