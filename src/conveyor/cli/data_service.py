"""`conveyor data serve` and `conveyor data worker`: the data service's two roles (docs/data-service.md).

    conveyor data serve --port 5050 --secret-file job.secret
    conveyor data worker --dispatcher 10.0.0.5:5050 --port 6000 --pipeline myjob.input:train --secret-file job.secret
    conveyor data status --dispatcher 10.0.0.5:5050 --secret-file job.secret      # workers and jobs, as JSON

Only argument parsing; the roles are `conveyor.data.service.dispatcher` and `.worker`. Both run until
interrupted (Ctrl-C, SIGTERM). The secret: --secret-file, $CONVEYOR_JOB_SECRET_FILE or $CONVEYOR_JOB_SECRET
(how `conveyor run --data-workers K` starts them as tasks of the job).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading

from conveyor.cli import CommandError
from conveyor.cluster.variables import JOB_SECRET_FILE_VAR, JOB_SECRET_VAR
from conveyor.comm.transport import Client, TransportError
from conveyor.data.service.dispatcher import Dispatcher
from conveyor.data.service.protocol import DISPATCHER, DataServiceError, read_secret_file, read_secret_text
from conveyor.data.service.worker import DataWorker


def add_parsers(actions: argparse._SubParsersAction) -> None:
    p = actions.add_parser("serve", help="run the data service's dispatcher",
                           description="Register data workers (refusing a different pipeline), create jobs for "
                           "trainers and hand out file splits; runs until interrupted.")
    _listen_arguments(p)
    p.add_argument("--worker-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a worker silent this long is dead: its unacknowledged splits go to others (default 10)")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="write the service's figures there as JSON every 2 s and at exit: per worker throughput and "
                   "queues, the trainers' input wait, whether they are input-bound and how many workers are needed")
    _secret_argument(p)
    p.set_defaults(action_run=run_serve)
    p = actions.add_parser("worker", help="run a data worker: the named pipeline, served to trainers",
                           description="Build the pipeline MODULE:FUNCTION returns, register it with the "
                           "dispatcher and serve its elements to trainers; runs until interrupted.")
    p.add_argument("--dispatcher", required=True, metavar="HOST:PORT")
    p.add_argument("--pipeline", required=True, metavar="MODULE:FUNCTION",
                   help="a function without arguments returning a conveyor.data.Dataset (imported, not shipped)")
    _listen_arguments(p)
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="the address trainers connect to (default HOST:PORT, with this machine's host name "
                   "for an address that listens on all)")
    p.add_argument("--buffer", type=int, default=16, help="elements produced ahead per job (default 16)")
    _secret_argument(p)
    p.set_defaults(action_run=run_worker)
    p = actions.add_parser("status", help="show the data service's workers and jobs (JSON)",
                           description="Ask the dispatcher for its workers (address, pipeline, seconds since last "
                           "heard) and jobs (splits done, in progress, waiting); print them as JSON.")
    p.add_argument("--dispatcher", required=True, metavar="HOST:PORT")
    _secret_argument(p)
    p.set_defaults(action_run=run_status)


def _listen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    p.add_argument("--port", type=int, required=True)


def _secret_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help=f"the job secret in hex, mode 600 (default ${JOB_SECRET_FILE_VAR})")


def _secret(args: argparse.Namespace) -> bytes:
    """--secret-file, else $CONVEYOR_JOB_SECRET_FILE, else $CONVEYOR_JOB_SECRET (what `conveyor run` gives tasks)."""
    path = args.secret_file or os.environ.get(JOB_SECRET_FILE_VAR)
    if not path and os.environ.get(JOB_SECRET_VAR):
        try:
            return read_secret_text(os.environ[JOB_SECRET_VAR], JOB_SECRET_VAR)
        except DataServiceError as e:
            raise CommandError(str(e)) from None
    if not path:
        raise CommandError(f"give --secret-file FILE (or set {JOB_SECRET_FILE_VAR}): every role of the data "
                           f"service signs its messages with the same job secret")
    try:
        return read_secret_file(path, "--secret-file" if args.secret_file else JOB_SECRET_FILE_VAR)
    except DataServiceError as e:
        raise CommandError(str(e)) from None


def _log_as(role: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")


def _run_until_stopped(role: Dispatcher | DataWorker, started: str) -> int:
    """Say the role started (the line tests and scripts wait for), then run until SIGTERM or Ctrl-C."""
    print(f"[conveyor] {started}", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        role.close()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    _log_as("data-dispatcher")
    dispatcher = Dispatcher(f"{args.host}:{args.port}", _secret(args), worker_timeout=args.worker_timeout,
                            report_path=args.report).start()
    return _run_until_stopped(dispatcher, f"data service dispatcher listening on {args.host}:{args.port}")


def run_worker(args: argparse.Namespace) -> int:
    _log_as("data-worker")
    sys.path.insert(0, os.getcwd())  # --pipeline names a module of the job, run from its folder
    bind = f"{args.host}:{args.port}"
    advertise = args.advertise or (f"{socket.gethostname()}:{args.port}" if args.host in ("0.0.0.0", "::", "*")
                                   else bind)
    try:
        worker = DataWorker(args.dispatcher, args.pipeline, _secret(args), bind=bind,
                            advertise=advertise, buffer=args.buffer).start()
    except DataServiceError as e:
        raise CommandError(str(e)) from None
    return _run_until_stopped(worker, f"data worker {args.pipeline} serving on {worker.address}, registered with "
                                      f"{args.dispatcher}")


def run_status(args: argparse.Namespace) -> int:
    with Client(args.dispatcher, _secret(args), name=DISPATCHER, timeout=10.0, sender="data-status") as client:
        try:
            print(json.dumps(client.request("stats").header, indent=2))
        except TransportError as e:
            raise CommandError(f"{e} (is `conveyor data serve` running there, with the same secret file?)") from None
    return 0
