"""Failures that do not cost the job (issue 19), measured: one section per question, table + JSON.

    python benchmarks/elastic.py                          # every section (async-save, stall, goodput, exactly-once)
    python benchmarks/elastic.py --section async-save     # one section
    python benchmarks/elastic.py --quick                  # small sizes, 1 round

Sections:
  async-save  A checkpoint of an MLP trained with Adam (model + optimizer state >= 100 MB by default),
              saved through the Trainer's path (checkpoint items -> `stage_commit` -> `BackgroundSaves`)
              into a real folder (fsync on): the synchronous save's time against the asynchronous save's
              *blocked* time (what the training loop waits: the state copied to the host), one optimizer
              step before each save, contenders interleaved; the asynchronous write is let finish before
              the next save, so each blocked time is the copy alone. Goal: blocked <= 0.25 x synchronous.
  stall       `conveyor run -n 2` of the digits demo (allreduce), worker:1 SIGKILLed after step --kill-step
              (CONVEYOR_FAULT's `after-step`), once per round; each run's summary.json `recovery` block
              (conveyor.recovery: detect, stop, pause, process start, imports, group init, the script's setup,
              restore, first step): the median of each part and of the total. Goal: total <= 10 s.
  goodput     an elastic job on 4 namespace hosts (needs root), a worker host killed every --period s and back
              --down s later, against the failure-free run: benchmarks/elastic_goodput.py. Goal: >= 0.80.
  exactly-once  benchmarks/elastic_exactly_once.py: ids skipped/repeated over 5 world changes in one epoch, and
              the final accuracy against an undisturbed run. Goals: 0, 0, within 1 point.

Writes ``<out>/elastic-<timestamp>.json`` and ``elastic-latest.json`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_exactly_once  # noqa: E402
import elastic_goodput  # noqa: E402
import harness as h  # noqa: E402
from conveyor.train.checkpoint import (  # noqa: E402
    BackgroundSaves,
    CheckpointManager,
    Model,
    Stateful,
    StepWrite,
    stage_commit,
)

SAVE_CONTENDERS = (h.Contender("sync", "the default: the save written before training goes on"),
                   h.Contender("async", "--checkpoint-async: blocked while the state is copied, written after"))
SAVE_GOALS = (h.Goal("async save blocks <= 0.25x the synchronous save", "blocked_ratio", 0.25, "<="),)


def make_mlp(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP of `layers` width x width linear layers, with Adam state after one step (so the state is all there)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    train_step(model, opt, width)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    opt.zero_grad()
    model(torch.randn(8, width)).square().mean().backward()
    opt.step()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors a checkpoint holds: the parameters and Adam's two moments (and steps)."""
    tensors = list(model.state_dict().values())
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_saves(folder: Path, width: int, layers: int, repeats: int, log: Callable[[str], None] = print
                  ) -> tuple[dict[str, Any], int]:
    """Interleaved rounds of one save per contender; the sample is the blocked seconds, the run has the total."""
    model, opt = make_mlp(width, layers)
    items = {"model": Model(model), "optimizer": Stateful(opt)}
    checkpoints = CheckpointManager(folder, keep=2)
    savers = {c.name: BackgroundSaves(enabled=c.name == "async", timeout=600) for c in SAVE_CONTENDERS}  # as a run
    step = 0

    def measure(name: str, rnd: int) -> tuple[float, dict[str, float]]:
        nonlocal step
        train_step(model, opt, width)
        step += 1
        saves = savers[name]  # stage_commit below is called as the Trainer calls it

        def stage() -> Callable[[], Any]:
            out = StepWrite(step, is_chief=True, root=checkpoints.root)
            for item_name, item in items.items():
                item.save(item_name, out)
            return stage_commit(checkpoints, out, timeout=0, copy=saves.enabled, buffers=saves.buffers)

        try:
            saves.save(step, stage)
            saves.finish()
        except Exception as e:
            raise h.ContenderFailed(f"{type(e).__name__}: {e}") from e
        record = saves.records[-1]  # (the first async save allocates the host buffers the later ones reuse)
        return record["blocked_seconds"], {"blocked_s": record["blocked_seconds"], "total_s": record["total_seconds"]}

    res = h.interleaved_rounds([c.name for c in SAVE_CONTENDERS], repeats, measure, log=log,
                               describe=lambda v, run: f"blocked {v:.3f} s, total {run['total_s']:.3f} s")
    return res, state_bytes(model, opt)


