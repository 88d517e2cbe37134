"""Cluster description and task identity: pure data and parsing, no processes, no sockets, no torch.

- :mod:`.spec`     - ``ClusterSpec`` / ``TaskId`` and TensorFlow's TF_CONFIG, parsed and emitted;
- :mod:`.flags`    - TensorFlow 1's ``--ps_hosts/--worker_hosts/--job_name/--task_index``;
- :mod:`.env`      - hosts → task placement → each task's environment variables (for the launcher);
- :mod:`.discover` - the reverse: this process's identity from its environment (for ``conveyor.init()``);
- :mod:`.strategy_name` - the one parser and default for strategy names (launcher, ``init()``, ps task);
- :mod:`.variables` - every ``CONVEYOR_*`` variable, named once, with its meaning and who sets and reads it.

The launcher writes with :mod:`.env` what the trainer reads back with :mod:`.discover`; both sides
live here so they cannot disagree about a variable's name or meaning.
"""

from conveyor.cluster.discover import (
    SOURCES,
    Discovered,
    discover,
    expand_hostlist,
    expand_tasks_per_node,
    slurm_port,
)
from conveyor.cluster.env import (
    TaskSlot,
    assign_hosts,
    local_cluster,
    task_environment,
)
from conveyor.cluster.flags import CLUSTER_FLAGS, parse_cluster_flags
from conveyor.cluster.spec import (
    JOBS,
    TRAINING_JOBS,
    ClusterConfigError,
    ClusterSpec,
    TaskId,
    join_address,
    parse_tf_config,
    split_address,
)
from conveyor.cluster.strategy_name import NAMES as STRATEGY_NAMES
from conveyor.cluster.strategy_name import StrategyName, default_strategy, parse_strategy
from conveyor.cluster.variables import (
    DATA_DIR_VAR,
    JOB_SECRET_VAR,
    OUTPUT_DIR_VAR,
    STRATEGY_VAR,
    TASK_INDEX_VAR,
    TASK_TYPE_VAR,
)

__all__ = [
    "CLUSTER_FLAGS",
    "DATA_DIR_VAR",
    "JOBS",
    "JOB_SECRET_VAR",
    "OUTPUT_DIR_VAR",
    "SOURCES",
    "STRATEGY_NAMES",
    "STRATEGY_VAR",
    "TASK_INDEX_VAR",
    "TASK_TYPE_VAR",
    "TRAINING_JOBS",
    "ClusterConfigError",
    "ClusterSpec",
    "Discovered",
    "TaskId",
    "StrategyName",
    "TaskSlot",
    "assign_hosts",
    "default_strategy",
    "discover",
    "expand_hostlist",
    "expand_tasks_per_node",
    "join_address",
    "local_cluster",
    "parse_cluster_flags",
    "parse_strategy",
    "parse_tf_config",
    "slurm_port",
    "split_address",
    "task_environment",
]
