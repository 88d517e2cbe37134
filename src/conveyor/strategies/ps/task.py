"""A ps task's whole life: what ``conveyor.init()`` does when the process is a parameter server.

    status = serve_ps_task(found, strategy, timeout, checkpoints=CheckpointManager)   # 0: the workers are done
    sys.exit(status)                                                                   # conveyor.init() does this

The task checks that the job is a parameter-server job and has its secret, serves its share of the
parameters (:mod:`.server`) on its TF_CONFIG address until every worker has said "done" (status 0),
or stops when no worker was heard from for the job's timeout (status 1, the reason on stderr). It
writes its checkpoint shards only under the task's output folder (:func:`shard_stores`).

``checkpoints`` opens a checkpoint folder (the job's checkpoint manager class, passed in by
``conveyor.init()``: strategies sit below ``train`` and do not import it).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.cluster.strategy_name import StrategyName, default_strategy, parse_strategy
from conveyor.strategies.ps.server import IdleTimeout, ShardStore, serve_task

if TYPE_CHECKING:
    from conveyor.cluster import Discovered

__all__ = ["serve_ps_task", "shard_stores"]

OpenCheckpoints = Callable[..., ShardStore]  # called as checkpoints(folder, keep=None)


def shard_stores(output_dir: Path, checkpoints: OpenCheckpoints) -> Callable[[str], ShardStore]:
    """What a ps task opens the checkpoint folders named in its requests with: only under ``output_dir``."""
    output_dir = output_dir.resolve()

    def open_root(root: str) -> ShardStore:
        # The folder comes in a signed request; still, a ps task writes only under its own output folder.
        folder = Path(root).resolve()
        if not folder.is_relative_to(output_dir):
            raise ValueError(f"checkpoint folder {folder} is outside this task's output folder {output_dir}; give "
                             f"every task the same --output-dir")
        return checkpoints(folder, keep=None)

    return open_root


def serve_ps_task(found: Discovered, strategy: str | None, timeout: float, *, checkpoints: OpenCheckpoints) -> int:
    """Serve this ps task (``found``: what discovery said it is) until the job ends; return the exit status.

    ``ValueError`` before serving when the job is no parameter-server job or has no secret.
    """
    assert found.spec is not None  # a ps task always comes from a cluster spec
    name = strategy or found.strategy or default_strategy(found.world_size, found.spec.num_tasks("ps"))
    try:
        parsed: StrategyName | None = parse_strategy(name)
        why = ""
    except ValueError as e:
        parsed, why = None, f" ({e})"
    if parsed is None or not parsed.uses_ps:
        raise ValueError(f"this process is the parameter server {found.task}, but the strategy is {name!r}{why}: "
                         f"start the job with --strategy ps-sync, ps-async or ps-ssp:K (CONVEYOR_STRATEGY)")
    if not found.secret:
        raise ValueError(f"parameter server {found.task} needs the job secret (CONVEYOR_JOB_SECRET) that signs "
                         f"its messages; `conveyor run` sets it, and tasks started by hand each need the same "
                         f"one, e.g. CONVEYOR_JOB_SECRET=$(openssl rand -hex 32) exported once for all of them")
    address = found.spec.task_address("ps", found.task.index)
    # Messages name the server ("ps:0: ...") and the launcher prefixes the task: no third name in the format
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    print(f"{found.task}: serving {parsed.name} for {found.world_size} worker(s) on {address}", flush=True)
    try:
        serve_task(address, found.secret, index=found.task.index, num_workers=found.world_size, strategy=parsed.name,
                   shards=shard_stores(Path(found.output_dir or "output"), checkpoints), idle_timeout=timeout)
    except IdleTimeout as exc:
        print(f"{found.task}: {exc}", file=sys.stderr, flush=True)  # no traceback: the message says it all
        return 1
    print(f"{found.task}: every worker is done; exiting", flush=True)
    return 0
