"""The exactly-once section of benchmarks/elastic.py (issue 19): records skipped or repeated over world changes.

    python benchmarks/elastic.py --section exactly-once [--repeats R] [--quick]
    python benchmarks/elastic_exactly_once.py [--worlds 2,3,1,2,3,2] [--epochs 6] [--repeats 1]   # alone

Each round trains the digits demo's model (elastic_ids_job.py: records tagged with their id) twice with
`conveyor run` (allreduce, CPU): undisturbed on the last world's workers, and disturbed: every task stops
(as a crash) a few steps past a checkpoint, then the job resumes with the next `-n` of `--worlds`
(2 -> 3 -> 1 -> 2 -> 3 -> 2: 5 changes, all inside epoch 0, each segment ~1/6 of it), to the end. The
ids of the steps that stayed in the model are counted per epoch: a run's steps after the step the next run
resumed from (its first step - 1) were undone and do not count. Goals: 0 records skipped, 0 repeated (in
every epoch, the disturbed one first), final test accuracy within 1 point of the undisturbed run's, on
the means over the rounds (round r uses seed r, model init and shuffle, for both runs; one seed's gap is
mostly that seed's noise, shown per round).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

JOB = Path(__file__).with_name("elastic_ids_job.py")
WORLDS = (2, 3, 1, 2, 3, 2)
GOALS = (h.Goal("records skipped over the world changes (every epoch, every round)", "skipped", 0, "<="),
         h.Goal("records repeated over the world changes (every epoch, every round)", "repeated", 0, "<="),
         h.Goal("final accuracy within 1 point of the undisturbed run (mean over the rounds' seeds)",
                "accuracy_gap_points", 1.0, "<="))


def write_data(folder: Path) -> list[int]:
    """scikit-learn's digits with an `id` feature (the row) as train/test shards as the demo writes them; the
    train split's ids."""
    from sklearn.datasets import load_digits

    from conveyor.data.convert import convert_arrays

    digits = load_digits()
    arrays = {"image": (digits.images.reshape(-1, 64) / 16.0).astype(np.float32),
              "label": digits.target.astype(np.int64), "id": np.arange(len(digits.target), dtype=np.int64)}
    convert_arrays(arrays, folder, 8, splits={"train": 0.8, "test": 0.2}, seed=0, source="digits with ids",
                   overwrite=True)
    return train_ids(folder)


def train_ids(folder: Path) -> list[int]:
    from conveyor.data import Dataset, FixedLenFeature, TFRecordDataset, parse_single_example

    files = Dataset.list_files(str(folder / "train-*.tfrecord"), shuffle=False)
    feature = {"id": FixedLenFeature([], "int64")}
    return sorted(int(parse_single_example(r, feature)["id"]) for r in files.interleave(TFRecordDataset))


def job_run(world: int, data: Path, out: Path, label: str, cfg: dict[str, Any], stop_at: int | None = None
            ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(world), "--output-dir", str(out),
           "--max-restarts", "0", str(JOB), str(data), "--run", label, "--epochs", str(cfg["epochs"]),
           "--batch-size", str(cfg["batch_size"]), "--checkpoint-every", str(cfg["checkpoint_every"]),
           "--seed", str(cfg["seed"]), *(["--stop-at", str(stop_at)] if stop_at is not None else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=cfg["timeout"], env=env)


def logged_steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for log in sorted(out.glob("ids-*.jsonl")) for line in log.read_text().splitlines()]


def applied(steps: list[dict[str, Any]], labels: Sequence[str]) -> tuple[list[dict[str, Any]], int]:
    """The steps that stayed in the model, and how many steps (of all ranks) were undone: run i's steps after
    the step run i+1 resumed from (its first step - 1)."""
    first = {label: min((s["step"] for s in steps if s["run"] == label), default=None) for label in labels}
    kept, undone = [], 0
    for s in steps:
        later = labels[labels.index(s["run"]) + 1:] if s["run"] in labels else []
        resumed = first[later[0]] - 1 if later and first[later[0]] is not None else None
        if resumed is None or s["step"] <= resumed:
            kept.append(s)
        else:
            undone += 1
    return kept, undone


def tally(kept: list[dict[str, Any]], ids: list[int], epochs: int) -> list[dict[str, int]]:
    """Per epoch: ids never applied (skipped) and applications beyond the first (repeated, unknown ids too)."""
    out = []
    for epoch in range(epochs):
        counts = collections.Counter(i for s in kept if s["epoch"] == epoch for i in s["ids"])
        out.append({"skipped": sum(1 for i in ids if counts[i] == 0),
                    "repeated": sum(c - 1 for c in counts.values()) + sum(c for i, c in counts.items()
                                                                          if i not in set(ids))})
    return out


