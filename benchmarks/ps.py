"""Parameter-server benchmark: push + pull of a model over 2 ps tasks, next to gloo all-reduce and raw TCP.

    python benchmarks/ps.py                 # default: 100 MB, 5 rounds x 3 contenders, 3 timed iterations each
    python benchmarks/ps.py --quick         # 16 MB, 1 round (smoke test, a few seconds)
    python benchmarks/ps.py --mb 50 --repeats 5 --iters 5 --out /tmp/bench-results

Contenders, each a fresh set of processes started by this script (settings as a JSON argument, result
written as a JSON file, the job secret passed in the environment, never on the command line):

- ``conveyor_ps``: 2 ps server processes, each a real :class:`conveyor.comm.transport.Server` (ZeroMQ
  ROUTER, PLAIN gate, signed frames, parts of ``PART_BYTES``) on 127.0.0.1 with a handler that stores
  pushed tensors and returns them on pull; secret from ``secrets.token_bytes(32)``. One client process
  holds a :class:`conveyor.comm.transport.Client` per server and the model as ``--tensors`` float32
  numpy arrays (default 25, sizes equal, assigned round-robin to the 2 servers). One iteration = push
  every tensor (one request each, all in flight at once with ``Client.send``, then ``Client.receive``
  every reply) then pull every tensor back the same way. GB/s = 2 x bytes / iteration time.
- ``gloo_allreduce``: 2 processes, ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT")``,
  ``dist.all_reduce`` of one float32 tensor of the same bytes; bus bandwidth = 2(n-1)/n x bytes / time
  (n = 2: bytes / time), the usual nccl-tests definition.
- ``raw_tcp``: 2 processes, one plain TCP connection on 127.0.0.1 (``TCP_NODELAY``); the client
  ``sendall``s the bytes, the echo side ``recv_into``s all of them and ``sendall``s them back, the client
  ``recv_into``s them. GB/s = 2 x bytes / time, the same accounting as ``conveyor_ps``.

Every worker runs one intra-op thread (``OMP_NUM_THREADS=1``). Each contender does one untimed
iteration then ``--iters`` timed ones (the median is that round's sample). Rounds are interleaved
(``raw_tcp, gloo_allreduce, conveyor_ps``, then reversed, ...) so drift on this noisy machine hits every
contender alike; the table reports the median per contender over rounds and keeps every sample in the
JSON. The conveyor client checks, after the timed iterations, that what it pulled equals what it pushed.

Goals (ratios of medians, same run): conveyor_ps GB/s >= 1.0 x gloo's bus bandwidth, and >= 0.5 x raw
loopback TCP. Output: an aligned table and PASS/FAIL lines on stdout; JSON (machine, config, samples,
derived values, goals) in ``<out>/ps-<timestamp>.json`` and ``<out>/ps-latest.json`` (default
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
from conveyor.launch.ports import free_ports  # noqa: E402
from machine import format_goals, loadavg, machine_facts, publish_run, write_results  # noqa: E402

HERE = Path(__file__).resolve()
DEFAULT_OUT = HERE.parent / "results"
CONTENDERS = ("raw_tcp", "gloo_allreduce", "conveyor_ps")  # round order; odd rounds reversed
SECRET_ENV = "CONVEYOR_BENCH_PS_SECRET"
GOAL_GLOO = 1.0
GOAL_TCP = 0.5
MB = 1_000_000


# ==================================================================================================
# Worker side: runs in the processes this script starts.
# ==================================================================================================


def _write(config: dict[str, Any], result: dict[str, Any]) -> None:
    Path(config["result"]).write_text(json.dumps(result))


def _summary(times: list[float], moved_bytes: float) -> dict[str, Any]:
    med = statistics.median(times)
    return {"times_s": times, "median_s": med, "gbps": moved_bytes / med / 1e9,
            "gbps_per_iter": [moved_bytes / t / 1e9 for t in times]}


def ps_server(config: dict[str, Any]) -> None:
    """One ps task: a conveyor transport Server that stores pushed tensors and returns them on pull."""
    from conveyor.comm.transport import Server

    secret = bytes.fromhex(os.environ[SECRET_ENV])
    store: dict[int, Any] = {}
    server: Server | None = None

    def handle(message):
        if message.kind == "push":
            for i, t in zip(message.header["ids"], message.tensors, strict=True):
                store[i] = t  # numpy views on ZeroMQ's receive buffers: kept as they are, no copy
            return "ok", {}
        if message.kind == "pull":
            ids = message.header["ids"]
            return "params", {"ids": ids}, [store[i] for i in ids]
        if message.kind == "stop":
            assert server is not None
            server.stop()
            return "ok", {}
        raise ValueError(f"unknown request {message.kind!r}")

    server = Server(f"127.0.0.1:{config['port']}", secret, handle, name=f"ps:{config['index']}")
    try:
        server.serve_forever()
    finally:
        server.close()


def ps_client(config: dict[str, Any]) -> None:
    """The worker: pushes the model split over the ps tasks, pulls it back, times each iteration."""
    import numpy as np

    from conveyor.comm.transport import Client

    secret = bytes.fromhex(os.environ[SECRET_ENV])
    n, count, total = len(config["ports"]), config["tensors"], config["bytes"]
    numel = total // 4 // count
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(numel, dtype=np.float32) for _ in range(count)]
    owner = [i % n for i in range(count)]  # round-robin over the ps tasks
    clients = [Client(f"127.0.0.1:{p}", secret, name=f"ps:{k}", timeout=config["timeout"], sender="worker:0")
               for k, p in enumerate(config["ports"])]
    pulled: list[Any] = [None] * count

    def iteration() -> float:
        t0 = time.perf_counter()
        pending = [(owner[i], clients[owner[i]].send("push", {"ids": [i]}, [tensors[i]])) for i in range(count)]
        for k, rid in pending:
            clients[k].receive(rid)
        pending = [(i, owner[i], clients[owner[i]].send("pull", {"ids": [i]})) for i in range(count)]
        for i, k, rid in pending:
            pulled[i] = clients[k].receive(rid).tensors[0]
        return time.perf_counter() - t0

    try:
        iteration()  # untimed: connections, handshakes, first allocations
        times = [iteration() for _ in range(config["iters"])]
        ok = all(np.array_equal(a, b) for a, b in zip(tensors, pulled, strict=True))
        stats = [c.stats for c in clients]
        for c in clients:
            c.request("stop", {})
    finally:
        for c in clients:
            c.close()
    _write(config, {**_summary(times, 2 * numel * 4 * count), "bytes": numel * 4 * count, "roundtrip_ok": ok,
                    "tensor_bytes": numel * 4, "client_stats": stats})


def gloo(config: dict[str, Any]) -> None:
    """One rank of a 2-process gloo all-reduce of ``bytes`` float32 bytes."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    rank, world = config["rank"], 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=world)
    try:
        flat = torch.ones(config["bytes"] // 4)
        times = []
        for i in range(config["iters"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            if i:
                times.append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        nbytes = flat.numel() * 4
        result = _summary(times, 2 * (world - 1) / world * nbytes)
        result.update(bytes=nbytes, busbw_gbps=result["gbps"], algbw_gbps=nbytes / result["median_s"] / 1e9)
        _write(config, result)


def tcp(config: dict[str, Any]) -> None:
    """Raw loopback TCP: side ``echo`` receives every byte and sends them back; role ``client`` times it."""
    nbytes = config["bytes"]
    buf = bytearray(nbytes)
    view = memoryview(buf)

    def recv_all(sock: socket.socket) -> None:
        got = 0
        while got < nbytes:
            n = sock.recv_into(view[got:], nbytes - got)
            if n == 0:
                raise ConnectionError("peer closed early")
            got += n

    if config["side"] == "echo":
        with socket.create_server(("127.0.0.1", config["port"])) as listener:
            conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(config["iters"] + 1):
                recv_all(conn)
                conn.sendall(view)
        return
    deadline = time.monotonic() + config["timeout"]
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", config["port"]))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    payload = memoryview(os.urandom(nbytes))
    times = []
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(config["iters"] + 1):
            t0 = time.perf_counter()
            sock.sendall(payload)
            recv_all(sock)
            if i:
                times.append(time.perf_counter() - t0)
    _write(config, {**_summary(times, 2 * nbytes), "bytes": nbytes, "roundtrip_ok": bytes(buf) == bytes(payload)})


ROLES = {"ps_server": ps_server, "ps_client": ps_client, "gloo": gloo, "tcp": tcp}


# ==================================================================================================
# Driver side.
# ==================================================================================================


def _spawn(config: dict[str, Any], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), "--worker", json.dumps(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_contender(contender: str, settings: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start the contender's processes, wait for them, return rank 0's result (``{"error": ...}`` on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-ps-") as tmp:
        result_path = str(Path(tmp) / "result.json")
        base = {**settings, "result": result_path, "timeout": timeout}
        if contender == "conveyor_ps":
            env[SECRET_ENV] = secrets.token_bytes(32).hex()
            ports = free_ports(2)
            configs = [{**base, "role": "ps_server", "index": k, "port": p} for k, p in enumerate(ports)]
            configs.append({**base, "role": "ps_client", "ports": ports})
        elif contender == "gloo_allreduce":
            port = free_ports(1)[0]
            configs = [{**base, "role": "gloo", "rank": r, "port": port} for r in range(2)]
        else:
            port = free_ports(1)[0]
            configs = [{**base, "role": "tcp", "side": side, "port": port} for side in ("echo", "client")]
        procs = [_spawn(c, env) for c in configs]
        errors = []
        deadline = time.monotonic() + timeout
        # Poll: a process that fails (or the deadline) stops the others, so nobody waits on a dead peer.
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode for p in procs)
            if failed or time.monotonic() > deadline:
                if not failed:
                    errors.append(f"timed out after {timeout:.0f} s")
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.02)
        outputs = [p.communicate()[0] for p in procs]
        for p, out in zip(procs, outputs, strict=True):
            if p.returncode:
                errors.append(f"pid {p.pid} exited {p.returncode}: {out.strip()[-800:]}")
        if errors or not Path(result_path).exists():
            return {"error": "; ".join(errors) or "no result written", "output": outputs}
        return json.loads(Path(result_path).read_text())


def run_rounds(settings: dict[str, Any], repeats: int, timeout: float) -> dict[str, Any]:
    samples: dict[str, list[float | None]] = {c: [] for c in CONTENDERS}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    order, errors = [], []
    for r in range(repeats):
        for c in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
            order.append(c)
            res = run_contender(c, settings, timeout)
            runs[c].append(res)
            if "error" in res:
                errors.append(f"round {r} {c}: {res['error']}")
                samples[c].append(None)
            else:
                samples[c].append(res["gbps"])
            shown = "failed" if samples[c][-1] is None else f"{samples[c][-1]:.3f} GB/s"
            print(f"  round {r + 1}/{repeats} {c:<15} {shown}", flush=True)
    return {"samples": samples, "runs": runs, "order": order, "errors": errors}


def _med(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def derive(res: dict[str, Any]) -> dict[str, Any]:
    s = res["samples"]
    med = {c: _med(s[c]) for c in CONTENDERS}
    paired = {name: [_ratio(a, b) if a is not None and b is not None else math.nan
                     for a, b in zip(s["conveyor_ps"], s[other], strict=True)]
              for name, other in (("conveyor_vs_gloo_busbw", "gloo_allreduce"), ("conveyor_vs_raw_tcp", "raw_tcp"))}
    return {
        "median_gbps": med,
        "min_gbps": {c: min((x for x in s[c] if x is not None), default=math.nan) for c in CONTENDERS},
        "max_gbps": {c: max((x for x in s[c] if x is not None), default=math.nan) for c in CONTENDERS},
        "conveyor_vs_gloo_busbw": _ratio(med["conveyor_ps"], med["gloo_allreduce"]),
        "conveyor_vs_raw_tcp": _ratio(med["conveyor_ps"], med["raw_tcp"]),
        "paired_per_round": paired,
        "roundtrip_ok": all(r.get("roundtrip_ok", False) for c in ("conveyor_ps", "raw_tcp") for r in res["runs"][c]
                            if "error" not in r),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


UNITS = {"conveyor_ps": "GB/s (2 x bytes / push+pull time)",
         "gloo_allreduce": "bus bandwidth GB/s (2(n-1)/n x bytes / t)",
         "raw_tcp": "GB/s (2 x bytes / send+echo time)"}


def format_table(res: dict[str, Any], d: dict[str, Any], settings: dict[str, Any], repeats: int) -> str:
    head = (f"{settings['bytes'] / MB:.0f} MB ({settings['tensors']} float32 tensors for conveyor_ps, 2 ps tasks), "
            f"{repeats} round(s) x {settings['iters']} timed iteration(s), loopback, 1 thread/process")
    rows = [("contender", "GB/s", "min", "max", "per round", "measure")]
    for c in CONTENDERS:
        rows.append((c, _fmt(d["median_gbps"][c], ".3f"), _fmt(d["min_gbps"][c], ".3f"), _fmt(d["max_gbps"][c], ".3f"),
                     " ".join(_fmt(x, ".3f") for x in res["samples"][c]), UNITS[c]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    for r in rows:
        lines.append("  ".join(v.ljust(w) if i in (0, 4, 5) else v.rjust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    pr = d["paired_per_round"]
    lines += [
        "",
        f"conveyor_ps / gloo busbw  {_fmt(d['conveyor_vs_gloo_busbw'], '.3f')}  (ratio of medians; paired per round: "
        f"{' '.join(_fmt(x, '.3f') for x in pr['conveyor_vs_gloo_busbw'])})",
        f"conveyor_ps / raw TCP     {_fmt(d['conveyor_vs_raw_tcp'], '.3f')}  (ratio of medians; paired per round: "
        f"{' '.join(_fmt(x, '.3f') for x in pr['conveyor_vs_raw_tcp'])})",
        f"data round-trips intact: {d['roundtrip_ok']}",
    ]
    return "\n".join(lines)


def goals(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, name, threshold in (
            ("conveyor_vs_gloo_busbw", "conveyor_ps GB/s >= 1.0 x gloo all-reduce bus bandwidth (same bytes, same run)",
             GOAL_GLOO),
            ("conveyor_vs_raw_tcp", "conveyor_ps GB/s >= 0.5 x raw loopback TCP (same accounting, same run)",
             GOAL_TCP)):
        value = d[key]
        out.append({"name": name, "value": value, "threshold": threshold,
                    "pass": bool(math.isfinite(value) and value >= threshold)})
    return out


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    return write_results("ps", report, out_dir)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=None, help="model size in MB of 10^6 bytes (default 100; --quick 16)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5; --quick 1)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per run (default 3; --quick 2)")
    p.add_argument("--tensors", type=int, default=25, help="tensors the conveyor model is split into (default 25)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per contender run (default 120)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON folder (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="16 MB, 1 round, 2 iterations")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, (full, quick) in {"mb": (100.0, 16.0), "repeats": (5, 1), "iters": (3, 2)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("mb", "repeats", "iters", "tensors", "timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        ROLES[config["role"]](config)
        return 0
    started = time.perf_counter()
    nbytes = int(args.mb * MB) // (4 * args.tensors) * 4 * args.tensors  # whole float32 tensors of equal size
    settings = {"bytes": nbytes, "tensors": args.tensors, "iters": args.iters}
    machine = {**machine_facts(("torch", "pyzmq")), "loadavg_start": loadavg()}
    print(f"{nbytes / MB:.0f} MB, {args.repeats} round(s) x {args.iters} iteration(s), {machine['cores']} cores")
    res = run_rounds(settings, args.repeats, args.timeout)
    d = derive(res)
    gs = goals(d)
    machine["loadavg_end"] = loadavg()
    table = format_table(res, d, settings, args.repeats)
    report = {
        "benchmark": "ps",
        "command": " ".join([Path(sys.executable).name, "benchmarks/ps.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "config": {**settings, "mb": args.mb, "repeats": args.repeats, "quick": args.quick, "timeout": args.timeout,
                   "ps_tasks": 2, "threads_per_process": 1, "order": res["order"],
                   "contenders": {"conveyor_ps": "2 conveyor.comm.transport.Server processes + 1 Client process: "
                                                 "pipelined push of every tensor, then pipelined pull",
                                  "gloo_allreduce": "torch.distributed gloo all_reduce, 2 processes, tcp:// init",
                                  "raw_tcp": "one TCP connection, sendall + echo back, 2 processes"},
                   "units": UNITS},
    }
    publish_run("ps", report, res, d, gs, table, started, format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
