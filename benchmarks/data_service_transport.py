"""The data service's transport cost: one worker → one trainer on 127.0.0.1, a trivial pipeline, big batches.

    .venv/bin/python benchmarks/data_service_transport.py [--batches 60] [--json out.json]

The worker's pipeline hands out one ready batch (16×3×224×224 float32 = 9.6 MB by default) again and again,
so every CPU second is the service's: the worker's pack, MAC and send, the trainer's receive, check and
unpack. The peer row sends the same bytes over a bare pyzmq PUSH/PULL pair (no MAC, no framing) in the
same run. Each row: MB/s, and CPU milliseconds per batch of the trainer (this process, every thread) and of
the sender process (from /proc). On a loaded machine read the CPU columns, not the rates.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
SHAPE = (int(os.environ.get("DSTRANSPORT_BATCH", "16")), 3, 224, 224)


def batches():
    """The workers' pipeline: the same batch forever (no pipeline cost to measure)."""
    import numpy as np

    from conveyor.data import Dataset

    batch = np.ones(SHAPE, dtype=np.float32)
    return Dataset.range(10**9).map(lambda i: batch)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path, secret_file: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "conveyor", "data", *args, "--secret-file", str(secret_file)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_for(log: Path, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log} never said {text!r}:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def _row(name: str, n: int, nbytes: int, wall: float, trainer_cpu: float, sender_cpu: float) -> dict[str, Any]:
    return {"row": name, "batches": n, "MB_s": round(n * nbytes / wall / 1e6, 1),
            "trainer_cpu_ms_per_batch": round(1000 * trainer_cpu / n, 2),
            "sender_cpu_ms_per_batch": round(1000 * sender_cpu / n, 2)}


def conveyor_row(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Dispatcher and worker as `conveyor data` processes; this process iterates `distribute(...)`."""
    import torch

    from conveyor.data.service import Service

    secret = os.urandom(32)
    secret_file = tmp / "job.secret"
    secret_file.write_text(secret.hex())
    secret_file.chmod(0o600)
    dispatcher = f"127.0.0.1:{_free_port()}"
    procs = [_start(["serve", "--host", "127.0.0.1", "--port", dispatcher.rsplit(":", 1)[1]], tmp / "d.log",
                    secret_file)]
    try:
        _wait_for(tmp / "d.log", "listening")
        procs.append(_start(["worker", "--dispatcher", dispatcher, "--host", "127.0.0.1", "--port",
                             str(_free_port()), "--pipeline", "data_service_transport:batches"], tmp / "w.log",
                            secret_file))
        _wait_for(tmp / "w.log", "serving on")
        options = {k: v for k, v in (("max_outstanding", args.credit), ("per_request", args.per_request)) if v}
        it = iter(batches().distribute(Service(dispatcher, secret), **options))
        for _ in range(args.warmup):
            next(it)
        w0, c0, s0 = time.perf_counter(), time.process_time(), _cpu_s(procs[1].pid)
        nbytes = 0
        for _ in range(args.batches):
            nbytes = torch.from_numpy(next(it)).nbytes
        wall, cpu, sender = time.perf_counter() - w0, time.process_time() - c0, _cpu_s(procs[1].pid) - s0
        it.close()
        return _row("conveyor service", args.batches, nbytes, wall, cpu, sender)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def _push(port: int, count: int) -> None:
    """The peer's sender (a child process): ``count`` batches of SHAPE's bytes, zero-copy."""
    import numpy as np
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.sndhwm = 4
    sock.connect(f"tcp://127.0.0.1:{port}")
    batch = np.ones(SHAPE, dtype=np.float32)
    view = memoryview(batch.reshape(-1).view(np.uint8))  # alive until the last frame has left
    trackers = [sock.send(view, copy=False, track=True) for _ in range(count)]
    for tracker in trackers:
        tracker.wait(timeout=60)
    sock.close(linger=30_000)


def zmq_row(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.rcvhwm = 4
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    total = args.warmup + args.batches
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import data_service_transport as t; "
            f"t._push({port}, {total})")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(args.warmup):
            sock.recv(copy=False)
        w0, c0, s0 = time.perf_counter(), time.process_time(), _cpu_s(proc.pid)
        nbytes = 0
        for _ in range(args.batches):
            frame = sock.recv(copy=False)
            nbytes = torch.from_numpy(np.frombuffer(frame.buffer, dtype=np.float32).reshape(SHAPE)).nbytes
        wall, cpu, sender = time.perf_counter() - w0, time.process_time() - c0, _cpu_s(proc.pid) - s0
        return _row("bare pyzmq PUSH/PULL", args.batches, nbytes, wall, cpu, sender)
    finally:
        proc.wait(timeout=60)
        sock.close(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--credit", type=int, default=0, help="distribute's max_outstanding (0: its default)")
    parser.add_argument("--per-request", type=int, default=0, help="distribute's per_request (0: its default)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [conveyor_row(args, Path(tmp)), zmq_row(args)]
    print(f"one worker -> one trainer on 127.0.0.1, batches of {'x'.join(map(str, SHAPE))} float32, "
          f"{args.batches} batches per row")
    print(f"{'row':<24}{'MB/s':>9}{'trainer CPU ms/batch':>23}{'sender CPU ms/batch':>22}")
    for r in rows:
        print(f"{r['row']:<24}{r['MB_s']:>9}{r['trainer_cpu_ms_per_batch']:>23}{r['sender_cpu_ms_per_batch']:>22}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": SHAPE, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
