"""conveyor.cluster.strategy_name: the one parser and default for strategy names, and its users."""

from __future__ import annotations

import pytest

import conveyor.launch as launch
import conveyor.strategies as strategies
from conveyor.cluster import STRATEGY_NAMES, StrategyName, default_strategy, parse_strategy
from conveyor.strategies import PSStrategy, get_strategy
from conveyor.strategies.ps.server import MODES, serve_task


@pytest.mark.parametrize("text, kind, mode, staleness, name", [
    ("local", "local", "", 0, "local"),
    ("allreduce", "allreduce", "", 0, "allreduce"),
    (" AllReduce ", "allreduce", "", 0, "allreduce"),
    ("pipeline", "pipeline", "", 0, "pipeline"),
    (" FSDP ", "fsdp", "", 0, "fsdp"),
    ("ps-sync", "ps", "sync", 0, "ps-sync"),
    ("PS-Async\n", "ps", "async", 0, "ps-async"),
    ("ps-ssp:0", "ps", "ssp", 0, "ps-ssp:0"),
    ("ps-ssp:3", "ps", "ssp", 3, "ps-ssp:3"),
    ("\tps-SSP:007 ", "ps", "ssp", 7, "ps-ssp:7"),
])
def test_every_valid_spelling(text, kind, mode, staleness, name) -> None:
    parsed = parse_strategy(text)
    assert parsed == StrategyName(kind, mode, staleness)
    assert parsed.name == name and parse_strategy(parsed.name) == parsed
    assert parsed.uses_ps == (kind == "ps")
    assert parsed.splits_model == (kind == "pipeline")
    assert parsed.distributed == (kind != "local")


@pytest.mark.parametrize("text, message", [
    ("sgd", "unknown strategy 'sgd'; expected one of local, allreduce, ps-sync, ps-async, ps-ssp:K, pipeline, fsdp"),
    ("", "unknown strategy ''"),
    ("ps", "unknown strategy 'ps'"),
    ("ps-", "unknown strategy 'ps-'"),
    ("ps-bogus", "unknown strategy 'ps-bogus'"),
    ("all reduce", "unknown strategy 'all reduce'"),
    ("ps-ssp", "strategy 'ps-ssp': ps-ssp needs its staleness bound K, a whole number >= 0, e.g. 'ps-ssp:4'"),
    ("ps-ssp:", "staleness bound K"),
    ("ps-ssp:x", "staleness bound K"),
    ("ps-ssp:-1", "staleness bound K"),
    ("ps-ssp:1.5", "staleness bound K"),
    ("ps-ssp:٣", "staleness bound K"),  # an Arabic-Indic digit: isdigit() but not a whole number here
    (None, "strategy = None; expected one of local, allreduce"),
    (3, "strategy = 3; expected one of"),
])
def test_every_invalid_spelling_names_the_value_and_the_choices(text, message) -> None:
    with pytest.raises(ValueError) as info:
        parse_strategy(text)
    assert message in str(info.value)


def test_the_message_names_where_the_value_came_from() -> None:
    with pytest.raises(ValueError, match="unknown --strategy 'ring'; expected one of local, allreduce"):
        parse_strategy("ring", what="--strategy")


@pytest.mark.parametrize("world, ps, expected", [(1, 0, "local"), (4, 0, "allreduce"), (2, 1, "ps-sync"),
                                                 (1, 3, "ps-sync")])
def test_the_one_default(world, ps, expected) -> None:
    assert default_strategy(world, ps) == expected
    assert launch.resolve_strategy(None, world, ps) == expected


def test_every_user_shares_the_names() -> None:
    assert STRATEGY_NAMES == strategies.NAMES == launch.STRATEGIES
    assert "allreduce" in STRATEGY_NAMES and "ps-ssp:K" in STRATEGY_NAMES and "pipeline" in STRATEGY_NAMES
    assert "fsdp" in STRATEGY_NAMES
    assert MODES == ("sync", "async", "ssp")


def test_the_launcher_canonicalises_what_it_accepts() -> None:
    assert launch.resolve_strategy(" PS-ASYNC ", 2, 1) == "ps-async"
    assert launch.resolve_strategy("ps-ssp:04", 2, 1) == "ps-ssp:4"


# Moved from tests/strategies/test_ps.py (test_strategy_names), where ps/server.parse_mode was tested.
def test_strategy_names() -> None:
    ssp, sync = parse_strategy("ps-ssp:3"), parse_strategy("ps-sync")
    assert (ssp.mode, ssp.staleness) == ("ssp", 3) and (sync.mode, sync.staleness) == ("sync", 0)
    assert isinstance(get_strategy("ps-async"), PSStrategy) and get_strategy("ps-ssp:2").name == "ps-ssp:2"
    with pytest.raises(ValueError, match="staleness bound K"):
        get_strategy("ps-ssp:x")


def test_a_ps_server_refuses_a_strategy_without_parameter_servers() -> None:
    with pytest.raises(ValueError, match="'allreduce' is not a parameter-server strategy"):
        serve_task("127.0.0.1:1", b"s", index=0, num_workers=1, strategy="allreduce")
    with pytest.raises(ValueError, match="unknown strategy 'sgd'"):
        serve_task("127.0.0.1:1", b"s", index=0, num_workers=1, strategy="sgd")


def test_fsdp_with_parameter_servers_is_refused() -> None:
    with pytest.raises(ValueError, match="--ps 1 starts parameter servers, which only the ps strategies use"):
        launch.resolve_strategy("fsdp", 2, 1)
