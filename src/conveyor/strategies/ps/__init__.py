"""Parameter servers: the pure parts — where each parameter piece lives, and the optimizer the servers run.

``sharding`` decides which ps task holds which elements of which parameter (balanced by bytes, large
tensors split across all servers); ``optim`` describes the worker's optimizer so the servers can run
torch's own implementation over their pieces, with the same numerics as one process; ``reshard``
re-cuts saved shards for another number of servers. All are plain torch and JSON: no sockets here, so
every decision is tested exactly and the networked server and client stay thin.
"""

from __future__ import annotations

from conveyor.strategies.ps.optim import (
    SUPPORTED,
    GroupSpec,
    OptimizerSpec,
    ServerOptimizer,
    group_hyperparameters,
    mean_of_gradients,
)
from conveyor.strategies.ps.sharding import (
    DEFAULT_CHUNK_BYTES,
    ParamInfo,
    Piece,
    Placement,
    parse_piece_key,
    piece_key,
    place,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SUPPORTED",
    "GroupSpec",
    "OptimizerSpec",
    "ParamInfo",
    "Piece",
    "Placement",
    "ServerOptimizer",
    "group_hyperparameters",
    "mean_of_gradients",
    "parse_piece_key",
    "piece_key",
    "place",
]