def finished(out: Path, proc: subprocess.CompletedProcess) -> float:
    """The final test accuracy of a run that ended well."""
    if proc.returncode != 0:
        raise h.ContenderFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}")
    return float(json.loads((out / "summary.json").read_text())["eval_accuracy"])


def disturbed(data: Path, out: Path, cfg: dict[str, Any], train: int) -> dict[str, Any]:
    """The job over `cfg["worlds"]`: each but the last stopped a segment's steps past where it resumed."""
    worlds, every = cfg["worlds"], cfg["checkpoint_every"]
    resume, labels, stops = 0, [], []
    for i, world in enumerate(worlds[:-1]):
        steps = max(every + 1, round(train / (len(worlds) * world * cfg["batch_size"])))
        stop = resume + steps + (1 if (resume + steps) % every == 0 else 0)  # a crash between checkpoints
        labels.append(f"run-{i}")
        proc = job_run(world, data, out, labels[-1], cfg, stop_at=stop)
        reached = max((s["step"] for s in logged_steps(out) if s["run"] == labels[-1]), default=None)
        if proc.returncode == 0 or reached != stop:
            raise h.ContenderFailed(f"world {world}: expected a stop after step {stop}, the job reached {reached} "
                                    f"(exit {proc.returncode}): {(proc.stdout + proc.stderr)[-800:]}")
        stops.append(stop)
        resume = stop - stop % every  # the last (synchronous) checkpoint
    labels.append(f"run-{len(worlds) - 1}")
    accuracy = finished(out, job_run(worlds[-1], data, out, labels[-1], cfg))
    steps = logged_steps(out)
    epochs_at_stops = [next(s["epoch"] for s in steps if s["run"] == lb and s["step"] == st)
                       for lb, st in zip(labels, stops, strict=False)]
    said = (out / "logs" / "worker-0.log").read_text().count("data redistributed")
    return {"accuracy": accuracy, "steps": steps, "labels": labels, "stops": stops,
            "epochs_at_stops": epochs_at_stops, "announced": said}


def one_round(tmp: Path, rnd: int, args: argparse.Namespace, ids: list[int]) -> dict[str, Any]:
    cfg = {"epochs": args.eo_epochs, "batch_size": args.eo_batch_size, "checkpoint_every": args.eo_checkpoint_every,
           "seed": rnd, "timeout": 600, "worlds": args.eo_worlds}
    started = time.perf_counter()
    plain_out = tmp / f"undisturbed-{rnd}"
    plain = finished(plain_out, job_run(cfg["worlds"][-1], tmp / "data", plain_out, "plain", cfg))
    plain_tally = tally(logged_steps(plain_out), ids, cfg["epochs"])
    plain_wall = time.perf_counter() - started
    run = disturbed(tmp / "data", tmp / f"disturbed-{rnd}", cfg, len(ids))
    kept, undone = applied(run["steps"], run["labels"])
    per_epoch = tally(kept, ids, cfg["epochs"])
    return {"seed": rnd, "undisturbed_accuracy": plain, "disturbed_accuracy": run["accuracy"],
            "accuracy_gap_points": abs(run["accuracy"] - plain) * 100, "per_epoch": per_epoch,
            "undisturbed_per_epoch": plain_tally, "skipped": sum(e["skipped"] for e in per_epoch),
            "repeated": sum(e["repeated"] for e in per_epoch), "steps_undone": undone, "stops": run["stops"],
            "changes_in_epoch_0": sum(1 for e in run["epochs_at_stops"] if e == 0),
            "announced": run["announced"], "undisturbed_wall_s": plain_wall,
            "disturbed_wall_s": time.perf_counter() - started - plain_wall}


