"""The scaling model's inputs: units, the cluster description, the measured step from summary.json."""

from __future__ import annotations

import json

import pytest

from conveyor.scaling import ScalingInputError, cluster_from_mapping, load_cluster, measured_from_summary
from conveyor.scaling.units import parse_bandwidth, parse_latency

CLUSTER = {"gpus_per_node": 4, "intra_node_bandwidth": "10 GB/s", "intra_node_latency": "5 us",
           "inter_node_bandwidth": "25 Gbit/s", "inter_node_latency": 1e-5}


def summary(**changes):
    base = {"strategy": "local", "world_size": 1,
            "step_breakdown": {"input_wait": 0.01, "forward_backward": 0.3, "communication": 0.0,
                               "optimizer": 0.02, "total": 0.35},
            "scaling": {"batch_size": 32.0, "parameter_bytes": 4000, "gradient_bytes": 4000,
                        "input_core_seconds_per_batch": 0.05}}
    for key, value in changes.items():
        base[key] = value
    return base


@pytest.mark.parametrize("text, expected", [
    ("25 Gbit/s", 25e9 / 8), ("25Gbps", 25e9 / 8), ("25 Gb/s", 25e9 / 8), ("12 GB/s", 12e9),
    ("100 MB/s", 100e6), ("1 GiB/s", 2**30), ("800 kbit/s", 1e5), (3.5e9, 3.5e9), ("2e3 B/s", 2e3)])
def test_bandwidths_with_units(text, expected):
    assert parse_bandwidth(text, "x") == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [("5 us", 5e-6), ("5µs", 5e-6), ("0.2 ms", 2e-4), ("1 s", 1.0),
                                            ("100 ns", 1e-7), (0, 0.0), (2e-6, 2e-6)])
def test_latencies_with_units(text, expected):
    assert parse_latency(text, "x") == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "25 Gbit", "25 Gbit/h", "-1 GB/s", "0 GB/s", True, None, [1]])
def test_bad_bandwidths_name_the_field(text):
    with pytest.raises(ScalingInputError, match="inter_node_bandwidth"):
        parse_bandwidth(text, "inter_node_bandwidth")


@pytest.mark.parametrize("text", ["soon", "5 minutes", "-1 us", "nan s"])
def test_bad_latencies_name_the_field(text):
    with pytest.raises(ScalingInputError, match="intra_node_latency"):
        parse_latency(text, "intra_node_latency")


def test_a_cluster_from_json_and_toml(tmp_path):
    c = cluster_from_mapping(CLUSTER)
    assert c.gpus_per_node == 4 and c.inter_node_bandwidth == pytest.approx(3.125e9)
    assert c.nodes(1) == 1 and c.nodes(4) == 1 and c.nodes(5) == 2
    assert c.link(4) == pytest.approx((10e9, 5e-6)) and c.link(8) == pytest.approx((3.125e9, 1e-5))
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    assert load_cluster(tmp_path / "c.json") == c
    (tmp_path / "c.toml").write_text('gpus_per_node = 4\nintra_node_bandwidth = "10 GB/s"\nintra_node_latency = '
                                     '"5 us"\ninter_node_bandwidth = "25 Gbit/s"\ninter_node_latency = 1e-5\n')
    assert load_cluster(tmp_path / "c.toml") == c
    assert load_cluster(tmp_path / "c.json", {"ps_count": 3, "gpus_per_node": None}).ps_count == 3


