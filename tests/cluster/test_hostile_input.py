"""Hostile and absurd input to every cluster parser: each answers with ClusterConfigError naming the field.

Never a bare RecursionError (deep JSON), ValueError (Python's 4300-digit int limit), MemoryError (a
repeat count of a billion) or a megabyte-long message; and duplicate addresses are caught in any spelling.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cluster import (
    ClusterConfigError,
    ClusterSpec,
    TaskId,
    discover,
    expand_hostlist,
    expand_tasks_per_node,
    parse_cluster_flags,
    parse_tf_config,
    slurm_port,
    split_address,
)
from conveyor.cluster.spec import _json_depth

HUGE = "1" * 5000  # over Python 3.11's int-string limit (4300 digits): int(HUGE) raises a plain ValueError
WORKER = {"worker": ["w0:2222", "w1:2222"]}


def tf_config(index: object = 0, cluster: object = None, **extra: object) -> str:
    return json.dumps({"cluster": cluster or WORKER, "task": {"type": "worker", "index": index}, **extra})


def raises(pattern: str):
    return pytest.raises(ClusterConfigError, match=pattern)


# -- TF_CONFIG: depth and size ------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_tf_config_is_refused_before_decoding(depth):
    nested = "[" * depth + "]" * depth
    text = tf_config()[:-1] + f', "environment": {nested}}}'
    with raises(r"^TF_CONFIG nests \d+ levels deep; at most 32"):
        parse_tf_config(text)
    with raises(r"^TF_CONFIG nests"):
        ClusterSpec.from_tf_config(text)
    with raises(r"^TF_CONFIG nests"):
        discover({"TF_CONFIG": text})


def test_deeply_nested_invalid_json_is_refused_too():
    with raises(r"^TF_CONFIG nests"):
        parse_tf_config("{" * 100_000)
    with raises(r"^TF_CONFIG nests"):
        discover({"TF_CONFIG": '{"a":' * 100_000})


def test_brackets_inside_strings_do_not_count_as_depth():
    text = tf_config(environment="[" * 1000 + '\\"{' * 1000, job={"a": [[["\\\\"]]]})
    assert parse_tf_config(text) == (ClusterSpec(**WORKER), TaskId("worker", 0))


def test_oversized_tf_config_is_refused():
    with raises(r"^TF_CONFIG is \d+ characters long; at most 1048576"):
        parse_tf_config(tf_config(environment="x" * (1 << 20)))


# -- integers: Python's int-string limit and range -----------------------------------------------------


@pytest.mark.parametrize("index", [HUGE, int(HUGE[:4000]), "1" * 4000], ids=["5000-digit string", "4000-digit number",
                                                                         "4000-digit string"])
def test_huge_task_index_is_named(index):
    text = tf_config(index=index) if not isinstance(index, int) else tf_config().replace('"index": 0',
                                                                                           f'"index": {index}')
    with raises(r"^TF_CONFIG\.task\.index = .*expected an integer"):
        parse_tf_config(text)


def test_leading_zeros_do_not_count_towards_the_int_limit():
    # fuzz finding (tf_config): 8128 zeros passed the digit check, then int() of the whole string raised
    zeros = "0" * 5000
    assert parse_tf_config(tf_config(index=zeros + "1"))[1] == TaskId("worker", 1)
    assert split_address("h:" + zeros + "1") == ("h", 1)
    assert parse_cluster_flags(["--worker_hosts=w:1", "--job_name=worker", f"--task_index={zeros}"])[1] == \
        TaskId("worker", 0)
    assert discover({**TORCHRUN, "RANK": zeros + "1"}).rank == 1
    assert slurm_port(zeros + "7") == 20007
    assert expand_tasks_per_node(f"{zeros}2(x{zeros}2)") == [2, 2]


def test_huge_json_number_is_named_where_it_is():
    text = tf_config().replace('"index": 0', f'"index": {HUGE}')
    with raises(r"^TF_CONFIG\.task\.index = <a 5000-digit number>; expected an integer >= 0"):
        parse_tf_config(text)
    with raises(r"^TF_CONFIG\.cluster\.worker\[1\] must be a string"):
        parse_tf_config(tf_config().replace('"w1:2222"', HUGE))


def test_huge_port_is_out_of_range():
    with raises(r"^TF_CONFIG\.cluster\.worker\[0\] = 'w0:1111111.*': the port is out of range 1-65535"):
        parse_tf_config(tf_config(cluster={"worker": ["w0:" + HUGE]}))
    with raises(r"port is out of range"):
        split_address("h:" + HUGE)
    assert split_address("h:0002222") == ("h", 2222)  # leading zeros were accepted before, and still are


def test_huge_task_index_flag():
    with raises(r"^--task_index='1111.*' is not a whole number >= 0 \(at most 2147483647\)"):
        parse_cluster_flags(["--worker_hosts=w:1", "--job_name=worker", f"--task_index={HUGE}"])


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
         "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({**TORCHRUN, "RANK": HUGE}, "RANK"),
        ({**TORCHRUN, "WORLD_SIZE": HUGE}, "WORLD_SIZE"),
        ({**TORCHRUN, "LOCAL_RANK": HUGE}, "LOCAL_RANK"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": HUGE}, "LOCAL_WORLD_SIZE"),
        ({**TORCHRUN, "MASTER_PORT": HUGE}, "MASTER_PORT"),
        ({**SLURM, "SLURM_PROCID": HUGE}, "SLURM_PROCID"),
        ({**SLURM, "SLURM_NODEID": HUGE}, "SLURM_NODEID"),
        ({**SLURM, "SLURM_JOB_ID": HUGE}, "SLURM_JOB_ID"),
        ({**{k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}, "SLURM_NTASKS_PER_NODE": HUGE},
         "SLURM_NTASKS_PER_NODE"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": HUGE}, "SLURM_TASKS_PER_NODE"),
        ({**SLURM, "SLURM_TASKS_PER_NODE": f"1(x{HUGE})"}, "SLURM_TASKS_PER_NODE"),
        ({**SLURM, "SLURM_JOB_NODELIST": f"n[{HUGE}]"}, "SLURM_JOB_NODELIST"),
        ({"TF_CONFIG": tf_config(), "CONVEYOR_TASK_TYPE": "worker", "CONVEYOR_TASK_INDEX": HUGE},
         "CONVEYOR_TASK_INDEX"),
    ],
)
def test_huge_numbers_in_the_environment_are_named(env, name):
    with raises(rf"^{name}"):
        discover(env)


def test_tasks_per_node_repeat_is_bounded_before_expanding():
    started = time.monotonic()
    with raises(r"^SLURM_TASKS_PER_NODE = '1\(x100000000000\)' lists more than 100000 nodes"):
        expand_tasks_per_node("1(x100000000000)")
    assert time.monotonic() - started < 1  # refused, not a list of 10**11 counts built and then checked


def test_hostlist_growth_is_bounded_before_expanding():
    many = "n[" + ",".join(["0-99999"] * 2000) + "]"
    with raises(r"more than 100000 hosts"):
        expand_hostlist(many, name="SLURM_JOB_NODELIST")
    with raises(r"^SLURM_JOB_NODELIST = .*a host name would be longer than 253 characters"):
        expand_hostlist("x" * 100_000 + "[0-9999]", name="SLURM_JOB_NODELIST")
    with raises(r"^SLURM_JOB_NODELIST = .*a host name would be longer than 253 characters"):
        expand_hostlist("n[" + "0" * 100_000 + "-9999]", name="SLURM_JOB_NODELIST")


def test_slurm_port_of_huge_job_id():
    with raises(r"^SLURM_JOB_ID = '1111.*' is larger than any Slurm job id \(4294967295\); set MASTER_PORT"):
        slurm_port(HUGE)


# -- duplicates in any spelling --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("localhost:2222", "127.0.0.1:2222"),
        ("127.0.0.1:2222", "LocalHost.:2222"),
        ("localhost:2222", "localhost.:2222"),
        ("a.localhost:2222", "127.0.0.1:2222"),  # RFC 6761: every name under .localhost is loopback
        ("127.0.0.1:2222", "127.0.0.01:2222"),  # the C resolver reads 127.0.0.01 as 127.0.0.1
        ("127.1:2222", "127.0.0.1:2222"),
        ("[::ffff:127.0.0.1]:2222", "localhost:2222"),
        ("[::1]:2222", "[0:0:0:0:0:0:0:1]:2222"),
        ("[FE80::1%eth0]:2222", "[fe80::1%eth0]:2222"),
        ("Node1.:2222", "node1:2222"),
        ("10.0.0.5:2222", "10.0.0.5:02222"),
    ],
)
def test_duplicates_in_any_spelling_name_both_entries(first, second):
    pattern = (r"^TF_CONFIG\.cluster\.worker\[1\] = " + re.escape(repr(second)) + r" is also "
               r"TF_CONFIG\.cluster\.worker\[0\] = " + re.escape(repr(first)))
    with raises(pattern):
        parse_tf_config(tf_config(cluster={"worker": [first, second]}))
    with raises(r"^--worker_hosts\[1\] = .* is also --worker_hosts\[0\] = "):
        ClusterSpec.from_hosts(worker_hosts=f"{first},{second}", origin="--")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("127.0.0.1:2222", "127.0.0.2:2222"),  # different loopback addresses: two servers can bind both
        ("localhost:2222", "localhost:2223"),
        ("[::1]:2222", "127.0.0.1:2222"),  # different sockets; conveyor resolves localhost to IPv4 first
        ("[fe80::1%eth0]:2222", "[fe80::1%eth1]:2222"),
        ("node1:2222", "node1.example:2222"),
    ],
)
def test_different_sockets_are_not_duplicates(first, second):
    assert ClusterSpec(worker=(first, second)).worker == (first, second)


# -- hosts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("h\x00st:2222", "character that is not allowed"),
        ("h\x1b[2Jx:2222", "character that is not allowed"),
        ("h\udc80:2222", "character that is not allowed"),
        ("hôst:2222", "character that is not allowed"),
        ("[:::::]:2222", "not an IPv6 address"),
        ("[1::2::3]:2222", "not an IPv6 address"),
        ("x" * 300 + ":2222", "longer than 253 characters"),
    ],
)
def test_hosts_that_no_resolver_takes(address, why):
    with raises(r"^TF_CONFIG\.cluster\.worker\[0\] = ") as info:
        parse_tf_config(tf_config(cluster={"worker": [address]}))
    assert why in str(info.value)
    assert str(info.value).isprintable()


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({**TORCHRUN, "MASTER_ADDR": "a b"}, r"^MASTER_ADDR = 'a b' is not a host"),
        ({**TORCHRUN, "MASTER_ADDR": "h:29500"}, r"^MASTER_ADDR = 'h:29500' is not a host.*MASTER_PORT"),
        ({**SLURM, "MASTER_ADDR": "  "}, r"^MASTER_ADDR = '  ' is not a host"),
        ({**SLURM, "SLURM_JOB_NODELIST": "n:1"}, r"^SLURM_JOB_NODELIST = 'n:1': the host 'n:1' has a character"),
        ({"TF_CONFIG": tf_config(), "MASTER_ADDR": "a/b"}, r"^MASTER_ADDR = 'a/b' is not a host"),
    ],
)
def test_master_addr_is_a_host(env, pattern):
    with raises(pattern):
        discover(env)


def test_master_addr_may_be_an_ipv6_literal_bracketed_or_not():
    assert discover({**TORCHRUN, "MASTER_ADDR": "::1"}).master_addr == "::1"
    assert discover({**TORCHRUN, "MASTER_ADDR": " [fe80::1%eth0] "}).master_addr == "fe80::1%eth0"


# -- messages stay readable --------------------------------------------------------------------------


def test_messages_do_not_echo_megabytes_or_control_characters():
    long_bad = "x" * 500_000 + " :1"
    for call in (lambda: split_address(long_bad), lambda: ClusterSpec.from_hosts(worker_hosts=long_bad),
                 lambda: parse_tf_config(tf_config(cluster={"worker": long_bad})),
                 lambda: discover({**TORCHRUN, "RANK": "x" * 500_000})):
        with raises(r".") as info:
            call()
        assert len(str(info.value)) < 2000
    with raises(r"not valid JSON") as info:
        parse_tf_config('{"cluster": \x1b[2J\x00\udc80}')
    assert all(line.isprintable() for line in str(info.value).splitlines())


# -- the depth scan is sound ------------------------------------------------------------------------


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ ax\n'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\a'), inner, max_size=3),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_depth_scan_measures_what_json_nests(value, ascii_only):
    # strings full of brackets, quotes and backslashes must not change the count
    assert _json_depth(json.dumps(value, ensure_ascii=ascii_only)) == _depth(value)
