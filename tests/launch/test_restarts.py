"""The restart policy and failure signatures, pure: no process, no file but a report's, milliseconds each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conveyor.cluster import failure_report
from conveyor.cluster.failure_report import read_report, report_path
from conveyor.errors import ConveyorError
from conveyor.launch.failures import Signature, peer_signature, signature, signature_line
from conveyor.launch.restarts import (
    DELAY_CAP,
    Failure,
    Restart,
    RestartPolicy,
    Stop,
    decide,
    latest_step,
    stop_message,
)
from conveyor.train.checkpoint import CheckpointManager

CRASH = Signature("exited with status 1", "RuntimeError: boom")
OTHER = Signature("exited with status 1", "RuntimeError: something else")
USAGE = Signature("exited with status 2", "train.py: error: unrecognized arguments: --epocs 1", usage=True)
POLICY = RestartPolicy(max_restarts=5, delay=1.0, delay_cap=6.0, same_failure_limit=3)


def failure(sig: Signature = CRASH, step: int | None = None, start: int | None = None, task: str = "worker:1"):
    return Failure(f"{task} {sig.what}", sig, step=step, start_step=start, log_path=f"/out/logs/{task}.log")


# -- the policy's settings ------------------------------------------------------------------------


def test_the_policy_refuses_impossible_settings():
    for bad in (dict(max_restarts=-1), dict(max_restarts=True), dict(delay=-1.0), dict(delay=40.0),
                dict(same_failure_limit=0), dict(same_failure_limit=2.5)):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)


def test_for_run_caps_the_pauses_at_the_default_or_the_first_pause_if_longer():
    assert RestartPolicy.for_run(3, 1.0) == RestartPolicy(3, 1.0, DELAY_CAP, 3)
    assert RestartPolicy.for_run(0, 45.0).delay_cap == 45.0


def test_pauses_double_per_failure_without_progress_up_to_the_cap():
    assert [POLICY.delay_after(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 6.0, 6.0]


# -- decide ---------------------------------------------------------------------------------------


def test_a_first_failure_restarts_after_the_first_pause():
    assert decide(failure(), (), POLICY) == Restart(delay=1.0, number=1)


def test_different_failures_back_off_and_restart_until_max_restarts():
    history = (failure(CRASH), failure(OTHER), failure(CRASH), failure(OTHER))
    assert decide(failure(OTHER), history[:2], POLICY) == Restart(delay=4.0, number=3)
    assert decide(failure(CRASH), history, POLICY) == Restart(delay=6.0, number=5)
    assert decide(failure(OTHER), (*history, failure(CRASH)), POLICY) == Stop("exhausted", restarts=5)


def test_the_same_failure_three_times_without_progress_stops_whichever_task_it_struck():
    history = (failure(task="worker:1"), failure(task="worker:0"))
    assert decide(failure(task="worker:1"), history, POLICY) == Stop("repeated", restarts=2, times=3)
    assert decide(failure(task="worker:1"), history[:1], POLICY) == Restart(delay=2.0, number=2)


def test_a_different_failure_in_between_starts_the_count_again():
    history = (failure(CRASH), failure(CRASH), failure(OTHER))
    assert decide(failure(CRASH), history, POLICY) == Restart(delay=6.0, number=4)


def test_a_new_checkpoint_is_progress_it_resets_the_count_and_the_pause():
    history = (failure(step=None), failure(step=None))
    assert decide(failure(step=100), history, POLICY) == Restart(delay=1.0, number=3)
    assert decide(failure(step=None), history, POLICY) == Stop("repeated", restarts=2, times=3)


def test_a_usage_error_before_any_progress_is_never_retried():
    assert decide(failure(USAGE), (), POLICY) == Stop("usage", restarts=0)
    assert decide(failure(USAGE, step=300, start=300), (failure(),), POLICY) == Stop("usage", restarts=1)


def test_a_usage_error_after_a_new_checkpoint_is_weighed_as_any_failure():
    assert decide(failure(USAGE, step=200, start=100), (), POLICY) == Restart(delay=1.0, number=1)


def test_a_usage_error_stops_even_with_restarts_left_and_with_none():
    assert decide(failure(USAGE), (), RestartPolicy(max_restarts=0)) == Stop("usage", restarts=0)


def test_decide_is_pure():
    history = (failure(), failure(OTHER))
    assert decide(failure(), history, POLICY) == decide(failure(), history, POLICY)
    assert history == (failure(), failure(OTHER))


def test_the_messages_name_the_failure_and_the_fix():
    usage = stop_message(Stop("usage", 0), failure(USAGE, task="worker:0"), POLICY, "/out/checkpoints")
    assert usage.startswith("worker:0 exited with status 2: a usage or configuration error, which a restart would "
                            "meet again: 'train.py: error: unrecognized arguments: --epocs 1'; not restarting")
    assert "/out/logs/worker:0.log" in usage
    repeated = stop_message(Stop("repeated", 2, 3), failure(), POLICY, "/out/checkpoints")
    assert repeated.startswith("worker:1 exited with status 1 the same way 3 times in a row without progress")
    assert "/out/checkpoints" in repeated
    peer = Failure("worker:3 exited with status 1 on node 1", CRASH, details="last 1 lines:\n  | boom")
    assert stop_message(Stop("exhausted", 5), peer, POLICY, "/c") == (
        "worker:3 exited with status 1 on node 1; gave up after 5 restart(s) (--max-restarts 5)\n"
        "last 1 lines:\n  | boom")


def test_latest_step_is_the_step_the_tasks_resume_from(tmp_path):
    assert latest_step(str(tmp_path / "none")) is None
    mgr = CheckpointManager(tmp_path, keep=None, fsync=False)
    for step in (20, 100):
        mgr.save(step, {"model": {"w": torch.zeros(2)}})
    for name in ("step-00000300", "step-00000300.tmp", "notes"):  # a folder without a manifest is no checkpoint
        (tmp_path / name).mkdir()
    assert latest_step(str(tmp_path)) == 100 == mgr.resume_step()
    # The crash window of issue 19: step 100 sealed and renamed, `latest` still naming step 20. Both resume
    # from step 100 (the rename is the commit point), and the launcher says so.
    (tmp_path / "latest").write_text("step-00000020\n")
    assert latest_step(str(tmp_path)) == 100 == mgr.resume_step() == mgr.latest_step()
    # A damaged newest step: both pass over it to the same older one.
    flip = tmp_path / "step-00000100" / "model.safetensors"
    data = bytearray(flip.read_bytes())
    data[-1] ^= 0xFF
    flip.write_bytes(bytes(data))
    assert latest_step(str(tmp_path)) == 20 == mgr.resume_step()


# -- signatures -----------------------------------------------------------------------------------

ARGPARSE = ["usage: train.py [-h] [--epochs EPOCHS]", "               [--batch-size N]",
            "train.py: error: unrecognized arguments: --epocs 1"]


def test_argparse_errors_are_usage_errors():
    sig = signature(2, ARGPARSE)
    assert sig == Signature("exited with status 2", "train.py: error: unrecognized arguments: --epocs 1", usage=True)


def test_status_2_alone_is_not_a_usage_error():
    assert not signature(2, ["something went wrong"]).usage
    assert not signature(1, ARGPARSE).usage


def test_a_signature_names_no_task():
    assert signature(1, ["Traceback ...", "RuntimeError: boom"]) == CRASH
    assert signature(-9, ["step 10"]) == Signature("was killed by SIGKILL", "step 10")


def test_a_report_gives_the_error_and_whether_it_is_a_usage_error():
    report = Signature("conveyor.train.resume.ResumeError", "checkpoint x holds another model", usage=True)
    assert signature(1, ["anything"], report) == report
    assert signature(-9, ["anything"], report) == Signature("was killed by SIGKILL", "anything")


def test_a_peers_signature_travels_in_its_description():
    sig = Signature("conveyor.strategies.pipeline.split.SplitError", "--stages 5 but ...", usage=True)
    description = f"worker:1 exited with status 1 on node 1 (log: x there)\nlast 1 lines of x:\n  | boom\n" \
                  f"{signature_line(sig)}"
    found, rest = peer_signature(description)
    assert found == sig
    assert rest == "worker:1 exited with status 1 on node 1 (log: x there)\nlast 1 lines of x:\n  | boom"


def test_a_peers_description_without_a_signature_compares_by_status_and_last_line():
    found, _ = peer_signature("worker:1 exited with status 1 on node 1 (log: x there)\nlast 1 lines:\n  | boom")
    assert found == Signature("exited with status 1", "boom")
    found, _ = peer_signature("worker:2 was killed by SIGKILL on node 1 (log: y there)\nlast 0 lines of y:")
    assert found == Signature("was killed by SIGKILL", "")


# -- the task's report ----------------------------------------------------------------------------


class ConfigProblem(ConveyorError, ValueError):
    usage_error = True


def test_the_report_hook_writes_the_error_then_calls_the_previous_hook(tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: called.append(args[1]))
    env = {"CONVEYOR_OUTPUT_DIR": str(tmp_path), "CONVEYOR_TASK_TYPE": "worker", "CONVEYOR_TASK_INDEX": "1",
           "CONVEYOR_RESTART_COUNT": "0"}
    (tmp_path / "logs").mkdir()
    assert failure_report.install(env) and failure_report.install(env)  # twice: one hook
    error = ConfigProblem("--split x: not a layer")
    sys.excepthook(ConfigProblem, error, None)
    assert called == [error]
    path = report_path(str(tmp_path / "logs" / "worker-1.log"))
    assert read_report(path) == Signature(f"{__name__}.ConfigProblem", "--split x: not a layer", usage=True)
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    assert read_report(path) == Signature("builtins.RuntimeError", "boom", usage=False)


def test_no_hook_outside_conveyor_run(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert not failure_report.install({"CONVEYOR_OUTPUT_DIR": "/x", "CONVEYOR_TASK_TYPE": "worker",
                                       "CONVEYOR_TASK_INDEX": "0"})
    assert sys.excepthook is sys.__excepthook__


@pytest.mark.parametrize(("body", "recorded"), [
    ("pass", True),  # the script ran to its end
    ("sys.excepthook = lambda *a: None; raise RuntimeError('boom')", False),  # whichever hook prints it
    # a forked child running the inherited handler at its exit records nothing; os._exit runs no handler
    ("c = os.fork(); c == 0 and sys.exit(0); os.waitpid(c, 0); os._exit(0)", False),
])
def test_a_training_task_records_that_its_script_ran_to_its_end(tmp_path, body, recorded):
    env = {**os.environ, "CONVEYOR_OUTPUT_DIR": str(tmp_path), "CONVEYOR_TASK_TYPE": "worker",
           "CONVEYOR_TASK_INDEX": "1", "CONVEYOR_RESTART_COUNT": "0"}
    (tmp_path / "logs").mkdir()
    script = ("import os, sys; from conveyor.cluster import failure_report as f; f.install_finish(os.environ); "
              "print(os.getpid(), flush=True); " + body)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    path = failure_report.finished_path(str(tmp_path / "logs" / "worker-1.log"))
    assert path.endswith("logs/worker-1.finished.json")
    assert failure_report.finished_by(path, int(proc.stdout.split()[0])) is recorded, proc.stderr
    assert os.path.exists(path) is recorded
    assert not failure_report.finished_by(path, os.getpid()), "another process's record is not this one's"
    assert not failure_report.install_finish({"CONVEYOR_OUTPUT_DIR": "/x", "CONVEYOR_TASK_TYPE": "worker",
                                              "CONVEYOR_TASK_INDEX": "0"}), "no record outside conveyor run"


def test_a_malformed_report_is_none(tmp_path):
    path = tmp_path / "r.json"
    for text in ("not json", json.dumps([1]), json.dumps({"format": "conveyor.failure", "type": 1}),
                 json.dumps({"type": "x", "message": "y", "usage": False})):
        path.write_text(text)
        assert read_report(str(path)) is None
    assert read_report(str(tmp_path / "missing")) is None


def test_conveyors_configuration_errors_say_a_restart_meets_them_again():
    from conveyor.cluster import ClusterConfigError
    from conveyor.strategies.pipeline.split import SplitError
    from conveyor.train.devices import GpuPlacementError
    from conveyor.train.resume import ResumeError
    assert all(cls.usage_error for cls in (ClusterConfigError, SplitError, GpuPlacementError, ResumeError))
    assert not ConveyorError.usage_error