@pytest.mark.parametrize("content, needles", [
    ("{not json", ["c.json", "not valid JSON", "line 1"]),
    ("[1, 2]", ["c.json", "object of fields", "list"]),
    (json.dumps({**CLUSTER, "gpu_per_node": 8}), ["unknown field", "gpu_per_node", "gpus_per_node"]),
    (json.dumps({k: v for k, v in CLUSTER.items() if k != "inter_node_bandwidth"}),
     ["missing inter_node_bandwidth", "--inter-node-bandwidth"]),
    (json.dumps({**CLUSTER, "gpus_per_node": 0}), ["gpus_per_node", "positive whole number"]),
    (json.dumps({**CLUSTER, "compute_speed": "fast"}), ["compute_speed", "positive number"]),
    (json.dumps({**CLUSTER, "compute_shares_cores": "yes"}), ["compute_shares_cores", "true or false"]),
    (json.dumps({**CLUSTER, "intra_node_latency": "5 parsecs"}), ["c.json", "intra_node_latency", "5 us"]),
])
def test_a_malformed_cluster_file_is_named(tmp_path, content, needles):
    (tmp_path / "c.json").write_text(content)
    with pytest.raises(ScalingInputError) as err:
        load_cluster(tmp_path / "c.json")
    for needle in needles:
        assert needle in str(err.value)


def test_a_malformed_toml_file_is_named(tmp_path):
    pytest.importorskip("tomllib")
    (tmp_path / "c.toml").write_text("gpus_per_node = = 4\n")
    with pytest.raises(ScalingInputError, match="c.toml: not valid TOML"):
        load_cluster(tmp_path / "c.toml")


def test_the_measured_step_of_one_worker():
    m = measured_from_summary(summary())
    assert (m.batch_size, m.compute, m.optimizer, m.gradient_bytes, m.input_core_seconds) == (32, 0.3, 0.02, 4000, 0.05)
    assert m.overhead == pytest.approx(0.35 - 0.01 - 0.3 - 0.02)
    assert m.samples_per_second() == pytest.approx(32 / 0.35)
    m = measured_from_summary(summary(), overrides={"batch_size": 64, "gradient_bytes": 1e6})
    assert m.batch_size == 64 and m.gradient_bytes == 1e6


def test_an_allreduce_run_has_its_exposed_communication_taken_out():
    s = summary(strategy="allreduce", world_size=2,
                step_breakdown={"input_wait": 0.0, "forward_backward": 0.35, "communication": 0.1, "optimizer": 0.02,
                                "total": 0.37})
    assert measured_from_summary(s, overlap=0.5).compute == pytest.approx(0.3)  # 0.05 of the 0.1 s was exposed
    assert measured_from_summary(s, overlap=0.0).compute == pytest.approx(0.25)


@pytest.mark.parametrize("changes, needles", [
    ({"scaling": None}, ["missing 'scaling.batch_size'", "train again", "--batch-size"]),
    ({"scaling": {"batch_size": 32}}, ["missing 'scaling.gradient_bytes'", "--gradient-bytes"]),
    ({"scaling": {"batch_size": None, "parameter_bytes": 1, "gradient_bytes": 1}},
     ["'scaling.batch_size' was not measured", "--batch-size"]),
    ({"scaling": {"batch_size": -3, "parameter_bytes": 1, "gradient_bytes": 1}}, ["batch_size", "positive"]),
    ({"step_breakdown": {"forward_backward": 0.3}}, ["missing 'step_breakdown.input_wait'", "summary.json"]),
    ({"world_size": None}, ["world_size"]),
    ({"step_breakdown": {"input_wait": 0, "forward_backward": 0, "communication": 0, "optimizer": 0, "total": 0}},
     ["no timed step", "at least a few steps"]),
    ({"strategy": "ps-sync", "world_size": 2}, ["ps-sync run of 2 workers", "conveyor run -n 1"]),
])
def test_missing_or_wrong_fields_in_summary_json_are_named(changes, needles):
    with pytest.raises(ScalingInputError) as err:
        measured_from_summary(summary(**changes), source="run/summary.json")
    assert str(err.value).startswith("run/summary.json: ")
    for needle in needles:
        assert needle in str(err.value)


def test_the_input_cost_may_be_unknown():
    s = summary(scaling={"batch_size": 8, "parameter_bytes": 1, "gradient_bytes": 1,
                         "input_core_seconds_per_batch": None})
    assert measured_from_summary(s).input_core_seconds is None
