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
import harness as h  # noqa: E402
from conveyor.launch.ports import free_ports  # noqa: E402
from machine import write_results  # noqa: E402

HERE = Path(__file__).resolve()
CONTENDERS_SPEC = (  # round order; odd rounds reversed
    h.Contender("raw_tcp", "one TCP connection, sendall + echo back, 2 processes"),
    h.Contender("gloo_allreduce", "torch.distributed gloo all_reduce, 2 processes, tcp:// init"),
    h.Contender("conveyor_ps", "2 conveyor.comm.transport.Server processes + 1 Client process: "
                               "pipelined push of every tensor, then pipelined pull"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)
SECRET_ENV = "CONVEYOR_BENCH_PS_SECRET"
GOALS = (
    h.Goal("conveyor_ps GB/s >= 1.0 x gloo all-reduce bus bandwidth (same bytes, same run)",
           "conveyor_vs_gloo_busbw", 1.0),
    h.Goal("conveyor_ps GB/s >= 0.5 x raw loopback TCP (same accounting, same run)", "conveyor_vs_raw_tcp", 0.5),
)
MB = 1_000_000


# ==================================================================================================
# Worker side: runs in the processes this script starts.
# ==================================================================================================


def _write(config: dict[str, Any], result: dict[str, Any]) -> None:
    Path(config["result"]).write_text(json.dumps(result))


def _host(config: dict[str, Any]) -> str:
    """Where the server (ps task, echo side) listens: loopback here; benchmarks/hosts.py names another host."""
    return config.get("host", "127.0.0.1")


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

    server = Server(f"{_host(config)}:{config['port']}", secret, handle, name=f"ps:{config['index']}")
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
    clients = [Client(f"{_host(config)}:{p}", secret, name=f"ps:{k}", timeout=config["timeout"], sender="worker:0")
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

    rank = config["rank"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=2)
    try:
        result = time_allreduce(config["bytes"], config["iters"])
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _write(config, result)


def time_allreduce(nbytes: int, iters: int) -> dict[str, Any]:
    """One untimed and ``iters`` timed ``all_reduce`` of ``nbytes`` float32 bytes in the default group,
    each between barriers; the summary with bus bandwidth ``2(n-1)/n x bytes / t`` as ``gbps``."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    flat = torch.ones(nbytes // 4)
    times = []
    for i in range(iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        if i:
            times.append(time.perf_counter() - t0)
    dist.barrier()
    nbytes = flat.numel() * 4
    result = _summary(times, 2 * (world - 1) / world * nbytes)
    result.update(bytes=nbytes, busbw_gbps=result["gbps"], algbw_gbps=nbytes / result["median_s"] / 1e9,
                  sum_ok=bool((flat == float(world) ** (iters + 1)).all()))
    return result


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
        with socket.create_server((_host(config), config["port"])) as listener:
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
            sock = socket.create_connection((_host(config), config["port"]))
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


def _configs(contender: str, base: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    """The settings of each process of `contender` (the conveyor one also gets its secret in `env`)."""
    if contender == "conveyor_ps":
        env[SECRET_ENV] = secrets.token_bytes(32).hex()
        ports = free_ports(2)
        configs = [{**base, "role": "ps_server", "index": k, "port": p} for k, p in enumerate(ports)]
        return [*configs, {**base, "role": "ps_client", "ports": ports}]
    port = free_ports(1)[0]
    if contender == "gloo_allreduce":
        return [{**base, "role": "gloo", "rank": r, "port": port} for r in range(2)]
    return [{**base, "role": "tcp", "side": side, "port": port} for side in ("echo", "client")]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every process; a process that fails (or the deadline) stops the others, so nobody waits on a
    dead peer. The errors, one per failed process."""
    errors = []
    deadline = time.monotonic() + timeout
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
    return errors


def run_contender(contender: str, settings: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start the contender's processes, wait for them, return rank 0's result (``{"error": ...}`` on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-ps-") as tmp:
        result_path = Path(tmp) / "result.json"
        configs = _configs(contender, {**settings, "result": str(result_path), "timeout": timeout}, env)
        errors = _wait_all([_spawn(c, env) for c in configs], timeout)
        if errors or not result_path.exists():
            return {"error": "; ".join(errors) or "no result written"}
        return json.loads(result_path.read_text())


def run_rounds(settings: dict[str, Any], repeats: int, timeout: float) -> dict[str, Any]:
    def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
        res = run_contender(c, settings, timeout)
        if "error" in res:
            raise h.ContenderFailed(res["error"], res)
        return res["gbps"], res

    return h.interleaved_rounds(CONTENDERS, repeats, measure, describe=lambda v, run: f"{v:.3f} GB/s")


def derive(res: dict[str, Any]) -> dict[str, Any]:
    s = res["samples"]
    med = {c: h.median(s[c]) for c in CONTENDERS}
    paired = {"conveyor_vs_gloo_busbw": h.paired(s["conveyor_ps"], s["gloo_allreduce"]),
              "conveyor_vs_raw_tcp": h.paired(s["conveyor_ps"], s["raw_tcp"])}
    return {
        "median_gbps": med,
        "min_gbps": {c: h.lowest(s[c]) for c in CONTENDERS},
        "max_gbps": {c: h.highest(s[c]) for c in CONTENDERS},
        "conveyor_vs_gloo_busbw": h.ratio(med["conveyor_ps"], med["gloo_allreduce"]),
        "conveyor_vs_raw_tcp": h.ratio(med["conveyor_ps"], med["raw_tcp"]),
        "paired_per_round": paired,
        "roundtrip_ok": all(r.get("roundtrip_ok", False) for c in ("conveyor_ps", "raw_tcp") for r in res["runs"][c]
                            if "error" not in r),
    }


UNITS = {"conveyor_ps": "GB/s (2 x bytes / push+pull time)",
         "gloo_allreduce": "bus bandwidth GB/s (2(n-1)/n x bytes / t)",
         "raw_tcp": "GB/s (2 x bytes / send+echo time)"}


def format_table(res: dict[str, Any], d: dict[str, Any], settings: dict[str, Any], repeats: int) -> str:
    head = (f"{settings['bytes'] / MB:.0f} MB ({settings['tensors']} float32 tensors for conveyor_ps, 2 ps tasks), "
            f"{repeats} round(s) x {settings['iters']} timed iteration(s), loopback, 1 thread/process")
    rows = [("contender", "GB/s", "min", "max", "per round", "measure")]
    for c in CONTENDERS:
        rows.append((c, h.fmt(d["median_gbps"][c], ".3f"), h.fmt(d["min_gbps"][c], ".3f"),
                     h.fmt(d["max_gbps"][c], ".3f"), h.fmt_all(res["samples"][c], ".3f"), UNITS[c]))
    pr = d["paired_per_round"]
    return "\n".join([
        head, "", h.format_rows(rows, left=(0, 4, 5)), "",
        f"conveyor_ps / gloo busbw  {h.fmt(d['conveyor_vs_gloo_busbw'], '.3f')}  (ratio of medians; paired per "
        f"round: {h.fmt_all(pr['conveyor_vs_gloo_busbw'], '.3f')})",
        f"conveyor_ps / raw TCP     {h.fmt(d['conveyor_vs_raw_tcp'], '.3f')}  (ratio of medians; paired per round: "
        f"{h.fmt_all(pr['conveyor_vs_raw_tcp'], '.3f')})",
        f"data round-trips intact: {d['roundtrip_ok']}",
    ])


def goals(d: dict[str, Any]) -> list[dict[str, Any]]:
    return h.evaluate_goals(GOALS, d)


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    return write_results("ps", report, out_dir)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "16 MB, 1 round, 2 iterations")
    p.add_argument("--mb", type=float, default=None, help="model size in MB of 10^6 bytes (default 100; --quick 16)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per run (default 3; --quick 2)")
    p.add_argument("--tensors", type=int, default=25, help="tensors the conveyor model is split into (default 25)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per contender run (default 120)")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return h.settle(p, p.parse_args(argv), {"mb": (100.0, 16.0), "repeats": (5, 1), "iters": (3, 2)},
                    positive=("mb", "repeats", "iters", "tensors", "timeout"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        ROLES[config["role"]](config)
        return 0
    started = time.perf_counter()
    nbytes = int(args.mb * MB) // (4 * args.tensors) * 4 * args.tensors  # whole float32 tensors of equal size
    settings = {"bytes": nbytes, "tensors": args.tensors, "iters": args.iters}
    machine = h.machine_start(("torch", "pyzmq"))
    print(f"{nbytes / MB:.0f} MB, {args.repeats} round(s) x {args.iters} iteration(s), {machine['cores']} cores")
    res = run_rounds(settings, args.repeats, args.timeout)
    d = derive(res)
    gs = goals(d)
    report = {
        "benchmark": "ps", "command": h.command_line("ps", argv), "machine": h.machine_end(machine),
        "config": {**settings, "mb": args.mb, "repeats": args.repeats, "quick": args.quick, "timeout": args.timeout,
                   "ps_tasks": 2, "threads_per_process": 1, "order": res["order"],
                   "contenders": {c.name: c.label for c in CONTENDERS_SPEC}, "units": UNITS},
    }
    h.publish_run("ps", report, res, d, gs, format_table(res, d, settings, args.repeats), started,
                  h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
