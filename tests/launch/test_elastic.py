"""Elastic membership, `conveyor run --nnodes MIN:MAX`: rounds, a lost node, a late joiner, too few nodes.

The parsing and the round's decision are pure; the jobs start three launchers on 127.0.0.1 (one task
each, a plain script that writes what it was told per round and waits), with short heartbeat and
last-call settings (--node-timeout, --rdzv-last-call).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.cli.main import main
from conveyor.launch import free_ports
from conveyor.launch.elastic import NodeSpan, parse_nnodes, round_decision
from conveyor.train.checkpoint import CheckpointManager

SECRET_HEX = bytes(range(64, 96)).hex()

# -- pure ---------------------------------------------------------------------------------------------


def test_nnodes_is_k_or_min_max():
    assert parse_nnodes("2") == NodeSpan(2, 2) and not parse_nnodes("2").elastic
    assert parse_nnodes("2:4") == NodeSpan(2, 4) and parse_nnodes("2:4").elastic and str(NodeSpan(2, 4)) == "2:4"
    assert parse_nnodes("3:3") == NodeSpan(3, 3) and str(NodeSpan(3, 3)) == "3"


@pytest.mark.parametrize("text, needle", [
    ("3:2", "--nnodes 3:2: MIN 3 is above MAX 2"),
    ("0:2", "--nnodes 0:2: expected 1 or more machines"),
    ("a:b", "--nnodes 'a:b': expected a number of machines K, or MIN:MAX"),
    ("1:2:3", "expected a number of machines K, or MIN:MAX"),
    ("", "expected a number of machines K"),
])
def test_bad_nnodes_are_refused_naming_the_flag(text, needle):
    with pytest.raises(ValueError, match="--nnodes") as info:
        parse_nnodes(text)
    assert needle in str(info.value)


def decide(have, missing=0, *, since_change=10.0, since_open=10.0, span=NodeSpan(2, 3), last_call=5.0,
           timeout=30.0):
    return round_decision(have=have, missing=missing, span=span, now=100.0, opened=100.0 - since_open,
                          last_change=100.0 - since_change, last_call=last_call, timeout=timeout)


def test_a_round_closes_at_max_or_at_min_after_a_quiet_last_call():
    assert decide(3, since_change=0.0) == "close"  # MAX: at once
    assert decide(2, since_change=1.0) == "wait"  # MIN: a last call for one more
    assert decide(2, since_change=5.0) == "close"
    assert decide(2, missing=1, since_change=6.0) == "wait"  # a survivor of the last round is not back yet
    assert decide(3, missing=1) == "wait"
    assert decide(1, since_open=20.0) == "wait"  # under MIN: waits for joiners ...
    assert decide(1, since_open=31.0) == "fail"  # ... up to the timeout
    assert decide(2, missing=1, since_open=31.0, since_change=1.0) == "close"  # the straggler joins the next


# -- bad input at the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (["--nnodes", "3:2"], "MIN 3 is above MAX 2"),
    (["--nnodes", "0:2"], "expected 1 or more machines"),
    (["--nnodes", "a:b"], "expected a number of machines K, or MIN:MAX"),
    (["--nnodes", "2:3", "--node-rank", "1", "--rdzv", "127.0.0.1:1"], "--node-rank 1 with --nnodes 2:3: in an "
                                                                        "elastic job each membership round gives"),
    (["--nnodes", "2:3", "--node-rank", "0"], "--nnodes 2:3 needs --rdzv HOST:PORT"),
    (["--nnodes", "2:3", "--rdzv", "127.0.0.1:1", "--rdzv-last-call", "-1"], "--rdzv-last-call -1.0"),
    (["--nnodes", "2:3", "--rdzv", "127.0.0.1:1", "--node-timeout", "0"], "--node-timeout 0.0"),
    (["--nnodes", "1:2", "--rdzv", "127.0.0.1:1", "--dry-run"], "--dry-run shows one machine's plan"),
    (["--nnodes", "1:2", "--rdzv", "127.0.0.1:1", "--data-workers", "2", "--data-pipeline", "pipe:make"],
     "an elastic job does not run the data"),
])
def test_bad_elastic_arguments_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVEYOR_JOB_SECRET", SECRET_HEX)
    (tmp_path / "train.py").write_text("print('never')\n")
    assert main(["run", *argv, "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert len(err.splitlines()) == 1 or err.startswith("usage:"), err


def test_elastic_nnodes_inside_an_srun_step_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never')\n")
    for name, value in {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1",
                        "SLURM_STEP_NODELIST": "n[1-2]"}.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--nnodes", "1:2", "train.py"]) == 2
    assert "--nnodes 1:2 inside an srun step: Slurm gives a step a fixed set of nodes" in capsys.readouterr().err


# -- launchers on 127.0.0.1 ----------------------------------------------------------------------------

TASK = """
    import json, os, pathlib, sys, time
    keys = ["WORLD_SIZE", "RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "CONVEYOR_ROUND", "CONVEYOR_RESTART_COUNT",
            "TORCHELASTIC_RESTART_COUNT", "CONVEYOR_RESUME"]
    seen = {k: os.environ.get(k) for k in keys}
    rnd, rank, restart = seen["CONVEYOR_ROUND"], seen["RANK"], seen["CONVEYOR_RESTART_COUNT"]
    pathlib.Path(f"seen-{rnd}-{rank}-{restart}.json").write_text(json.dumps(seen))
    if rnd == "0":  # round 0 waits: the test kills a node, starts one and makes a task fail, or says go
        deadline = time.monotonic() + 90
        while not pathlib.Path("go").exists():
            if pathlib.Path("fail").exists() and rank == "1" and restart == "0":
                sys.exit(3)
            if time.monotonic() > deadline:
                sys.exit(4)  # nothing re-formed the job
            time.sleep(0.05)
    print(f"round {rnd}: rank {rank} of {seen['WORLD_SIZE']} done")
