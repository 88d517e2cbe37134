"""conveyor: train PyTorch models across processes, GPUs and machines.

    import conveyor
    job = conveyor.init()                          # who am I, in which cluster, with which strategy
    model, optimizer = job.prepare(model, optimizer)

The training names are resolved on first use (PEP 562), so `import conveyor.data` and
`import conveyor.cluster` stay free of PyTorch: the input pipeline's worker processes and the
launcher do not pay for importing it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "init": "conveyor.train.job",
    "Job": "conveyor.train.job",
    "Trainer": "conveyor.train.trainer",
    "TrainConfig": "conveyor.train.trainer",
    "ClusterSpec": "conveyor.cluster",
}

__all__ = ["ClusterSpec", "Job", "TrainConfig", "Trainer", "__version__", "init"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
