"""benchmarks/hosts.py's pure parts: caps, byte accounting, verdicts, tables, and the refusal without root.

Nothing here is timed and no host is made: the benchmark itself needs root and minutes (`make bench`).
"""

from __future__ import annotations

import argparse
import math

import pytest

BENCHMARK = "hosts"
MB = 1_000_000


def test_arguments_and_caps(bench):
    args = bench.parse_args([])
    assert (args.caps, args.size_mb, args.repeats, args.part) == ((1000.0, 10000.0, None), 100.0, 2, "all")
    quick = bench.parse_args(["--quick", "--caps", "200,none"])
    assert (quick.caps, quick.size_mb, quick.repeats, quick.epochs) == ((200.0, None), 16.0, 1, 1)
    for bad in ("fast", "-5", "1000,1000", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_caps(bad)
    assert [bench.cap_label(c) for c in (200.0, 1000.0, 10000.0, None)] == [
        "200 Mbit/s", "1 Gbit/s", "10 Gbit/s", "uncapped"]


def test_payload_is_cut_into_whole_float32_pieces_no_larger_than_the_ps_sharding_makes(bench):
    transport, _ = bench.settings_of(bench.parse_args([]))
    assert transport["tensors"] == 24  # 100 MB in pieces of at most 4 MiB
    assert transport["bytes"] % (4 * transport["tensors"]) == 0 and 100 * MB - 96 < transport["bytes"] <= 100 * MB
    assert transport["bytes"] // transport["tensors"] <= bench.CHUNK_BYTES


def test_byte_accounting(bench):
    b = 100 * MB
    # push + pull (and the raw TCP echo): B out, then B back, over the link's two directions in turn
    assert bench.counted_bytes("ps_push_pull", b) == bench.counted_bytes("raw_tcp", b) == 2 * b
    # ring all-reduce: each host sends 2(N-1)/N x B while receiving as much
    assert bench.counted_bytes("gloo_allreduce", b) == b
    assert bench.counted_bytes("gloo_allreduce", b, hosts=4) == 1.5 * b
    assert bench.ideal_seconds("ps_push_pull", b, 1000) == pytest.approx(1.6)
    assert bench.ideal_seconds("gloo_allreduce", b, 1000) == pytest.approx(0.8)
    assert bench.vs_cap(0.125, 1000) == pytest.approx(1.0)  # 1 Gbit/s = 0.125 GB/s
    assert math.isnan(bench.vs_cap(0.5, None)) and math.isnan(bench.vs_cap(None, 1000))
    with pytest.raises(ValueError):
        bench.counted_bytes("carrier_pigeon", b)


def test_link_time_per_step(bench):
    p = 605_224  # the digits Net's parameter bytes
    assert bench.link_bytes_per_step("allreduce", p) == p  # 2(N-1)/N x P on each worker's link, N = 2
    assert bench.link_bytes_per_step("ps-sync", p) == bench.link_bytes_per_step("ps-async", p) == 2 * p
    assert bench.link_bytes_per_step("allreduce", p, workers=4) == 1.5 * p
    assert bench.link_ms("ps-sync", p, 1000) == pytest.approx(9.68, abs=0.01)  # 1.21 MB at 1 Gbit/s
    assert bench.link_ms("allreduce", p, 10000) == pytest.approx(0.484, abs=0.001)
    assert math.isnan(bench.link_ms("allreduce", p, None)) and math.isnan(bench.link_ms("ps-sync", None, 1000))
    with pytest.raises(ValueError):
        bench.link_bytes_per_step("pipeline", p)


def test_where_a_strategy_stops_being_link_bound(bench):
    caps = (1000.0, 10000.0, None)
    assert bench.unbound_from({"1000": 0.5, "10000": 0.95}, caps, "none") == "10000"
    assert bench.unbound_from({"1000": 0.92, "10000": 0.97}, caps, "none") == "1000"
    assert bench.unbound_from({"1000": 0.95, "10000": 0.6}, caps, "none") is None  # a faster cap still loses
    assert bench.unbound_from({"1000": 0.95}, caps, "none") is None  # not measured is not "fine"
    assert bench.unbound_from({"1000": 0.5, "10000": 1.0}, (1000.0, 10000.0), "10000") is None  # ref not judged
    assert "stops being link-bound at 10 Gbit/s" in bench.verdict("10000", caps, "none")
    assert "not link-bound at any cap" in bench.verdict("1000", caps, "none")
    assert "link-bound at every cap" in bench.verdict(None, caps, "none")


def _transport_results(bench, caps):
    samples, runs = {}, {}
    for cap in caps:
        for t in bench.TRANSPORTS:
            name = bench.contender(t, cap)
            gbps = 0.12 if cap == 1000.0 else 1.0
            samples[name] = [gbps, gbps * 0.9]
            runs[name] = [{"roundtrip_ok": True}, {"sum_ok": True}]
    return {"samples": samples, "runs": runs, "order": list(samples), "errors": []}


def test_transport_table(bench):
    caps = (1000.0, 10000.0, None)
    d = bench.derive_transport(_transport_results(bench, caps), caps)
    ps = d["by_cap"]["1000"]["ps_push_pull"]
    assert ps["median_gbps"] == pytest.approx(0.114) and ps["vs_cap"] == pytest.approx(0.912)
    assert d["ps_push_pull_vs_cap_1000"] == pytest.approx(0.912) and ps["vs_raw_tcp"] == pytest.approx(1.0)
    assert math.isnan(d["by_cap"]["none"]["gloo_allreduce"]["vs_cap"]) and d["data_intact"] is True
    table = bench.format_transport(d, caps, {"bytes": 100 * MB, "tensors": 24, "iters": 2}, 2)
    assert "2B per iteration" in table and "B per iteration" in table
    rows = [line.split() for line in table.splitlines() if line.startswith(("1 Gbit/s", "uncapped"))]
    assert len(rows) == 6 and rows[1][:6] == ["1", "Gbit/s", "ps_push_pull", "0.114", "0.91", "0.912"]
    # 0.95 GB/s is 0.76 of 10 Gbit/s for raw TCP too: the table blames the machine, not conveyor
    assert "at 10 Gbit/s raw TCP itself gets 0.76 of the cap" in table and "at 1 Gbit/s raw TCP" not in table


def test_training_table(bench):
    caps = (1000.0, 10000.0, None)
    speed = {"allreduce": (400, 950, 1000), "ps-sync": (300, 600, 1000), "ps-async": (950, 990, 1000)}
    samples, runs = {}, {}
    for strategy, rates in speed.items():
        for cap, rate in zip(caps, rates, strict=True):
            samples[bench.contender(strategy, cap)] = [rate]
            runs[bench.contender(strategy, cap)] = [{"comm_share": 0.5, "step_ms": 40.0, "comm_ms": 20.0,
                                                      "samples_per_second": rate - 10}]
    d = bench.derive_training({"samples": samples, "runs": runs, "errors": []}, caps, bench.STRATEGIES, 605_224)
    assert d["link_bound_below"] == {"allreduce": "10000", "ps-sync": None, "ps-async": "1000"}
    assert d["by_strategy"]["ps-sync"]["10000"]["vs_reference"] == pytest.approx(0.6)
    table = bench.format_training(d, caps, {"epochs": 3, "batch_size": 32}, 1)
    assert "allreduce  link-bound up to 1 Gbit/s; stops being link-bound at 10 Gbit/s" in table
    row = next(line.split() for line in table.splitlines() if line.startswith("ps-sync") and "10 Gbit/s" in line)
    assert row[3:11] == ["600", "0.600", "590", "40.0", "20.0", "50", "0.97", "yes"]


def test_figures_taken_from_a_runs_summary(bench):
    summary = {"strategy": "ps-sync", "world_size": 2, "steps": 132, "samples": 8448, "samples_per_second": 1500.0,
               "wall_seconds": 5.6, "step_breakdown": {"total": 0.04, "communication": 0.01},
               "communication": {"push_seconds": 1.0, "bytes_out_per_server": [80_000_000], "staleness": {}}}
    run = bench.summary_figures(summary, batch_size=32)
    assert run["step_samples_per_second"] == pytest.approx(1600.0)  # 2 workers x 32 / 40 ms
    assert (run["step_ms"], run["comm_ms"], run["comm_share"]) == pytest.approx((40.0, 10.0, 0.25))
    assert run["communication"] == {"push_seconds": 1.0, "bytes_out_per_server": [80_000_000]}


def test_without_root_it_says_so_and_fails(bench, monkeypatch, capsys):
    import conveyor.testing.hosts

    monkeypatch.setattr(conveyor.testing.hosts, "unavailable", lambda: "network namespaces need root")
    assert bench.main(["--quick"]) == 2
    assert "need root" in capsys.readouterr().err


def test_a_busy_machine_is_called_out(bench):
    assert bench.busy_note([{"loadavg_1min": 3.0}, None, {"error": "x"}], cores=2) is None
    note = bench.busy_note([{"loadavg_1min": 3.0}, {"loadavg_1min": 14.5}, {"loadavg_1min": 5.0}], cores=2)
    assert note.startswith("WARNING") and "up to 14.5 on 2 cores (2 of 3 runs above 4)" in note
