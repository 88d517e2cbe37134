"""The target cluster of a prediction: nodes of GPUs (or CPU workers), their links, the parameter servers.

    cluster = load_cluster("cluster.json")                     # or .toml
    cluster = cluster_from_mapping({"gpus_per_node": 8, "intra_node_bandwidth": "100 GB/s", ...})
    cluster = dataclasses.replace(cluster, compute_speed=2.0)  # command-line overrides

Fields (``FIELDS``): gpus_per_node (workers per node), cores_per_gpu (cores feeding each worker's
input pipeline), intra_node_bandwidth / intra_node_latency, inter_node_bandwidth / inter_node_latency
(one node's network link), ps_count, ps_bandwidth (each server's link; default: the link the workers
use), compute_speed (one worker's compute speed relative to the measured device), compute_shares_cores
(true for CPU training: the input pipeline takes its cores from the compute) and a free-text name.
Bandwidths and latencies take units (``conveyor.scaling.units``). A missing required field, an unknown
one or a wrong value raises ScalingInputError naming the file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor.scaling.errors import ScalingInputError
from conveyor.scaling.units import parse_bandwidth, parse_latency

__all__ = ["FIELDS", "REQUIRED", "Cluster", "cluster_from_mapping", "load_cluster", "read_mapping"]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster (module docstring); bandwidths in bytes/s, latencies in seconds."""

    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    gpus_per_node: int = 1
    cores_per_gpu: float = 1.0
    ps_count: int = 1
    ps_bandwidth: float | None = None
    compute_speed: float = 1.0
    compute_shares_cores: bool = False
    name: str = ""

    def nodes(self, workers: int) -> int:
        return -(-int(workers) // self.gpus_per_node)

    def link(self, workers: int) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link a collective over `workers` workers crosses."""
        if self.nodes(workers) <= 1:
            return self.intra_node_bandwidth, self.intra_node_latency
        return min(self.inter_node_bandwidth, self.intra_node_bandwidth), self.inter_node_latency


FIELDS: dict[str, str] = {
    "gpus_per_node": "workers (GPUs, or CPU training processes) per node",
    "cores_per_gpu": "CPU cores that feed one worker's input pipeline",
    "intra_node_bandwidth": "bus bandwidth between the workers of one node, e.g. \"10 GB/s\"",
    "intra_node_latency": "latency of one message inside a node, e.g. \"5 us\"",
    "inter_node_bandwidth": "one node's network bandwidth, e.g. \"25 Gbit/s\"",
    "inter_node_latency": "latency of one message between nodes, e.g. \"10 us\"",
    "ps_count": "parameter servers",
    "ps_bandwidth": "each parameter server's link (default: the workers' link)",
    "compute_speed": "one worker's compute speed relative to the device the summary was measured on",
    "compute_shares_cores": "true when the workers compute on the CPU cores that also run the input pipeline",
    "name": "a label for tables and plots",
}
REQUIRED = ("intra_node_bandwidth", "intra_node_latency", "inter_node_bandwidth", "inter_node_latency")


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScalingInputError(f"{field}: expected a positive whole number, got {value!r}")
    return value


def _positive_number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ScalingInputError(f"{field}: expected a positive number, got {value!r}")
    return float(value)


def _flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ScalingInputError(f"{field}: expected true or false, got {value!r}")
    return value


_PARSERS = {
    "gpus_per_node": _positive_int, "ps_count": _positive_int,
    "cores_per_gpu": _positive_number, "compute_speed": _positive_number,
    "intra_node_bandwidth": parse_bandwidth, "inter_node_bandwidth": parse_bandwidth, "ps_bandwidth": parse_bandwidth,
    "intra_node_latency": parse_latency, "inter_node_latency": parse_latency,
    "compute_shares_cores": _flag, "name": lambda v, f: str(v),
}


def cluster_from_mapping(values: Mapping[str, Any], source: str = "the cluster description") -> Cluster:
    """A Cluster from `values` (field → value, units allowed); errors name `source`."""
    if not isinstance(values, Mapping):
        raise ScalingInputError(f"{source}: expected an object of fields ({', '.join(FIELDS)}), "
                                f"got {type(values).__name__}")
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ScalingInputError(f"{source}: unknown field(s) {', '.join(unknown)}; the fields are "
                                f"{', '.join(FIELDS)}")
    missing = [f for f in REQUIRED if values.get(f) is None]
    if missing:
        raise ScalingInputError(f"{source}: missing {', '.join(missing)} ({'; '.join(FIELDS[f] for f in missing)}); "
                                f"add them to the file or give them as --{missing[0].replace('_', '-')} ...")
    parsed = {}
    for field, value in values.items():
        if value is not None:
            try:
                parsed[field] = _PARSERS[field](value, field)
            except ScalingInputError as e:
                raise ScalingInputError(f"{source}: {e}") from None
    return Cluster(**parsed)


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The fields of a .json or .toml file (FileNotFoundError when it is missing)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ScalingInputError(f"{path}: reading TOML needs Python 3.11 or newer; write the file as "
                                    f"JSON") from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ScalingInputError(f"{path}: not valid TOML ({e}); fix the file (fields: "
                                    f"{', '.join(FIELDS)})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ScalingInputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix the "
                                f"file, or name a .toml file") from None


def load_cluster(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Cluster:
    """The Cluster described by the file at `path`, with `overrides` (field → value, None: not given) on top."""
    values = read_mapping(path) if path is not None else {}
    if not isinstance(values, dict):
        raise ScalingInputError(f"{path}: expected an object of fields at the top level, got {type(values).__name__}")
    values = {**values}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return cluster_from_mapping(values, str(path) if path is not None else "the command line")
