"""What to start where, and keeping it running: the machinery behind `conveyor run`.

- :mod:`.plan`       - arguments + free ports (+ the rendezvous) → a pure ``LaunchPlan`` of ``TaskLaunch``
  (command, whole environment, log file) per task; ``describe_plan`` is ``--dry-run``'s output;
- :mod:`.ports`      - free TCP ports, by binding port 0;
- :mod:`.binding`    - ``--bind``: each task's CPUs from the machine's topology, decided purely;
- :mod:`.supervisor` - starts the plan's tasks in their own process groups, prefixes and logs their
  output, restarts the whole job when a task dies, stops every task on Ctrl-C/SIGTERM; one task's
  process is :mod:`.tasks`, its states :mod:`.states`, when to restart :mod:`.restarts` (what failed:
  :mod:`.failures`);
- :mod:`.rendezvous` - several machines: the launchers meet at node 0's ``torch.distributed.TCPStore``
  and agree on one cluster (torch is imported there only, when a job spans machines);
- :mod:`.elastic`    - ``--nnodes MIN:MAX``: membership rounds, decided by node 0's coordinator thread.

This layer imports :mod:`conveyor.cluster` and never ``comm`` or ``train``: it starts the training
script, it does not run it.
"""

from conveyor.launch.plan import (
    OMP_DEFAULT_VAR,
    OWNED_VARS,
    RESTART_COUNT_VAR,
    RESUME_VAR,
    STRATEGIES,
    TIMEOUT_VAR,
    LaunchPlan,
    NodeInfo,
    RunOptions,
    TaskLaunch,
    build_plan,
    cluster_from_nodes,
    describe_plan,
    local_plan,
    max_tasks_per_node,
    resolve_strategy,
)
from conveyor.launch.ports import free_ports
from conveyor.launch.rendezvous import Rendezvous, RendezvousError, StorePeers, join, local_address
from conveyor.launch.supervisor import JobResult, PeerError, Peers, Supervisor, TaskExit

__all__ = [
    "OMP_DEFAULT_VAR",
    "OWNED_VARS",
    "RESTART_COUNT_VAR",
    "RESUME_VAR",
    "STRATEGIES",
    "TIMEOUT_VAR",
    "JobResult",
    "LaunchPlan",
    "NodeInfo",
    "PeerError",
    "Peers",
    "Rendezvous",
    "RendezvousError",
    "RunOptions",
    "StorePeers",
    "Supervisor",
    "TaskExit",
    "TaskLaunch",
    "build_plan",
    "cluster_from_nodes",
    "describe_plan",
    "free_ports",
    "join",
    "local_address",
    "local_plan",
    "max_tasks_per_node",
    "resolve_strategy",
]