def async_save(args: argparse.Namespace) -> dict[str, Any]:
    """The async-save section: its rounds, derived values, goals and table."""
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="conveyor-elastic-save-", dir=args.dir) as tmp:
        res, nbytes = measure_saves(Path(tmp), args.width, args.layers, args.repeats)
    totals = {c: [r["total_s"] if r else None for r in runs] for c, runs in res["runs"].items()}
    derived = {
        "state_mb": nbytes / 1e6,
        "sync_save_s": h.median(res["samples"]["sync"]),
        "async_blocked_s": h.median(res["samples"]["async"]),
        "async_total_s": h.median(totals["async"]),
        "blocked_ratios": h.paired(res["samples"]["async"], res["samples"]["sync"]),
    }
    derived["blocked_ratio"] = h.ratio(derived["async_blocked_s"], derived["sync_save_s"])
    goals = h.evaluate_goals(SAVE_GOALS, derived)
    rows = [["save", "blocked s (median)", "total s (median)", "samples (blocked s)"],
            ["sync", h.fmt(derived["sync_save_s"], ".3f"), h.fmt(derived["sync_save_s"], ".3f"),
             h.fmt_all(res["samples"]["sync"], ".3f")],
            ["async", h.fmt(derived["async_blocked_s"], ".3f"), h.fmt(derived["async_total_s"], ".3f"),
             h.fmt_all(res["samples"]["async"], ".3f")]]
    table = (f"async-save: MLP {args.layers} x {args.width}^2 with Adam, state {nbytes / 1e6:.0f} MB, "
             f"{args.repeats} round(s), {args.threads} torch thread(s), fsync on\n"
             + h.format_rows(rows, underline=True)
             + f"\nasync blocked / sync save: {h.fmt(derived['blocked_ratio'], '.3f')} (the medians' ratio)")
    return {"config": {"width": args.width, "layers": args.layers, "repeats": args.repeats, "threads": args.threads,
                       "order": res["order"], "contenders": {c.name: c.label for c in SAVE_CONTENDERS}},
            "samples": res["samples"], "runs": res["runs"], "errors": res["errors"], "derived": derived,
            "goals": goals, "table": table}


STALL_PARTS = ("detect", "stop", "pause", "process_start", "imports", "group_init", "setup", "restore", "first_step",
               "total")
STALL_GOALS = (h.Goal("stall after a failure <= 10 s (median total)", "total_s", 10.0, "<="),)
DIGITS = Path(__file__).resolve().parents[1] / "examples" / "digits" / "train.py"


