"""The local supervisor: real processes, prefixed output, logs, restarts, stopping whole process groups.

The supervisor runs in the test process (it is the launcher minus argument parsing); the tasks are tiny
Python scripts that import nothing heavy, so a whole job takes a fraction of a second.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from conveyor.launch import NodeInfo, RunOptions, Supervisor, build_plan, free_ports, local_plan

pytestmark = pytest.mark.multiprocess


def make_plan(tmp_path: Path, body: str, *, workers: int = 2, ps: int = 0, strategy: str | None = None,
              chief: bool = False):
    script = tmp_path / "task.py"
    script.write_text("import os, sys, time, json\n" + textwrap.dedent(body))
    options = RunOptions(script=str(script), workers=workers, ps=ps, strategy=strategy, data_dir=str(tmp_path / "data"),
                         output_dir=str(tmp_path / "output"), python=sys.executable, chief=chief)
    ports = free_ports(workers + ps + 1)
    env = {**os.environ, "MARK_DIR": str(tmp_path)}
    return local_plan(options, ports[:-1], master_port=ports[-1], secret=b"s" * 32, environ=env)


def supervise(plan, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("restart_delay", 0.01)  # restarts back off for a second or more by default
    result = Supervisor(plan, out=out, err=err, **kwargs).run()
    return result, out.getvalue(), err.getvalue()


def wait_for(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_two_workers_prefixed_lines_and_full_logs(tmp_path):
    plan = make_plan(tmp_path, """
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        print(f"rank={os.environ['RANK']} task={task['type']}:{task['index']}")
        print("a warning", file=sys.stderr)
    """)
    result, out, err = supervise(plan)
    assert result.ok and result.exit_code == 0 and result.restarts == 0
    lines = out.splitlines()
    for i in (0, 1):
        assert f"[worker:{i}] rank={i} task=worker:{i}" in lines
        assert f"[worker:{i}] a warning" in lines
        log = (tmp_path / "output" / "logs" / f"worker-{i}.log").read_text().splitlines()
        assert log[0].startswith(f"=== worker:{i} started === ")
        assert log[1:] == [f"rank={i} task=worker:{i}", "a warning"]
    assert "attempt 0: started worker:0 pid" in err


def test_a_task_failing_on_its_first_attempt_restarts_the_job_once(tmp_path):
    plan = make_plan(tmp_path, """
        restart = os.environ["CONVEYOR_RESTART_COUNT"]
        print(f"attempt {restart}")
        if os.environ["RANK"] == "1" and restart == "0":
            sys.exit(3)
    """)
    result, out, err = supervise(plan)
    assert result.ok and result.restarts == 1
    assert ("worker:1 exited with status 3; restarting the job from the beginning (no checkpoint yet) in 0.01 s "
            "(restart 1 of 3)") in err
    for i in (0, 1):
        assert f"[worker:{i}] attempt 1" in out
        log = (tmp_path / "output" / "logs" / f"worker-{i}.log").read_text().splitlines()
        assert log[1] == "attempt 0"
        assert log[2].startswith("=== restart 1 === ")
        assert log[3] == "attempt 1"


def test_a_task_that_always_fails_ends_the_job_after_max_restarts(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["RANK"] == "1":
            for i in range(30):
                print(f"line {i}")
            raise SystemExit("worker 1 is broken")
        time.sleep(30)
    """)
    started = time.monotonic()
    result, out, err = supervise(plan, max_restarts=2)
    assert time.monotonic() - started < 10  # worker:0's 30 s sleeps were cut short every time
    assert not result.ok and result.exit_code == 1 and result.restarts == 2
    assert result.failure.task == "worker:1" and result.failure.returncode == 1
    assert result.failure.last_lines == tuple(f"line {i}" for i in range(11, 30)) + ("worker 1 is broken",)
    assert result.failure.log_path == str(tmp_path / "output" / "logs" / "worker-1.log")
    assert result.message == "worker:1 exited with status 1; gave up after 2 restart(s) (--max-restarts 2)"
    assert err.count("restarting the job") == 2


