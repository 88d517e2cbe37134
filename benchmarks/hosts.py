"""Several-hosts benchmark: transports and training across network-namespace hosts with capped links.

    sudo python benchmarks/hosts.py                       # default: 100 MB, caps 1000,10000,none, 2 rounds
    sudo python benchmarks/hosts.py --quick               # 16 MB, 1 round, 1 epoch (smoke run)
    sudo python benchmarks/hosts.py --caps 1000 --part transport --size-mb 100 --repeats 3

Needs root (it makes network namespaces); without it, it says so and exits with status 2. Three hosts
from ``conveyor.testing.hosts.Hosts(3)`` (host0, host1: workers; host2: the parameter server), every
host link capped by ``Hosts.cap(mbit)`` (``tc tbf``, both directions) at each of ``--caps`` in turn
(``none``: no cap, the veth pair's own speed, bounded by this machine's 2 cores). Rounds interleave the
runs (odd rounds reversed): transports cap by cap (a cap's contenders back to back), training strategy
by strategy (a strategy's caps back to back); medians over rounds, every sample kept in the JSON.

Transport (``--size-mb`` B bytes of float32, one untimed then ``--iters`` timed iterations per run; the
run's median time t is its sample). Payload bytes only are counted (no TCP/IP/Ethernet headers, no
ZeroMQ or conveyor framing); a link direction carries at most the cap C:

- ``ps_push_pull``: benchmarks/ps.py's worker and ps task (conveyor.comm.transport Client and Server:
  ZeroMQ, PLAIN gate keyed by a fresh job secret, signed frames) on host0 and host2; the model in
  pieces of at most DEFAULT_CHUNK_BYTES (4 MiB, the ps sharding's), all pushes in flight, then all
  pulls. The worker sends B and receives B, one after the other: counted 2B, ideal time 2B / C.
- ``gloo_allreduce``: ``conveyor.comm.process_group.init_process_group("gloo", "host0", ...)`` on host0
  and host1 (as the allreduce strategy joins), ``dist.all_reduce`` of B bytes. A ring all-reduce of N
  hosts sends 2(N-1)/N x B from each host while receiving as much: counted B for N = 2, ideal B / C.
- ``raw_tcp``: one TCP connection host0 -> host2, B sent and echoed back: the ps accounting, no framing.

GB/s = counted / t (Gbit/s = 8 x that), "/ cap" = GB/s / C = ideal / t; raw TCP through the same link
shows what TCP itself gets of C (MTU-sized frames carry about 96 % payload). Goals (same run):
ps_push_pull and gloo_allreduce >= 0.9 x the 1 Gbit/s cap.

Training (``--epochs`` of examples/digits/train.py, batch 32 per worker, one thread per task, no
checkpoint before the last): every job is real multi-host, one ``conveyor run --nnodes K --node-rank i
--rdzv host0:PORT --job-secret-file F`` per host (allreduce: host0, host1; ps-sync and ps-async: a
third node ``-n 0 --ps 1`` on host2). Figures from the chief's summary.json: samples/s = N workers x
batch / the chief's median step (robust to this shared machine's load spikes), wall samples/s = every
worker's samples / the chief's training wall seconds; step and comm ms = medians of the chief's step
total and communication (allreduce: DDP hook in-flight time, much of it overlapping backward; ps-*:
push + pull + wait); link ms = the least time per step the busiest link needs at the cap for the
model's bytes; "/ ref" = samples/s over the same strategy's at the reference cap (uncapped, else the
fastest) in the same round. A strategy is link-bound at a cap when "/ ref" < 0.9; the table says from
which cap on it is not. Each run records the 1-minute load; above twice the cores the report warns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
import ps as ps_bench  # noqa: E402  (its worker, ps task and echo roles, and its result summary)

# The pure parts and the report; `hosts.<name>` keeps working for the tests and scaling_model.py.
from hosts_report import (  # noqa: E402, F401
    MB,
    PS_HOST,
    STRATEGIES,
    TRAINING_NOTE,
    TRANSPORT_LABELS,
    TRANSPORTS,
    WORKER_HOSTS,
    busy_note,
    cap_key,
    cap_label,
    contender,
    counted_bytes,
    derive_training,
    derive_transport,
    format_training,
    format_transport,
    ideal_seconds,
    link_bytes_per_step,
    link_ms,
    parse_caps,
    split_contender,
    unbound_from,
    verdict,
    vs_cap,
)

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "digits" / "train.py"
CHUNK_BYTES = 4 * 1024 * 1024  # conveyor.strategies.ps.sharding.DEFAULT_CHUNK_BYTES (checked in main)
GOALS = (
    h.Goal("ps_push_pull >= 0.9 x the 1 Gbit/s link cap (payload, same run)", "ps_push_pull_vs_cap_1000", 0.9),
    h.Goal("gloo_allreduce >= 0.9 x the 1 Gbit/s link cap (payload, same run)", "gloo_allreduce_vs_cap_1000", 0.9),
)


# ==================================================================================================
# Worker side: the gloo role (the others are benchmarks/ps.py's).
# ==================================================================================================


def gloo(config: dict[str, Any]) -> None:
    """One rank of a gloo all-reduce between hosts, joined the way conveyor's allreduce strategy joins."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from conveyor.comm.process_group import init_process_group

    init_process_group("gloo", config["master"], config["port"], config["rank"], config["world"],
                       timeout=config["timeout"])
    try:
        result = ps_bench.time_allreduce(config["bytes"], config["iters"])
        if config.get("small_iters"):  # and a 4-byte one: the link's per-message latency (scaling_model.py's probe)
            result["small_median_s"] = ps_bench.time_allreduce(4, config["small_iters"])["median_s"]
    finally:
        dist.destroy_process_group()
    if config["rank"] == 0:
        ps_bench._write(config, result)