"""

class Job:
    """Launchers of one elastic job on 127.0.0.1, their output in files; the tasks write into ``tmp_path``."""

    def __init__(self, tmp_path: Path, span: str = "2:3", timeout: float = 60.0, node_timeout: float = 3.0):
        self.tmp, self.span, self.timeout, self.node_timeout = tmp_path, span, timeout, node_timeout
        self.endpoint = f"127.0.0.1:{free_ports(1)[0]}"
        (tmp_path / "task.py").write_text(textwrap.dedent(TASK))
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *extra: str, host: bool = False, output: str | None = None) -> subprocess.Popen:
        with open(self.tmp / f"{name}.out", "w") as out, open(self.tmp / f"{name}.err", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "1", "--nnodes", self.span, "--rdzv",
                 self.endpoint, *(["--node-rank", "0"] if host else []),
                 "--output-dir", str(self.tmp / (output or name)),
                 "--timeout", str(self.timeout), "--node-timeout", str(self.node_timeout), "--rdzv-last-call", "1",
                 "--restart-delay", "0", *extra, "task.py"],
                cwd=self.tmp, stdout=out, stderr=err, env={**os.environ, "CONVEYOR_JOB_SECRET": SECRET_HEX})
        self.procs[name] = proc
        return proc

    def err(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def seen(self, pattern: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.tmp.glob(pattern))]

    def wait_for(self, what, timeout: float = 120.0) -> None:  # a loaded machine starts python slowly
        deadline = time.monotonic() + timeout
        while not what():
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert time.monotonic() < deadline, (dead, {n: self.err(n)[-2000:] for n in self.procs})
            time.sleep(0.1)

    def wait(self, name: str, timeout: float = 120.0) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running: {self.err(name)[-3000:]}") from None

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def job(tmp_path):
    made = []

    def make(**kwargs) -> Job:
        made.append(Job(tmp_path, **kwargs))
        return made[-1]

    yield make
    for j in made:
        j.close()


@pytest.mark.multiprocess
def test_a_lost_node_leaves_the_survivors_to_finish_without_a_replacement(job):
    j = job()
    j.start("a", host=True)
    j.start("b")
    j.start("c")
    j.wait_for(lambda: len(list(j.tmp.glob("seen-0-*"))) == 3)  # MAX joined: round 0 closed at once
    assert {s["WORLD_SIZE"] for s in j.seen("seen-0-*")} == {"3"}
    victim = "c"  # not node 0, whichever rank the round gave it
    started = time.monotonic()
    j.procs[victim].send_signal(signal.SIGKILL)  # its task dies with it (PR_SET_PDEATHSIG)
    j.wait_for(lambda: len(list(j.tmp.glob("seen-1-*"))) == 2)
    # --node-timeout 3, --rdzv-last-call 1: waiting for a replacement would have taken --timeout (60 s)
    assert time.monotonic() - started < 60
    for name in "ab":
        assert j.wait(name) == 0, j.err(name)
    round1 = j.seen("seen-1-*")
    assert len(round1) == 2, round1
    assert sorted(s["RANK"] for s in round1) == ["0", "1"]
    for s in round1:
        assert (s["WORLD_SIZE"], s["GROUP_WORLD_SIZE"], s["CONVEYOR_ROUND"]) == ("2", "2", "1"), s
        # a membership change is no failure: torchrun's restart count stays, the job's own says "resume"
        assert (s["TORCHELASTIC_RESTART_COUNT"], s["CONVEYOR_RESTART_COUNT"], s["CONVEYOR_RESUME"]) == ("0", "1", "1")
    err = j.err("a")
    assert "lost node(s)" in err and "the job goes on without it, with 2 node(s) (--nnodes 2:3)" in err, err
    assert "round 1: node 0 of 2 (--nnodes 2:3), world size 2" in err, err
    assert "[conveyor] job finished" in err
    # the membership change is a restart to recover from: node 0 records its moments (summary.json's recovery)
    (record,) = json.loads((j.tmp / "a" / "logs" / "restarts.json").read_text())
    assert record["attempt"] == 1 and record["seen"] <= record["stopped"] <= record["started"], record
    assert not (j.tmp / "b" / "logs" / "restarts.json").exists()  # one writer: the chief's node


@pytest.mark.multiprocess
def test_a_killed_launcher_is_lost_at_once_by_its_lifeline_not_after_the_node_timeout(job):
    j = job(node_timeout=60.0, timeout=120.0)
    j.start("a", host=True)
    j.start("b")
    j.start("c")
    j.wait_for(lambda: len(list(j.tmp.glob("seen-0-*"))) == 3)
    started = time.monotonic()
    j.procs["c"].send_signal(signal.SIGKILL)  # its kernel closes its connection to node 0
    j.wait_for(lambda: len(list(j.tmp.glob("seen-1-*"))) == 2)
    assert time.monotonic() - started < 30  # the heartbeat alone would take --node-timeout 60 s
    err = j.err("a")
    assert "of round 0: its launcher's connection to node 0 closed (the process is gone); the job goes on without " \
           "it, with 2 node(s)" in err, err
    for name in "ab":
        assert j.wait(name) == 0, j.err(name)


DRAINED = """
    import os, pathlib, sys, time
    import torch
    from torch import nn
    import conveyor
    from conveyor.data import Dataset
    from conveyor.train.trainer import Trainer

    rnd = int(os.environ["CONVEYOR_ROUND"])
    latest = pathlib.Path(os.environ["CONVEYOR_OUTPUT_DIR"], "checkpoints", "latest")
    start = int(latest.read_text().strip().split("-")[-1]) if latest.exists() else 0
    job = conveyor.init()
    x = torch.arange(64, dtype=torch.float32).reshape(32, 2)
    data = Dataset.from_tensor_slices((x.numpy(), (x[:, 0] % 2).long().numpy())).shard(job.world_size, job.rank)
    torch.manual_seed(0)
    linear = nn.Linear(2, 2)
    model, opt = job.prepare(linear, torch.optim.SGD(linear.parameters(), lr=0.01))
    steps = pathlib.Path(f"steps-{job.rank}.txt")

    def slow(event):  # round 0 runs until the node that joins is there; round 1 takes 5 steps and ends
        with steps.open("a") as f:
            f.write(f"{rnd} {event.step}\\n")
        if rnd == 0:
            time.sleep(0.05)

    Trainer(job, model, opt, nn.functional.cross_entropy, data.batch(4), epochs=100000,
            max_steps=start + (5 if rnd else 100000), checkpoint_every_steps=100000, progress=False,
            callbacks=[slow]).fit()
    job.shutdown()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_node_that_joins_stops_the_steps_at_a_checkpoint_so_none_is_undone(job):
    j = job(span="1:2", timeout=120.0)
    (j.tmp / "task.py").write_text(textwrap.dedent(DRAINED))
    j.start("a", host=True, output="out")  # one output folder: node b's worker reads the checkpoint node 0's wrote
    j.wait_for(lambda: (j.tmp / "steps-0.txt").exists())  # round 0: node 0 alone (MIN 1), stepping
    j.start("b", output="out")
    for name in "ab":
        assert j.wait(name, timeout=200) == 0, j.err(name)
    lines = [tuple(map(int, line.split())) for line in (j.tmp / "steps-0.txt").read_text().splitlines()]
    round0 = [step for rnd, step in lines if rnd == 0]
    round1 = [step for rnd, step in lines if rnd == 1]
    err = j.err("a")
    saved = int(err.split("the job is re-formed at checkpoint step ")[1].split()[0].rstrip(";,"))
    assert round0[-1] == saved, (round0[-3:], saved, err)  # the chief stopped at the checkpoint: no step past it
    assert round1 == [saved + 1 + i for i in range(5)], round1  # round 1 resumed from it, on 2 workers
    assert "stopped at this checkpoint until round 1 starts" in (j.tmp / "out" / "logs" / "worker-0.log").read_text()
    assert (j.tmp / "steps-1.txt").read_text().split()[:2] == ["1", str(saved + 1)]