def test_a_task_killed_with_sigkill_restarts_the_job(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["CONVEYOR_RESTART_COUNT"] == "0" and os.environ["RANK"] == "0":
            open(os.path.join(os.environ["MARK_DIR"], "pid.tmp"), "w").write(f"{os.getpid()}\\n")
            os.rename(os.path.join(os.environ["MARK_DIR"], "pid.tmp"), os.path.join(os.environ["MARK_DIR"], "pid"))
            time.sleep(30)
        print("done", os.environ["CONVEYOR_RESTART_COUNT"])
    """)
    killed: list[int] = []

    def killer():
        pid = int(wait_for(tmp_path / "pid"))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result, out, err = supervise(plan)
    thread.join(timeout=10)
    assert killed and result.ok and result.restarts == 1
    assert "worker:0 was killed by SIGKILL; restarting the job" in err
    assert "[worker:0] done 1" in out and "[worker:1] done 1" in out


def test_a_task_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    plan = make_plan(tmp_path, """
        import signal
        mark = os.environ["MARK_DIR"]
        if os.environ["RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open(os.path.join(mark, "pid.tmp"), "w").write(f"{os.getpid()}\\n")
            os.rename(os.path.join(mark, "pid.tmp"), os.path.join(mark, "pid"))
            time.sleep(30)
        while not os.path.exists(os.path.join(mark, "pid")):
            time.sleep(0.01)
        sys.exit(1)
    """)
    started = time.monotonic()
    result, _, _ = supervise(plan, max_restarts=0, grace=0.5)
    assert time.monotonic() - started < 5
    assert result.failure.task == "worker:1"
    assert gone(int((tmp_path / "pid").read_text()))


def test_parameter_servers_left_running_after_the_workers_finish_are_stopped(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["CONVEYOR_TASK_TYPE"] == "ps":
            time.sleep(30)
    """, workers=1, ps=1, strategy="ps-sync")
    started = time.monotonic()
    result, _, err = supervise(plan, linger=0.3)
    assert result.ok and time.monotonic() - started < 5
    assert "ps:0 still running 0.3 s after every training task finished; stopping it" in err


class FakePeers:
    """Another node whose task fails during attempt 0, then every node succeeds; or one that aborts."""

    timeout = 5.0

    def __init__(self, abort_after: float | None = None, chief_done_after: float | None = None,
                 fail_first: bool = True):
        self.calls: list[tuple] = []
        self.fail_first = fail_first
        self.abort_at = None if abort_after is None else time.monotonic() + abort_after
        self.chief_done_at = None if chief_done_after is None else time.monotonic() + chief_done_after

    def failure(self, attempt):
        return "worker:3 exited with status 1 on node 1\nlast 1 lines of /out/logs/worker-3.log:\n  | oops" \
            if attempt == 0 and self.abort_at is None and self.fail_first else None

    def aborted(self):
        if self.abort_at is not None and time.monotonic() > self.abort_at:
            return "node 1's launcher was stopped by SIGINT"
        return None

    def report_failure(self, attempt, description):
        self.calls.append(("failure", attempt))

    def report_done(self, attempt):
        self.calls.append(("done", attempt))

    def all_done(self, attempt):
        return True

    def report_stopped(self, attempt):
        self.calls.append(("stopped", attempt))

    def all_stopped(self, attempt):
        return True

    def report_succeeded(self, attempt):
        self.calls.append(("succeeded", attempt))

    def report_trained(self, attempt):
        self.calls.append(("trained", attempt))

    def succeeded(self, attempt):
        if self.chief_done_at is not None:
            return time.monotonic() > self.chief_done_at
        return ("trained", attempt) in self.calls  # the other node's training tasks are done already

    def abort(self, description):
        self.calls.append(("abort",))


def test_a_failure_on_another_node_restarts_this_node_too(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["CONVEYOR_RESTART_COUNT"] == "0":
            time.sleep(30)
        print("attempt", os.environ["CONVEYOR_RESTART_COUNT"])
    """)
    peers = FakePeers()
    result, out, err = supervise(plan, peers=peers)
    assert result.ok and result.restarts == 1
    assert peers.calls == [("stopped", 0), ("trained", 1), ("done", 1)]
    assert "worker:3 exited with status 1 on node 1; restarting the job" in err
    assert "[worker:0] attempt 1" in out


def test_an_interrupted_node_stops_this_node_for_good(tmp_path):
    plan = make_plan(tmp_path, """
        time.sleep(30)
    """)
    started = time.monotonic()
    result, _, _ = supervise(plan, peers=FakePeers(abort_after=0.2))
    assert time.monotonic() - started < 5
    assert not result.ok and result.exit_code == 1 and result.restarts == 0
    assert result.message == "node 1's launcher was stopped by SIGINT"


def test_a_node_without_the_chief_ends_when_the_chiefs_node_says_it_succeeded(tmp_path):
    """TensorFlow 2's pattern over several machines: this node's workers only serve (server.join())."""
    plan = make_plan(tmp_path, """
        time.sleep(60)
    """)
    started = time.monotonic()
    peers = FakePeers(chief_done_after=0.3, fail_first=False)
    result, _, err = supervise(plan, peers=peers, linger=0.2)
    assert result.ok and result.exit_code == 0 and time.monotonic() - started < 30
    assert peers.calls == [("done", 0)] and "still running 0.2 s after" in err


def test_the_node_with_the_chief_tells_the_others_it_succeeded(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["CONVEYOR_TASK_TYPE"] != "chief":
            time.sleep(60)
    """, chief=True)
    peers = FakePeers(fail_first=False)
    result, _, _ = supervise(plan, peers=peers, linger=0.2)
    assert result.ok and peers.calls[:2] == [("succeeded", 0), ("done", 0)]


def ps_node_plan(tmp_path: Path, body: str):
    """Node 1 of two: parameter servers only (-n 0 --ps 1); node 0 has the training task."""
    script = tmp_path / "task.py"
    script.write_text("import os, sys, time\n" + textwrap.dedent(body))
    options = RunOptions(script=str(script), workers=0, ps=1, strategy="ps-sync", data_dir=str(tmp_path / "data"),
                         output_dir=str(tmp_path / "output"), python=sys.executable)
    ports = free_ports(3)
    nodes = [NodeInfo("127.0.0.1", 1, 0, ports[:1]), NodeInfo("127.0.0.1", 0, 1, ports[1:2])]
    return build_plan(options, nodes, 1, master_addr="127.0.0.1", master_port=ports[2], secret=b"s" * 32,
                      environ=dict(os.environ))


class LaterPeers(FakePeers):
    """The other nodes' training succeeds in attempt ``at``, ``after`` seconds after this node asks first."""

    def __init__(self, at: int = 0, after: float = 0.0):
        super().__init__(fail_first=False)
        self.at, self.after, self.asked = at, after, None

    def succeeded(self, attempt):
        if attempt != self.at:
            return False
        self.asked = self.asked or time.monotonic()
        return time.monotonic() - self.asked >= self.after


def test_a_node_of_parameter_servers_only_serves_until_the_job_has_succeeded(tmp_path):
    plan = ps_node_plan(tmp_path, """
        time.sleep(60)  # a ps that serves until it is stopped, as TensorFlow's do
    """)
    assert [t.name for t in plan.tasks] == ["ps:0"]
    started = time.monotonic()
    peers = LaterPeers(after=1.0)
    result, _, err = supervise(plan, peers=peers, linger=0.2)
    assert result.ok and 1.0 <= time.monotonic() - started < 30
    assert peers.calls == [("done", 0)]  # nothing trained here
    assert "ps:0 still running 0.2 s after every training task finished; stopping it" in err


def test_a_parameter_server_failing_on_its_own_node_restarts_the_job(tmp_path):
    plan = ps_node_plan(tmp_path, """
        if os.environ["CONVEYOR_RESTART_COUNT"] == "0":
            sys.exit(3)
        time.sleep(60)
    """)
    peers = LaterPeers(at=1)
    result, _, err = supervise(plan, peers=peers, linger=0.2)
    assert result.ok and result.restarts == 1
    assert peers.calls[:2] == [("failure", 0), ("stopped", 0)]
    assert "ps:0 exited with status 3; restarting the job" in err


def test_a_node_whose_workers_finished_keeps_its_ps_until_every_node_has(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["CONVEYOR_TASK_TYPE"] == "ps":
            time.sleep(60)
    """, workers=1, ps=1, strategy="ps-sync")
    peers = LaterPeers(after=1.0)  # another node's workers are still training
    started = time.monotonic()
    result, _, err = supervise(plan, peers=peers, linger=0.2)
    assert result.ok and time.monotonic() - started >= 1.0
    assert peers.calls == [("trained", 0), ("done", 0)]


def test_a_node_lost_while_the_others_wait_to_restart_ends_the_job_at_once(tmp_path):
    plan = make_plan(tmp_path, """
        time.sleep(60)
    """)

    class LostPeers(FakePeers):
        def all_stopped(self, attempt):
            return False  # node 1 never says it stopped: it is gone

        def aborted(self):
            return "lost node 1 (host1 at 10.0.0.2): no heartbeat" if ("stopped", 0) in self.calls else None

    started = time.monotonic()
    result, _, _ = supervise(plan, peers=LostPeers())
    assert not result.ok and result.restarts == 0 and result.message == "lost node 1 (host1 at 10.0.0.2): no heartbeat"
    assert time.monotonic() - started < LostPeers.timeout  # not the barrier's whole timeout


def test_segments_split_lines_and_live_updates():
    import io

    from conveyor.launch.tasks import segments as _segments

    stream = io.BufferedReader(io.BytesIO(b"hello\r\n\rbar 1\rbar 2\rbar 3\ndone\npartial"))
    assert list(_segments(stream)) == [("hello", False), ("bar 1", True), ("bar 2", True), ("bar 3", False),
                                       ("done", False), ("partial", False)]


# -- restarts: back off, and stop early when restarting cannot help ------------------------------------


def test_restarts_back_off_with_growing_delays(tmp_path):
    plan = make_plan(tmp_path, """
        with open(os.path.join(os.environ["MARK_DIR"], "starts"), "a") as f:
            f.write(f"{os.environ['RANK']} {time.monotonic()}\\n")
        if os.environ["RANK"] == "1" and os.environ["CONVEYOR_RESTART_COUNT"] != "3":
            print(f"flaky on attempt {os.environ['CONVEYOR_RESTART_COUNT']}")  # a different line every time
            sys.exit(3)
    """)
    result, _, err = supervise(plan, restart_delay=0.2, restart_delay_cap=0.5)
    assert result.ok and result.restarts == 3
    starts = [float(line.split()[1]) for line in (tmp_path / "starts").read_text().splitlines()
              if line.startswith("1 ")]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(gaps) == 3 and gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.5  # 0.2, 0.4, then the cap
    assert " in 0.2 s (restart 1 of 3)" in err and " in 0.4 s (restart 2 of 3)" in err and " in 0.5 s (restart 3" in err


def test_the_same_failure_before_any_progress_stops_early_saying_so(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["RANK"] == "1":
            raise SystemExit("checkpoint step-00000100 is damaged: model.safetensors sha256 mismatch")
    """)
    started = time.monotonic()
    result, _, err = supervise(plan, max_restarts=50, restart_delay=0.01)
    assert time.monotonic() - started < 10
    assert not result.ok and result.restarts == 2
    assert result.message.startswith(
        "worker:1 exited with status 1 the same way 3 times in a row without progress (no new checkpoint): "
        "'checkpoint step-00000100 is damaged: model.safetensors sha256 mismatch'; not restarting again")
    assert str(tmp_path / "output" / "logs" / "worker-1.log") in result.message
    assert err.count("restarting the job") == 2


def test_the_same_failure_on_alternating_tasks_stops_early_too(tmp_path):
    # The first task to fail alternates between the workers; what failed is the same (issue 22, defect 5).
    plan = make_plan(tmp_path, """
        if int(os.environ["RANK"]) == int(os.environ["CONVEYOR_RESTART_COUNT"]) % 2:
            raise SystemExit("--split features.9: not a layer of the model")
        time.sleep(30)
    """)
    result, _, err = supervise(plan, max_restarts=50, restart_delay=0.01)
    assert not result.ok and result.restarts == 2
    assert result.message.startswith("worker:0 exited with status 1 the same way 3 times in a row without progress")
    assert err.count("restarting the job") == 2


def test_a_usage_error_is_not_retried(tmp_path):
    plan = make_plan(tmp_path, """
        import argparse
        argparse.ArgumentParser().parse_args(["--epocs", "1"])
    """)
    result, _, err = supervise(plan, max_restarts=3)
    assert not result.ok and result.restarts == 0 and result.failure.returncode == 2
    assert "'task.py: error: unrecognized arguments: --epocs 1'; not restarting" in result.message
    assert "restarting the job" not in err


def test_a_new_checkpoint_counts_as_progress(tmp_path):
    plan = make_plan(tmp_path, """
        attempt = int(os.environ["CONVEYOR_RESTART_COUNT"])
        if os.environ["RANK"] == "1" and attempt < 4:  # a sealed (empty) step, as the chief's save leaves it
            from conveyor.stepfolders import FORMAT, MANIFEST, VERSION
            folder = os.path.join(os.environ["CONVEYOR_OUTPUT_DIR"], "checkpoints", f"step-{attempt + 1:08d}")
            os.makedirs(folder)
            seal = {"format": FORMAT, "version": VERSION, "step": attempt + 1, "time": time.time(), "parts": {}}
            with open(os.path.join(folder, MANIFEST), "w") as f:
                json.dump(seal, f)
            raise SystemExit("lost a peer")
    """)
    result, _, err = supervise(plan, max_restarts=5, restart_delay=0.01)
    assert result.ok and result.restarts == 4, err
    assert "restarting the job from its latest checkpoint (step 1) in " in err


def test_a_job_without_checkpoints_is_said_to_restart_from_the_beginning(tmp_path):
    plan = make_plan(tmp_path, """
        if os.environ["RANK"] == "1" and os.environ["CONVEYOR_RESTART_COUNT"] == "0":
            sys.exit(2)
    """)
    result, _, err = supervise(plan)
    assert result.ok
    assert "from its latest checkpoint" not in err
    assert "worker:1 exited with status 2; restarting the job from the beginning (no checkpoint yet)" in err


# -- the launcher's own disk ------------------------------------------------------------------------


class FullDiskLog:
    """A log file on a full disk: the first write succeeds (it fits in a partly used block), then ENOSPC."""

    def __init__(self, path: str, *args, **kwargs):
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_full_disk_is_reported_once_per_log_and_the_output_keeps_flowing(tmp_path, monkeypatch):
    from conveyor.launch import tasks as tasks_module  # where the task logs are opened

    monkeypatch.setattr(tasks_module, "open", FullDiskLog, raising=False)
    plan = make_plan(tmp_path, """
        import signal
        signal.alarm(30)  # a launcher that stops reading would block this task on a full pipe: end the test
        for i in range(200):
            print(f"line {i} " + "x" * 1000)
    """, workers=1)
    result, out, err = supervise(plan)
    assert result.ok, err
    assert out.count("[worker:0] line ") == 200
    log = tmp_path / "output" / "logs" / "worker-0.log"
    assert err.count("cannot write") == 1, err
    assert (f"cannot write the log {log}: No space left on device (disk full? free space or use --output-dir "
            f"elsewhere); worker:0's output still reaches this console") in err
    assert "Traceback" not in err


class RegroupPeers(FakePeers):
    """An elastic round's peers: the coordinator says to re-form the job after ``after`` seconds."""

    def __init__(self, after: float):
        super().__init__(fail_first=False)
        self.regroup_at = time.monotonic() + after

    def succeeded(self, attempt):
        return False

    def regroup(self):
        return "lost node(s) 2 of round 0" if time.monotonic() > self.regroup_at else None


def test_an_elastic_round_ends_in_regroup_and_goes_on_counting_attempts_not_failures(tmp_path):
    from conveyor.launch.failures import Signature
    from conveyor.launch.restarts import Failure

    plan = make_plan(tmp_path, """
        print("counts", os.environ["CONVEYOR_RESTART_COUNT"], os.environ["TORCHELASTIC_RESTART_COUNT"])
        time.sleep(30)
    """, workers=1)
    earlier = (Failure("worker:1 exited with status 1", Signature("exit 1", "oops")),)
    result, out, err = supervise(plan, peers=RegroupPeers(after=1.0), first_attempt=3, history=earlier)
    assert result.regroup and not result.ok and result.restarts == 3
    assert result.message == "lost node(s) 2 of round 0"
    assert "[worker:0] counts 3 1" in out  # the job's 4th start, after 1 failure
    assert "attempt 3: started worker:0" in err


@pytest.mark.parametrize(("strategy", "dies", "alone"), [
    ("ps-async", "worker:1", True), ("ps-ssp:2", "worker:1", True), ("ps-sync", "worker:1", False),
    ("ps-async", "worker:0", False), ("ps-async", "ps:0", False)])
def test_a_dead_ps_async_worker_is_restarted_alone_and_anything_else_restarts_the_job(tmp_path, monkeypatch, strategy,
                                                                                       dies, alone):
    monkeypatch.setenv("DIES", dies)
    plan = make_plan(tmp_path, """
        me = os.environ["CONVEYOR_TASK_TYPE"] + ":" + os.environ["CONVEYOR_TASK_INDEX"]
        mark = os.path.join(os.environ["MARK_DIR"], me.replace(":", "-"))
        first = not os.path.exists(mark)
        with open(mark, "a") as f:
            f.write(f"{os.getpid()} {os.environ.get('CONVEYOR_REJOIN', '-')} {os.environ['CONVEYOR_RESTART_COUNT']}\\n")
        if first and me == os.environ["DIES"]:
            time.sleep(0.2)
            sys.exit(3)
        time.sleep(2.0)
    """, workers=2, ps=1, strategy=strategy)
    result, out, err = supervise(plan, max_restarts=1)
    assert result.ok, err
    starts = {name: (tmp_path / name).read_text().splitlines() for name in ("worker-0", "worker-1", "ps-0")}
    if alone:  # the ps and worker 0 kept their one process; worker 1's replacement was told, in the same attempt
        assert f"{dies} exited with status 3; restarting {dies} alone" in err and "attempt 1" not in err
        assert [len(starts[n]) for n in ("worker-0", "ps-0")] == [1, 1]
        assert [line.split()[1:] for line in starts["worker-1"]] == [["-", "0"], ["1", "0"]]
        records = json.loads((tmp_path / "output" / "logs" / "restarts.json").read_text())
        assert [(r["task"], r["alone"]) for r in records] == [("worker:1", True)]
    else:  # a ps task, the chief, or any worker under ps-sync: the whole job, as before
        assert f"{dies} exited with status 3; restarting the job" in err and "attempt 1" in err
        assert all(len(lines) == 2 for lines in starts.values()), starts
        assert all("1" not in line.split()[1] for lines in starts.values() for line in lines)