def section(args: argparse.Namespace) -> dict[str, Any]:
    """The exactly-once section: its rounds, derived values, goals and table."""
    args = with_defaults(args)
    runs, errors = [], []
    with tempfile.TemporaryDirectory(prefix="conveyor-elastic-once-", dir=args.dir) as tmp:
        ids = write_data(Path(tmp) / "data")
        for rnd in range(args.repeats):
            try:
                runs.append(one_round(Path(tmp), rnd, args, ids))
                r = runs[-1]
                print(f"  round {rnd + 1}: skipped {r['skipped']}, repeated {r['repeated']}, accuracy "
                      f"{r['disturbed_accuracy']:.4f} vs {r['undisturbed_accuracy']:.4f}", flush=True)
            except (h.ContenderFailed, subprocess.TimeoutExpired) as e:
                errors.append(f"round {rnd + 1}: {e}")
                print(f"  round {rnd + 1}: FAILED {e}", flush=True)
    derived = {"skipped": sum(r["skipped"] for r in runs) if runs else None,
               "repeated": sum(r["repeated"] for r in runs) if runs else None,
               "records": len(ids), "changes": len(args.eo_worlds) - 1}
    if runs:  # one seed's gap is mostly the seed's noise (a run's final accuracy moves by points): the means'
        derived["disturbed_accuracy"] = sum(r["disturbed_accuracy"] for r in runs) / len(runs)
        derived["undisturbed_accuracy"] = sum(r["undisturbed_accuracy"] for r in runs) / len(runs)
        derived["accuracy_gap_points"] = abs(derived["disturbed_accuracy"] - derived["undisturbed_accuracy"]) * 100
        derived["largest_gap_points"] = h.highest(r["accuracy_gap_points"] for r in runs)
    return {"config": {"worlds": list(args.eo_worlds), "epochs": args.eo_epochs, "batch_size": args.eo_batch_size,
                       "checkpoint_every": args.eo_checkpoint_every, "repeats": args.repeats},
            "runs": runs, "errors": errors, "derived": derived, "goals": h.evaluate_goals(GOALS, derived),
            "table": table(runs, args, len(ids), derived)}


def table(runs: list[dict[str, Any]], args: argparse.Namespace, records: int, derived: dict[str, Any]) -> str:
    rows = [["seed", "skipped", "repeated", "changes in epoch 0", "steps undone", "accuracy", "undisturbed",
             "gap (points)"]]
    rows += [[str(r["seed"]), str(r["skipped"]), str(r["repeated"]), str(r["changes_in_epoch_0"]),
              str(r["steps_undone"]), f"{r['disturbed_accuracy']:.4f}", f"{r['undisturbed_accuracy']:.4f}",
              f"{r['accuracy_gap_points']:.2f}"] for r in runs]
    if runs:
        rows += [None, ["mean", "", "", "", "", f"{derived['disturbed_accuracy']:.4f}",
                        f"{derived['undisturbed_accuracy']:.4f}", f"{derived['accuracy_gap_points']:.2f}"]]
    worlds = " -> ".join(map(str, args.eo_worlds))
    return (f"exactly-once: conveyor run of the digits demo's model (allreduce, CPU), {records} training records "
            f"tagged with ids, {args.eo_epochs} epoch(s), batch {args.eo_batch_size} per worker, checkpoint every "
            f"{args.eo_checkpoint_every} steps; workers {worlds} ({len(args.eo_worlds) - 1} changes, each a stop "
            f"past a checkpoint and a resume with the next -n); skipped/repeated over every epoch\n"
            + h.format_rows(rows, underline=True))


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """This section's settings where elastic.py's parser has none: --quick trains 1 epoch instead of 6."""
    quick = bool(getattr(args, "quick", False))
    defaults = {"eo_worlds": WORLDS, "eo_epochs": 1 if quick else 6, "eo_batch_size": 16, "eo_checkpoint_every": 4,
                "dir": None, "repeats": 1}
    return argparse.Namespace(**{**defaults, **{k: v for k, v in vars(args).items() if v is not None}})


def main(argv: Sequence[str] | None = None) -> int:
    p = h.parser(__doc__, "1 epoch, 1 round")
    p.add_argument("--worlds", dest="eo_worlds", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
                   help="the worker counts in order (default 2,3,1,2,3,2)")
    p.add_argument("--epochs", dest="eo_epochs", type=int, default=None, help="default 6 (--quick 1)")
    p.add_argument("--dir", type=Path, default=None, help="where the runs write (default: the system's temp)")
    args = with_defaults(p.parse_args(argv))
    if len(args.eo_worlds) < 2 or min(args.eo_worlds) < 1 or args.eo_epochs < 1 or args.repeats < 1:
        p.error("--worlds needs 2 or more counts >= 1; --epochs and --repeats >= 1")
    started = time.perf_counter()
    report = section(args)
    report = {"benchmark": "elastic", "command": h.command_line("elastic_exactly_once", argv),
              "sections": {"exactly-once": report}, "goals": report["goals"], "errors": report["errors"],
              "all_pass": all(g["pass"] for g in report["goals"]), "table": report["table"],
              "wall_seconds": time.perf_counter() - started}
    h.publish("elastic-exactly-once", report, h.format_goals(report["goals"]), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
