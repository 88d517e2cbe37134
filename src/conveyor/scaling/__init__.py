"""The scaling model: predict how a measured run scales on a cluster (`conveyor predict`).

    from conveyor.scaling import Options, load_cluster, load_measured, predict
    points = predict(load_measured("runs/x/summary.json"), load_cluster("cluster.json"), Options())

`measured` reads one worker's step from summary.json, `cluster` the target, `comm` holds the
arithmetic, `model` combines them per strategy and worker count, `report` prints, writes and plots.
Formulas, assumptions and what the model lacks: docs/scaling-model.md.
"""

from conveyor.scaling.cluster import Cluster, cluster_from_mapping, load_cluster
from conveyor.scaling.errors import ScalingInputError
from conveyor.scaling.measured import Measured, load_measured, measured_from_summary
from conveyor.scaling.model import DEFAULT_WORKERS, STRATEGIES, Options, Point, predict

__all__ = ["DEFAULT_WORKERS", "STRATEGIES", "Cluster", "Measured", "Options", "Point", "ScalingInputError",
           "cluster_from_mapping", "load_cluster", "load_measured", "measured_from_summary", "predict"]