@pytest.mark.multiprocess
def test_a_late_node_waits_and_joins_at_the_next_restart(job):
    j = job()
    j.start("a", host=True)
    j.start("b")
    j.wait_for(lambda: len(list(j.tmp.glob("seen-0-*"))) == 2)  # MIN and a quiet last call: round 0 has 2
    j.start("c")
    j.wait_for(lambda: "this node waits to join the next" in j.err("c"))
    time.sleep(0.5)
    assert not list(j.tmp.glob("seen-1-*"))  # it waits: the running round goes on without it
    (j.tmp / "fail").touch()  # rank 1 fails once: the restart takes the waiting node in
    for name in "abc":
        assert j.wait(name) == 0, j.err(name)
    round1 = j.seen("seen-1-*")
    assert sorted(s["RANK"] for s in round1) == ["0", "1", "2"], round1
    assert {(s["WORLD_SIZE"], s["CONVEYOR_ROUND"]) for s in round1} == {("3", "1")}
    assert "wait to join" in j.err("a") and "re-formed at the restart after a failure" in j.err("a"), j.err("a")


@pytest.mark.multiprocess
def test_a_node_waiting_at_a_full_round_is_told_when_the_job_ends(job):
    j = job(span="1:2")
    j.start("a", host=True)
    j.start("b")
    j.wait_for(lambda: len(list(j.tmp.glob("seen-0-*"))) == 2)  # MAX: round 0 closed at once
    j.start("c")
    j.wait_for(lambda: "this node waits to join the next" in j.err("c"))
    (j.tmp / "go").touch()  # round 0 ends well: MAX nodes took nobody else, and nothing failed
    for name in "ab":
        assert j.wait(name) == 0, j.err(name)
    assert j.wait("c") == 0
    assert "the job ended before this node was needed" in j.err("c")
    assert not list(j.tmp.glob("seen-1-*"))