ROLES = {"ps_server": ps_bench.ps_server, "ps_client": ps_bench.ps_client, "tcp": ps_bench.tcp, "gloo": gloo}


# ==================================================================================================
# Driver side: transports.
# ==================================================================================================


class Bench:
    """The hosts and the cap they are at now (changed only when a contender needs another)."""

    def __init__(self, hosts: Any, tmp: Path) -> None:
        self.hosts = hosts
        self.tmp = tmp
        self.cap: float | None | str = "unset"
        self.jobs = 0

    def at(self, cap: float | None) -> None:
        if cap != self.cap:
            self.hosts.cap(cap)
            self.cap = cap

    def next_dir(self, what: str) -> Path:
        self.jobs += 1
        folder = self.tmp / f"{self.jobs:03d}-{what.replace('@', '-')}"
        folder.mkdir(parents=True)
        return folder


def transport_configs(transport: str, base: dict[str, Any], env: dict[str, str]) -> list[tuple[int, dict[str, Any]]]:
    """(host index, settings) of each process of ``transport``; the ps one also puts its secret in ``env``."""
    port = 5555
    if transport == "ps_push_pull":
        env[ps_bench.SECRET_ENV] = secrets.token_bytes(32).hex()
        return [(PS_HOST, {**base, "role": "ps_server", "index": 0, "port": port, "host": f"host{PS_HOST}"}),
                (WORKER_HOSTS[0], {**base, "role": "ps_client", "ports": [port], "host": f"host{PS_HOST}"})]
    if transport == "raw_tcp":
        return [(PS_HOST, {**base, "role": "tcp", "side": "echo", "port": port, "host": f"host{PS_HOST}"}),
                (WORKER_HOSTS[0], {**base, "role": "tcp", "side": "client", "port": port, "host": f"host{PS_HOST}"})]
    if transport == "gloo_allreduce":
        return [(hi, {**base, "role": "gloo", "rank": r, "world": len(WORKER_HOSTS), "master": "host0",
                      "port": port}) for r, hi in enumerate(WORKER_HOSTS)]
    raise ValueError(f"unknown transport {transport!r}")