def one_failure(tmp: Path, rnd: int, args: argparse.Namespace) -> dict[str, Any]:
    """One job with one SIGKILL of worker:1: its recovery entry (conveyor.recovery) and the job's wall seconds."""
    out = tmp / f"run-{rnd}"
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--data-dir", str(tmp / "data"),
           "--output-dir", str(out), "--max-restarts", "1", "--restart-delay", str(args.restart_delay), str(DIGITS),
           "--epochs", "1", "--batch-size", "64", "--checkpoint-every", str(max(1, args.kill_step // 2))]
    env = {**os.environ, "CONVEYOR_FAULT": f"worker:1:after-step:{args.kill_step}"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise h.ContenderFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}")
    entries = json.loads((out / "summary.json").read_text()).get("recovery") or []
    if len(entries) != 1:
        raise h.ContenderFailed(f"summary.json has {len(entries)} recovery entries, not 1")
    return {**entries[0], "job_wall_s": wall}


def stall(args: argparse.Namespace) -> dict[str, Any]:
    """The stall section: one failure per round, each part's median, the goal on the total."""
    runs, errors = [], []
    with tempfile.TemporaryDirectory(prefix="conveyor-elastic-stall-", dir=args.dir) as tmp:
        for rnd in range(args.repeats):
            try:
                runs.append(one_failure(Path(tmp), rnd, args))
                print(f"  round {rnd + 1}: total {runs[-1]['total']:.2f} s", flush=True)
            except (h.ContenderFailed, subprocess.TimeoutExpired) as e:
                errors.append(f"round {rnd + 1}: {e}")
                print(f"  round {rnd + 1}: FAILED {e}", flush=True)
    samples = {p: [r.get(p) for r in runs] for p in STALL_PARTS}
    medians = {p: h.median(samples[p]) for p in STALL_PARTS}
    derived = {"total_s": medians["total"], "medians": medians, "loadavg": os.getloadavg()}
    total = medians["total"]
    rows = [["part", "median s", "share", "samples s"]]
    rows += [[p, h.fmt(medians[p], ".2f"), h.fmt(medians[p] / total if total else None, ".0%"),
              h.fmt_all(samples[p], ".2f")] for p in STALL_PARTS]
    table = (f"stall: conveyor run -n 2 digits (allreduce, CPU), worker:1 SIGKILLed after step {args.kill_step}, "
             f"restart delay {args.restart_delay:g} s, {len(runs)} failure(s); load average "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPU(s)\n"
             + h.format_rows(rows, underline=True))
    return {"config": {"repeats": args.repeats, "kill_step": args.kill_step, "restart_delay": args.restart_delay},
            "samples": samples, "runs": runs, "errors": errors, "derived": derived,
            "goals": h.evaluate_goals(STALL_GOALS, derived), "table": table}


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"async-save": async_save, "stall": stall,
                                                                       "goodput": elastic_goodput.goodput}
SECTIONS["exactly-once"] = elastic_exactly_once.section


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "an MLP of 2 x 256^2 (under 2 MB of state), 1 round")
    p.add_argument("--section", choices=sorted(SECTIONS), action="append", default=None,
                   help="run this section (repeatable; default: every one)")
    p.add_argument("--width", type=int, default=None, help="async-save: the MLP's width (default 2048; --quick 256)")
    p.add_argument("--layers", type=int, default=None, help="async-save: linear layers (default 3: 151 MB of state)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: a task's share when several share a machine, conveyor run's "
                        "OMP_NUM_THREADS default)")
    p.add_argument("--kill-step", type=int, default=9, help="stall: worker:1 is killed after this step (default 9)")
    p.add_argument("--restart-delay", type=float, default=0.0,
                   help="stall: conveyor run's --restart-delay (default 0: the mechanism alone; the run's is 1)")
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: the system's temp)")
    elastic_goodput.add_arguments(p)
    args = p.parse_args(argv)
    args.section = [s for s in SECTIONS if s in (args.section or SECTIONS)]
    return h.settle(p, args, {"repeats": (5, 1), "width": (2048, 256), "layers": (3, 2)},
                    positive=("repeats", "width", "layers", "threads", "kill_step"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    machine = h.machine_start(("torch", "safetensors"))
    sections = {}
    for name in args.section:
        print(f"== {name}")
        sections[name] = SECTIONS[name](args)
    goals = [g for s in sections.values() for g in s["goals"]]
    report = {"benchmark": "elastic", "command": h.command_line("elastic", argv), "machine": h.machine_end(machine),
              "config": {"sections": args.section, "quick": args.quick}, "sections": sections, "goals": goals,
              "all_pass": all(g["pass"] for g in goals),
              "errors": [f"{n}: {e}" for n, s in sections.items() for e in s["errors"]],
              "table": "\n\n".join(s["table"] for s in sections.values()),
              "wall_seconds": time.perf_counter() - started}
    h.publish("elastic", report, h.format_goals(goals), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