@pytest.mark.multiprocess
def test_fewer_nodes_than_min_fail_naming_how_many_there_are_and_are_needed(job):
    j = job(timeout=3.0)
    j.start("a", host=True)
    assert j.wait("a") == 1
    err = j.err("a")
    assert "round 0 has 1 node(s), but --nnodes 2:3 needs at least 2; no more joined within 3 s" in err, err
    assert not list(j.tmp.glob("seen-*"))


@pytest.mark.multiprocess
def test_a_joiner_with_another_strategy_is_refused_naming_the_flag_and_the_job_goes_on(job):
    j = job(span="1:2")
    j.start("a", host=True)
    j.wait_for(lambda: len(list(j.tmp.glob("seen-0-*"))) == 1)  # MIN 1: node 0 alone after the last call
    j.start("b", "--strategy", "allreduce")
    assert j.wait("b") == 1
    assert "has --strategy = 'allreduce' but node 0 has None; start every node with the same --strategy" in j.err("b")
    assert "refused a node" in j.err("a")
    j.procs["a"].send_signal(signal.SIGINT)  # node 0 never stopped for it: its round 0 still runs
    assert j.wait("a") == 130


# -- node 0's coordinator, tick by tick over an in-memory store ------------------------------------------------


class DictStore:
    """The TCPStore calls the coordinator makes, in memory."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
        return int(self.data[key])

    def compare_set(self, key, expected, desired):
        if self.data.get(key, b"") == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]


SETTINGS = {"nnodes": "2:3", "strategy": None, "script": "train.py"}


def coordinator(tmp_path, store: DictStore, span=NodeSpan(2, 3)):
    from conveyor.launch.elastic import Coordinator
    from conveyor.launch.rendezvous import StorePeers

    def peers(node):
        p = StorePeers(store, nnodes=2, node_rank=node, endpoint="10.0.0.1:29400", timeout=5.0,
                       secret=bytes(range(32)))
        p.run = "run1"
        return p

    c = Coordinator(peers(0), span=span, endpoint="10.0.0.1:29400", settings=SETTINGS, timeout=30.0, last_call=5.0,
                    node_timeout=3.0, checkpoint_dir=str(tmp_path / "checkpoints"))
    c._put("conveyor/open", {"round": 0})
    c.opened = c.last_change = 0.0  # the ticks below give the time
    return c, peers


def want(peers, node, rnd, attempt=0, **settings):
    p = peers(node)
    key = f"conveyor/want/{rnd}/{node}"
    record = {"host": f"10.0.0.{node + 1}", "workers": 1, "ps": 0, "ports": [2000 + node],
              "hostname": f"host{node}", "settings": {**SETTINGS, **settings}, "attempt": attempt}
    p._store.set(key, p._sealed(key, record))
    if node:
        p._store.add("conveyor/joins", 0)
        p._store.data["conveyor/joins"] = str(max(node, int(p._store.data["conveyor/joins"]))).encode()


def beat(peers, node, count):
    p = peers(node)
    p.beat_key = f"conveyor/alive/m{node}"
    p.beat(count)


def record(peers, key):
    return peers(0)._read(key)


def test_the_coordinator_closes_re_forms_and_refuses(tmp_path):
    store = DictStore()
    c, peers = coordinator(tmp_path, store)
    want(peers, 0, 0)
    want(peers, 1, 0)
    want(peers, 2, 0, strategy="ps-sync")  # refused at once, naming the flag
    beat(peers, 1, 0)
    c.tick(0.0)
    refused = record(peers, "conveyor/refused/2")["description"]
    assert "has --strategy = 'ps-sync' but node 0 has None; start every node with the same --strategy" in refused
    beat(peers, 1, 1)
    c.tick(4.0)
    assert record(peers, "conveyor/round/0") is None  # MIN, but the last call is not over
    beat(peers, 1, 2)
    c.tick(5.5)
    assert record(peers, "conveyor/round/0")["members"] == [0, 1]

    # a node asks while round 0 runs: it waits for the next checkpoint (none is there yet)
    want(peers, 3, 1)
    beat(peers, 3, 1)
    c.tick(6.0)
    assert record(peers, "conveyor/regroup/0") is None
    CheckpointManager(tmp_path / "checkpoints", fsync=False).save(10, {})
    beat(peers, 1, 3)
    c.tick(7.5)
    reason = record(peers, "conveyor/regroup/0")["description"]
    assert "1 node(s) wait to join (host3 at 10.0.0.4); the job is re-formed at checkpoint step 10" in reason
    assert record(peers, "conveyor/open") == {"round": 1}

    # round 1: node 0, the survivor 1, the newcomer 3, ranks in that order, attempts going on counting
    want(peers, 0, 1, attempt=1)
    want(peers, 1, 1)
    beat(peers, 1, 4)
    beat(peers, 3, 2)
    c.tick(8.0)
    assert record(peers, "conveyor/round/1") == {
        "members": [0, 1, 3], "attempt": 1,
        "nodes": [{"host": f"10.0.0.{n + 1}", "workers": 1, "ps": 0, "ports": [2000 + n], "hostname": f"host{n}"}
                  for n in (0, 1, 3)]}

    # node 3 falls silent: lost after --node-timeout 3, and the job goes on with 2
    beat(peers, 1, 5)
    c.tick(10.0)
    beat(peers, 1, 6)
    c.tick(11.5)
    reason = record(peers, "conveyor/regroup/1")["description"]
    assert "lost node(s) 2 of round 1: no heartbeat from the launcher for 3 s; the job goes on without it" in reason
    want(peers, 3, 2)  # it speaks again: refused, it was declared lost
    c.tick(11.6)
    assert "was declared lost" in record(peers, "conveyor/refused/3")["description"]


def test_a_round_under_min_fails_after_the_timeout_naming_the_counts(tmp_path):
    store = DictStore()
    c, peers = coordinator(tmp_path, store)
    want(peers, 0, 0)
    c.tick(29.0)
    assert peers(0).aborted() is None
    c.tick(31.0)
    assert "round 0 has 1 node(s), but --nnodes 2:3 needs at least 2; no more joined within 30 s" in peers(0).aborted()


@pytest.mark.parametrize("theirs, needle", [
    ({"script": "other.py"}, "runs the training script 'other.py' but node 0 runs 'train.py'; start every node with "
                             "the same script and arguments"),
    ({"script_args": "0123abcd"}, "runs the script's arguments (sha256) '0123abcd'"),
    ({"split": ["blocks.2"]}, "has --split = ['blocks.2'] but node 0 has None; start every node with the same --split"),
    ({"nnodes": "2:4"}, "has --nnodes = '2:4' but node 0 has '2:3'"),
])
def test_a_joiner_that_differs_is_refused_naming_what(tmp_path, theirs, needle):
    c, peers = coordinator(tmp_path, DictStore())
    want(peers, 0, 0)
    want(peers, 1, 0, **theirs)
    c.tick(0.0)
    refused = record(peers, "conveyor/refused/1")["description"]
    assert refused.startswith("rendezvous at 10.0.0.1:29400: a joining node (host1 at 10.0.0.2) ") and needle in refused


class ClosedLifeline:
    """Lifelines whose member ``node`` closes its connection at the first poll after ``close()``."""

    def __init__(self):
        self.pending: set[int] = set()

    def poll(self):
        gone, self.pending = self.pending, set()
        return gone

    def close(self):
        pass


def test_a_closed_lifeline_loses_the_node_at_once_and_the_survivors_close_the_next_round_without_a_last_call(
        tmp_path):
    store = DictStore()
    c, peers = coordinator(tmp_path, store, span=NodeSpan(2, 4))
    c._lifelines = ClosedLifeline()
    for node in (0, 1, 2):
        want(peers, node, 0)
        beat(peers, node, 0)
    c.tick(0.0)
    for t, count in ((2.5, 1), (5.0, 2), (5.5, 3)):  # MIN, no MAX: the last call (5 s) for round 0
        beat(peers, 1, count)
        beat(peers, 2, count)
        c.tick(t)
    assert record(peers, "conveyor/round/0")["members"] == [0, 1, 2]
    beat(peers, 1, 4)
    beat(peers, 2, 4)
    c.tick(6.0)
    c._lifelines.pending = {2}  # its launcher was killed: well within --node-timeout 3
    c.tick(6.1)
    reason = record(peers, "conveyor/regroup/0")["description"]
    assert "lost node(s) 2 of round 0: its launcher's connection to node 0 closed (the process is gone)" in reason
    want(peers, 0, 1, attempt=1)
    want(peers, 1, 1)
    beat(peers, 1, 5)
    c.tick(6.3)  # every survivor is back, no newcomer: no last call
    assert record(peers, "conveyor/round/1")["members"] == [0, 1]


def test_a_waiting_node_asks_the_chief_to_stop_at_a_checkpoint_and_its_leaving_withdraws_it(tmp_path):
    store = DictStore()
    c, peers = coordinator(tmp_path, store)
    drain = tmp_path / "logs" / "drain"
    want(peers, 0, 0)
    want(peers, 1, 0)
    for t, count in ((0.0, 0), (2.5, 1), (5.5, 2)):
        beat(peers, 1, count)
        c.tick(t)
    assert record(peers, "conveyor/round/0")["members"] == [0, 1] and not drain.exists()
    want(peers, 3, 1)  # a node asks while round 0 runs
    beat(peers, 3, 0)
    beat(peers, 1, 3)
    c.tick(6.0)
    assert json.loads(drain.read_text()) == {"round": 0}  # the chief of round 0 saves after its next step
    beat(peers, 1, 4)
    c.tick(8.0)
    beat(peers, 1, 5)
    c.tick(9.5)  # node 3 fell silent (--node-timeout 3) before the checkpoint: the request is withdrawn
    assert not drain.exists() and record(peers, "conveyor/regroup/0") is None
