"""The data service's figures: per worker throughput and queues, the trainers' input wait, and the advice.

    block = service_report(workers, trainers, lost)     # the dispatcher's `stats` "report", summary.json's
    block["input_bound"], block["more_workers"]        # data_service block (docs/data-service.md)
    block = dispatcher_report()                         # the chief trainer asks the job's dispatcher at its end

Inputs are what the roles send the dispatcher: each worker's heartbeat carries, per job, the elements it
produced and the bytes it sent, the seconds its task ran and the seconds it was blocked (a full queue: the
trainer did not take fast enough; or no split left to take), and its queue depth; each trainer's iterator
reports, with its look for workers (every second) and at its end, the elements and bytes it consumed, the
seconds it was blocked waiting for the next element (input wait) and the seconds since its first request.
A trainer is input-bound when its input wait is over ``INPUT_BOUND_SHARE`` of its time. A worker's capacity
is what it produced per second it was not blocked; the trainers could consume elements / (elapsed - input wait) per
second (the mean over the epochs of one job name, summed over job names); ``workers_needed`` = ceil(that
rate / the mean capacity of a worker).
"""

from __future__ import annotations

import math
import os
from typing import Any

from conveyor.cluster.variables import DATA_SERVICE_VAR
from conveyor.comm.transport import Client, TransportError
from conveyor.data.service.protocol import DISPATCHER, DataServiceError, from_env

#: Input wait above this share of a trainer's time: the trainer is input-bound (more data workers would help)
INPUT_BOUND_SHARE = 0.1
#: Seconds the chief trainer waits for the dispatcher's figures at its end (summary.json)
REPORT_TIMEOUT_S = 5.0


def _rate(amount: float, seconds: float) -> float:
    return round(amount / seconds, 2) if seconds > 1e-3 else 0.0


def worker_figures(worker_id: int, address: str, alive: bool, tasks: dict[str, Any]) -> dict[str, Any]:
    """One worker's line: its jobs' figures summed (a worker serves a job at a time, mostly)."""
    total = {k: sum(float(t.get(k, 0)) for t in tasks.values()) for k in ("produced", "bytes", "run_s", "blocked_s")}
    active = total["run_s"] - total["blocked_s"]
    return {"id": worker_id, "address": address, "alive": alive, "elements": int(total["produced"]),
            "bytes": int(total["bytes"]), "elements_per_s": _rate(total["produced"], total["run_s"]),
            "bytes_per_s": _rate(total["bytes"], total["run_s"]),
            "capacity_elements_per_s": _rate(total["produced"], active),
            "blocked_share": round(total["blocked_s"] / total["run_s"], 3) if total["run_s"] > 1e-3 else 0.0,
            "queued": sum(int(t.get("queued", 0)) for t in tasks.values()),
            "buffer": max((int(t.get("buffer", 0)) for t in tasks.values()), default=0)}


def trainer_figures(job: str, report: dict[str, Any]) -> dict[str, Any]:
    elapsed, wait = float(report.get("elapsed_s", 0.0)), float(report.get("wait_s", 0.0))
    consumed = int(report.get("consumed", 0))
    return {"job": job, "elements": consumed, "bytes": int(report.get("bytes", 0)),
            "elapsed_s": round(elapsed, 3), "input_wait_s": round(wait, 3),
            "input_wait_share": round(wait / elapsed, 3) if elapsed > 1e-3 else 0.0,
            "elements_per_s": _rate(consumed, elapsed), "could_consume_per_s": _rate(consumed, elapsed - wait)}


def service_report(workers: list[dict[str, Any]], trainers: list[dict[str, Any]],
                   lost: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``data_service`` block from :func:`worker_figures` and :func:`trainer_figures` lines."""
    bound = [t for t in trainers if t["input_wait_share"] > INPUT_BOUND_SHARE]
    producing = [w["capacity_elements_per_s"] for w in workers if w["capacity_elements_per_s"] > 0]
    per_worker = sum(producing) / len(producing) if producing else 0.0
    # one trainer's epochs are iterators of their own under one job name: its demand is their mean, not their sum
    by_job: dict[str, list[float]] = {}
    for t in trainers:
        by_job.setdefault(t["job"], []).append(t["could_consume_per_s"])
    demand = sum(sum(rates) / len(rates) for rates in by_job.values())
    live = sum(1 for w in workers if w["alive"])
    needed = math.ceil(demand / per_worker) if bound and per_worker > 0 else live
    more = max(0, needed - live)
    if not trainers:
        advice = "no trainer reported yet"
    elif bound:
        advice = (f"input-bound: the trainers waited {max(t['input_wait_share'] for t in bound):.0%} of their time "
                  f"for input (over {INPUT_BOUND_SHARE:.0%}); at {per_worker:.1f} elements/s per data worker and "
                  f"{demand:.1f} elements/s the trainers could take, {needed} data workers are needed: "
                  f"{more} more than the {live} running")
    else:
        advice = f"not input-bound: input wait at most {INPUT_BOUND_SHARE:.0%} of the trainers' time"
    return {"workers": workers, "trainers": trainers, "lost_workers": lost, "input_bound": bool(bound),
            "input_bound_share": INPUT_BOUND_SHARE, "per_worker_elements_per_s": round(per_worker, 2),
            "trainer_could_consume_per_s": round(demand, 2), "workers_needed": needed, "more_workers": more,
            "advice": advice}


def dispatcher_report(environ: Any = None, timeout: float = REPORT_TIMEOUT_S) -> dict[str, Any] | None:
    """summary.json's ``data_service`` block as the chief trainer writes it: the job's dispatcher's report
    (``stats``) when ``CONVEYOR_DATA_SERVICE`` is set (every launcher sets it for a job with data workers), None
    without; ``{"unavailable": why}`` when it does not answer within ``timeout`` s. Under ``conveyor k8s`` no
    launcher merges the figures later, so this block is the one; ``conveyor run``'s launcher replaces it at the
    end with the dispatcher's last figures and the data workers' exits (``data_service_summary``)."""
    env = os.environ if environ is None else environ
    if not env.get(DATA_SERVICE_VAR):
        return None
    try:
        service = from_env(env)
        with Client(service.address, service.secret, name=DISPATCHER, timeout=timeout,
                    sender="data-summary") as client:
            return client.request("stats").header["report"]
    except (DataServiceError, TransportError) as e:
        return {"unavailable": f"the data service's figures: {e}"}