def run_transport(bench: Bench, name: str, settings: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One run of a transport contender at its cap: rank 0's result plus the accounting (``{"error"}`` on failure)."""
    transport, key = split_contender(name)
    cap = None if key == "none" else float(key)
    bench.at(cap)
    folder = bench.next_dir(name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result_path = folder / "result.json"
    base = {**settings, "result": str(result_path), "timeout": timeout}
    procs = [bench.hosts.popen(bench.hosts[hi], [sys.executable, str(HERE), "--worker", json.dumps(config)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
             for hi, config in transport_configs(transport, base, env)]
    errors = ps_bench._wait_all(procs, timeout)
    if errors or not result_path.exists():
        return {"error": "; ".join(errors) or "no result written"}
    result = json.loads(result_path.read_text())
    counted = counted_bytes(transport, result["bytes"])
    gbps = counted / result["median_s"] / 1e9
    return {**result, "gbps": gbps, "gbit_per_s": 8 * gbps, "counted_bytes": counted, "cap_mbit": cap,
            "ideal_seconds": None if cap is None else ideal_seconds(transport, result["bytes"], cap),
            "vs_cap": vs_cap(gbps, cap), "gbps_per_iter": [counted / t / 1e9 for t in result["times_s"]]}


def transport_rounds(bench: Bench, caps: Sequence[float | None], settings: dict[str, Any], repeats: int,
                     timeout: float) -> dict[str, Any]:
    names = [contender(t, cap) for cap in caps for t in TRANSPORTS]

    def measure(name: str, rnd: int) -> tuple[float, dict[str, Any]]:
        res = run_transport(bench, name, settings, timeout)
        res["loadavg_1min"] = os.getloadavg()[0]
        if "error" in res:
            raise h.ContenderFailed(res["error"], res)
        return res["gbps"], res

    def describe(gbps: float, res: dict[str, Any]) -> str:
        return f"{gbps:.3f} GB/s = {8 * gbps:.2f} Gbit/s  (/ cap {h.fmt(res['vs_cap'], '.3f')})"

    return h.interleaved_rounds(names, repeats, measure, describe=describe)


# ==================================================================================================
# Driver side: training jobs, one `conveyor run` per host.
# ==================================================================================================


def job_nodes(strategy: str) -> list[tuple[int, int, int]]:
    """(host index, workers, ps) per node in node-rank order: a worker per worker host, ps-*: a ps-only node."""
    nodes = [(hi, 1, 0) for hi in WORKER_HOSTS]
    return nodes + ([(PS_HOST, 0, 1)] if strategy != "allreduce" else [])


def script_args(settings: dict[str, Any]) -> list[str]:
    return ["--epochs", str(settings["epochs"]), "--batch-size", str(settings["batch_size"]),
            "--checkpoint-every", str(settings["checkpoint_every"])]


def node_commands(strategy: str, script: Sequence[str], launcher: Sequence[str], secret_file: Path,
                  port: int) -> list[tuple[int, list[str]]]:
    """(host index, argv): one ``conveyor run --nnodes K --node-rank i --rdzv host0:PORT --job-secret-file F``
    per node, with the launcher's further flags ``launcher`` (folders, timeout), then SCRIPT and its arguments."""
    nodes = job_nodes(strategy)
    return [(hi, [
        sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(workers), *(["--ps", str(ps)] if ps else []),
        "--strategy", strategy, "--nnodes", str(len(nodes)), "--node-rank", str(rank), "--rdzv", f"host0:{port}",
        "--job-secret-file", str(secret_file), "--max-restarts", "0", *launcher, *script])
        for rank, (hi, workers, ps) in enumerate(nodes)]


def job_secret_file(folder: Path) -> Path:
    """A fresh job secret in ``folder``, readable by its owner only: every node's launcher reads the same file,
    as on real hosts."""
    path = folder / "job.secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def _wait_nodes(bench: Bench, procs: list[tuple[int, subprocess.Popen]], timeout: float) -> str | None:
    """Wait for every node's launcher; a failure or the deadline stops every host's processes. The error, if any."""
    deadline = time.monotonic() + timeout
    error = None
    while error is None:
        running = [p for _, p in procs if p.poll() is None]  # polls every one, so each return code is known
        failed = [(hi, p.returncode) for hi, p in procs if p.returncode]
        if failed:
            error = ", ".join(f"the launcher on host{hi} exited {code}" for hi, code in failed)
        elif not running:
            return None
        elif time.monotonic() > deadline:
            alive = ", ".join(f"host{hi}" for hi, p in procs if p.poll() is None)
            error = f"timed out after {timeout:.0f} s (the launchers on {alive} still running)"
        else:
            time.sleep(0.05)
    for hi, _ in procs:  # the others would wait at a rendezvous or in a collective
        bench.hosts.kill_host(bench.hosts[hi])
    for _, p in procs:
        p.wait(timeout=30)
    return error


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def summary_figures(s: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """What a run's summary.json contributes to the table and JSON; the step rate is every worker's batch over
    the chief's median step (a load spike on this shared machine moves the median less than the wall time)."""
    b = s.get("step_breakdown") or {}
    total, comm = b.get("total"), b.get("communication")
    return {"strategy": s["strategy"], "world_size": s["world_size"], "steps": s["steps"], "samples": s["samples"],
            "step_samples_per_second": h.ratio(s["world_size"] * batch_size, total),
            "samples_per_second": s["samples_per_second"], "wall_seconds": s["wall_seconds"],
            "eval_accuracy": s.get("eval_accuracy"), "step_breakdown": b,
            "step_ms": None if total is None else 1e3 * total, "comm_ms": None if comm is None else 1e3 * comm,
            "comm_share": h.ratio(comm, total),
            "communication": {k: v for k, v in (s.get("communication") or {}).items()
                              if k in ("push_seconds", "pull_seconds", "wait_seconds", "bytes_out_per_server",
                                       "bytes_in_per_server")}}


def run_nodes(bench: Bench, name: str, script: Sequence[str], launcher: Sequence[str], secret_file: Path,
              timeout: float, output_dir: Path | None = None) -> dict[str, Any]:
    """One multi-host job (contender ``strategy@cap``) at its cap, one launcher per host (:func:`node_commands`);
    the chief's summary.json with its ``path`` (``{"error"}`` with every host's log tail on failure)."""
    strategy, key = split_contender(name)
    bench.at(None if key == "none" else float(key))
    folder = bench.next_dir(name)
    output_dir = output_dir or folder / "output"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port = 29400 + bench.jobs % 500  # a fresh rendezvous port per job: no TIME_WAIT from the last one
    procs = []
    for hi, argv in node_commands(strategy, script, [*launcher, "--output-dir", str(output_dir)], secret_file, port):
        with open(folder / f"host{hi}.log", "wb") as log:
            procs.append((hi, bench.hosts.popen(bench.hosts[hi], argv, env=env, cwd=ROOT, stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
    error = _wait_nodes(bench, procs, timeout)
    path = output_dir / "summary.json"
    if error or not path.exists():
        logs = " || ".join(f"host{hi}: {_tail(folder / f'host{hi}.log')}" for hi, _ in procs)
        return {"error": f"{error or 'no summary.json'}: {logs[-1500:]}"}
    return {**json.loads(path.read_text()), "path": str(path)}


def run_training(bench: Bench, name: str, settings: dict[str, Any], data_dir: Path, secret_file: Path,
                 timeout: float) -> dict[str, Any]:
    """One multi-host digits job at its cap; the figures of its summary.json (``{"error"}`` on failure)."""
    started = time.perf_counter()
    summary = run_nodes(bench, name, [str(EXAMPLE), *script_args(settings)],
                        ["--timeout", str(settings["timeout"]), "--data-dir", str(data_dir)], secret_file, timeout)
    if "error" in summary:
        return summary
    run = summary_figures(summary, settings["batch_size"])
    run["launch_seconds"] = time.perf_counter() - started
    strategy, _ = split_contender(name)
    if run["strategy"] != strategy or run["world_size"] != len(WORKER_HOSTS):
        return {"error": f"summary.json says {run['strategy']!r}, world size {run['world_size']}", "summary": run}
    return run


def training_rounds(bench: Bench, caps: Sequence[float | None], strategies: Sequence[str], settings: dict[str, Any],
                    repeats: int, timeout: float) -> dict[str, Any]:
    # A strategy's caps back to back: "/ ref" compares neighbours, which this machine's drift hits alike.
    names = [contender(s, cap) for s in strategies for cap in caps]
    data_dir = bench.tmp / "data"  # shared by every job: the first chief writes the digits' TFRecord shards
    secret_file = job_secret_file(bench.tmp)

    def measure(name: str, rnd: int) -> tuple[float, dict[str, Any]]:
        res = run_training(bench, name, settings, data_dir, secret_file, timeout)
        res["loadavg_1min"] = os.getloadavg()[0]
        if "error" in res:
            raise h.ContenderFailed(res["error"], res)
        return res["step_samples_per_second"], res

    def describe(sps: float, res: dict[str, Any]) -> str:
        return (f"{sps:7.0f} samples/s ({res['samples_per_second']:.0f} by wall)  step {h.fmt(res['step_ms'], '.1f')} "
                f"ms, comm {h.fmt(res['comm_share'], '.0f', 100)} %  ({res['launch_seconds']:.0f} s in all)")

    return h.interleaved_rounds(names, repeats, measure, describe=describe)


def model_bytes() -> int:
    """The digits example's parameter bytes (its own ``Net``, loaded by file path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conveyor_example_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sum(p.numel() * p.element_size() for p in module.Net().parameters())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "16 MB, 1 round, 1 epoch, 1 timed iteration")
    p.add_argument("--caps", type=parse_caps, default=parse_caps("1000,10000,none"),
                   help="link caps in Mbit/s per direction, comma-separated, 'none' for uncapped "
                        "(default 1000,10000,none)")
    p.add_argument("--size-mb", type=float, default=None, help="transport payload B in MB of 10^6 bytes "
                                                                "(default 100; --quick 16)")
    p.add_argument("--iters", type=int, default=None, help="timed transport iterations per run (default 3; --quick 1)")
    p.add_argument("--epochs", type=int, default=None, help="digits epochs per training job (default 6; --quick 1)")
    p.add_argument("--batch-size", type=int, default=32, help="digits batch per worker (default 32)")
    p.add_argument("--strategies", type=h.contender_names(STRATEGIES), default=STRATEGIES,
                   help=f"training strategies, comma-separated subset of {','.join(STRATEGIES)} (default all)")
    p.add_argument("--part", choices=("all", "transport", "training"), default="all",
                   help="what to measure (default all)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run or job before it is stopped "
                                                                "(default 240)")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return h.settle(p, p.parse_args(argv), {"size_mb": (100.0, 16.0), "repeats": (2, 1), "iters": (3, 1),
                                            "epochs": (6, 1)},
                    positive=("size_mb", "repeats", "iters", "epochs", "batch_size", "timeout"))


def settings_of(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transport settings, training settings): B rounded down to whole float32 pieces of <= 4 MiB."""
    tensors = max(1, math.ceil(int(args.size_mb * MB) / CHUNK_BYTES))
    nbytes = int(args.size_mb * MB) // (4 * tensors) * 4 * tensors
    return ({"bytes": nbytes, "tensors": tensors, "iters": args.iters},
            {"epochs": args.epochs, "batch_size": args.batch_size, "checkpoint_every": 100_000,
             "timeout": max(60, int(args.timeout / 2))})


def measure_all(args: argparse.Namespace, transport: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    from conveyor.testing.hosts import Hosts

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-hosts-") as tmp, Hosts(3) as hosts:
        bench = Bench(hosts, Path(tmp))
        if args.part in ("all", "transport"):
            print(f"transport: {transport['bytes'] / MB:.0f} MB, caps {', '.join(map(cap_label, args.caps))}")
            out["transport"] = transport_rounds(bench, args.caps, transport, args.repeats, args.timeout)
        if args.part in ("all", "training"):
            print(f"training: digits, {training['epochs']} epoch(s), {', '.join(args.strategies)}")
            out["training"] = training_rounds(bench, args.caps, args.strategies, training, args.repeats, args.timeout)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        ROLES[config["role"]](config)
        return 0
    from conveyor.testing.hosts import unavailable

    why = unavailable()
    if why:
        print(f"benchmarks/hosts.py cannot run here: {why} (it makes network namespaces; run it as root)",
              file=sys.stderr)
        return 2
    from conveyor.strategies.ps.sharding import DEFAULT_CHUNK_BYTES

    assert CHUNK_BYTES == DEFAULT_CHUNK_BYTES, "the ps sharding's piece size changed: update CHUNK_BYTES"
    started = time.perf_counter()
    transport, training = settings_of(args)
    machine = h.machine_start(("torch", "pyzmq"))
    res = measure_all(args, transport, training)
    derived: dict[str, Any] = {}
    tables, errors = [], []
    if "transport" in res:
        derived["transport"] = derive_transport(res["transport"], args.caps)
        derived.update({k: v for k, v in derived["transport"].items() if k.endswith("_vs_cap_1000")})
        tables.append(format_transport(derived["transport"], args.caps, transport, args.repeats))
        errors += [f"transport {e}" for e in res["transport"]["errors"]]
    if "training" in res:
        derived["training"] = derive_training(res["training"], args.caps, args.strategies, model_bytes())
        tables.append(format_training(derived["training"], args.caps, training, args.repeats))
        errors += [f"training {e}" for e in res["training"]["errors"]]
    gs = h.evaluate_goals(GOALS, derived) if "transport" in res else []
    note = busy_note([r for part in res.values() for rs in part["runs"].values() for r in rs], machine["cores"])
    if note:
        tables.append(note)
    report = {
        "benchmark": "hosts", "command": h.command_line("hosts", argv), "machine": h.machine_end(machine),
        "config": {"caps_mbit": [cap_key(c) for c in args.caps], "strategies": list(args.strategies),
                   "repeats": args.repeats, "quick": args.quick,
                   "part": args.part, "timeout": args.timeout, "transport": transport, "training": training,
                   "hosts": {"workers": [f"host{i}" for i in WORKER_HOSTS], "ps": f"host{PS_HOST}"},
                   "contenders": TRANSPORT_LABELS, "training_note": TRAINING_NOTE,
                   "order": {k: v["order"] for k, v in res.items()}},
        "samples": {k: v["samples"] for k, v in res.items()}, "runs": {k: v["runs"] for k, v in res.items()},
        "derived": derived, "goals": gs, "all_pass": all(g["pass"] for g in gs), "errors": errors,
        "table": "\n\n".join(tables), "wall_seconds": time.perf_counter() - started,
    }
    h.publish("hosts", report, h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
