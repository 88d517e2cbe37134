"""`conveyor run` end to end: the command line, --dry-run, a real job, failures, Ctrl-C/SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conveyor.cli.main import main

SECRET_HEX = "5ec1e7" * 11  # 66 hex digits = 33 bytes


def write_script(tmp_path: Path, body: str, name: str = "task.py") -> Path:
    script = tmp_path / name
    script.write_text("import os, sys, time, json, subprocess\n" + textwrap.dedent(body))
    return script


def launcher(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`conveyor run ARGS` in ``tmp_path``, its stdout and stderr in files (nothing can block on a pipe)."""
    out = open(tmp_path / "launcher.out", "w")
    err = open(tmp_path / "launcher.err", "w")
    with out, err:
        return subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "run", *args], cwd=tmp_path,
                                stdout=out, stderr=err, env={**os.environ, "MARK_DIR": str(tmp_path)})


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 30) -> tuple[int, str, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return code, (tmp_path / "launcher.out").read_text(), (tmp_path / "launcher.err").read_text()


def wait_for_lines(path: Path, count: int, timeout: float = 15.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"{path} has fewer than {count} lines after {timeout} s")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # orphans' zombies stay where PID 1 never reaps
    except psutil.NoSuchProcess:
        return True


# -- argument handling and --dry-run (in process, nothing starts) ---------------------------------------


def test_dry_run_lists_every_task_with_its_command_and_environment_secret_masked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET_HEX + "\n")
    secret_file.chmod(0o600)
    code = main(["run", "--dry-run", "-n", "2", "--ps", "1", "--strategy", "ps-async", "--job-secret-file",
                 str(secret_file), "--timeout", "60", "--no-resume", "train.py", "--epochs", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert SECRET_HEX[:12] not in out
    assert out.count("CONVEYOR_JOB_SECRET=<masked: 66 hex digits>") == 3
    for task in ("worker:0", "worker:1", "ps:0"):
        assert f"[{task}] {sys.executable} train.py --epochs 1" in out
        kind, index = task.split(":")
        assert f"log: {tmp_path}/output/logs/{kind}-{index}.log" in out
    assert out.count("CONVEYOR_TIMEOUT=60\n") == 3 and out.count("CONVEYOR_RESUME=0\n") == 3
    assert f"CONVEYOR_DATA_DIR={tmp_path}/data" in out and "WORLD_SIZE=2" in out
    assert "note: train.py does not exist" in out
    assert not (tmp_path / "output").exists()  # a dry run starts and writes nothing


def test_help_shows_an_example(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "conveyor run -n 2 train.py --epochs 1" in out and "--max-restarts" in out and "--rdzv" in out
    assert "--tf-flags" in out and "--linger" in out and "when the chief exits 0" in out  # the success policy


@pytest.mark.parametrize("argv, needle", [
    (["run", "-n", "0", "train.py"], "--workers 0"),
    (["run", "-n", "0", "--ps", "1", "--strategy", "ps-sync", "train.py"], "-n 0 starts no training process"),
    (["run", "-n", "0", "--ps", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:1",
      "train.py"], "-n 0 on node 0"),
    (["run", "--ps", "1", "--strategy", "allreduce", "--dry-run", "train.py"], "--strategy ps-sync"),
    (["run", "--nnodes", "2", "train.py"], "--node-rank"),
    (["run", "--node-rank", "1", "train.py"], "--nnodes"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--rdzv", "127.0.0.1:1", "train.py"], "out of range"),
    (["run", "missing.py"], "missing.py: no such file"),
    (["run"], "SCRIPT"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_a_secret_file_that_is_not_hex_is_refused_without_echoing_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret").write_text("hunter2-hunter2-hunter2-hunter2-hunter2")
    (tmp_path / "secret").chmod(0o600)
    assert main(["run", "--dry-run", "--job-secret-file", "secret", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "--job-secret-file secret" in err


def test_an_interpreter_that_does_not_exist_is_reported(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_script(tmp_path, "print('never')\n")
    assert main(["run", "--python", str(tmp_path / "no-python"), "task.py"]) == 2
    assert f"conveyor run: error: {tmp_path / 'no-python'}: No such file or directory" in capsys.readouterr().err


# -- real jobs --------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_workers_prefix_their_lines_and_keep_full_logs(tmp_path):
    write_script(tmp_path, """
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        print(f"RANK={os.environ['RANK']} task={task['type']}:{task['index']} args={sys.argv[1:]}")
    """)
    code, out, err = finish(launcher(tmp_path, "-n", "2", "task.py", "--epochs", "1"), tmp_path)
    assert code == 0, err
    assert "[worker:0] RANK=0 task=worker:0 args=['--epochs', '1']" in out.splitlines()
    assert "[worker:1] RANK=1 task=worker:1 args=['--epochs', '1']" in out.splitlines()
    for i in (0, 1):
        log = (tmp_path / "output" / "logs" / f"worker-{i}.log").read_text()
        assert f"RANK={i} task=worker:{i} args=['--epochs', '1']\n" in log
    assert "[conveyor] job finished" in err
    assert err.splitlines()[-1] == f"[conveyor] outputs in {tmp_path / 'output'}: logs/"  # a plain script: no more


@pytest.mark.multiprocess
def test_torchs_reverse_lookup_warning_stays_in_the_log_and_off_the_console(tmp_path):
    """torch's `[c10d] The hostname of the client socket cannot be retrieved. err=-3` came on every
    multi-host run where no DNS server answers (tasks.QUIET says why it is harmless)."""
    warning = ("[W1127 16:03:39.304496537 socket.cpp:207] [c10d] The hostname of the client socket cannot be "
               "retrieved. err=-3")
    write_script(tmp_path, f"""
        print({warning!r}, file=sys.stderr, flush=True)
        print("trained", flush=True)
    """)
    code, out, err = finish(launcher(tmp_path, "task.py"), tmp_path)
    assert code == 0, err
    assert "[worker:0] trained" in out.splitlines() and "hostname of the client socket" not in out + err
    assert warning in (tmp_path / "output" / "logs" / "worker-0.log").read_text().splitlines()


@pytest.mark.multiprocess
def test_a_job_that_keeps_failing_exits_1_naming_the_task_and_its_last_lines(tmp_path):
    write_script(tmp_path, """
        if os.environ["RANK"] == "1":
            print("loading data", flush=True)
            print(f"CUDA out of patience on attempt {os.environ['CONVEYOR_RESTART_COUNT']}", file=sys.stderr)
            sys.exit(7)
    """)
    code, _, err = finish(launcher(tmp_path, "-n", "2", "--max-restarts", "1", "task.py"), tmp_path)
    assert code == 1
    assert "conveyor run: error: job failed: worker:1 exited with status 7; gave up after 1 restart(s)" in err
    log = tmp_path / "output" / "logs" / "worker-1.log"
    assert f"last 2 lines of {log}:\n  | loading data\n  | CUDA out of patience on attempt 1\n" in err


@pytest.mark.multiprocess
def test_a_typo_in_the_scripts_arguments_fails_once_naming_it(tmp_path):
    # argparse exits 2 before the first step: every restart would fail the same way (issue 22, defect 5)
    write_script(tmp_path, """
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int, default=1)
        parser.parse_args()
    """)
    started = time.monotonic()
    code, _, err = finish(launcher(tmp_path, "-n", "2", "--max-restarts", "3", "task.py", "--epocs", "1"), tmp_path)
    assert code == 1 and time.monotonic() - started < 20
    assert "a usage or configuration error, which a restart would meet again: " \
           "'task.py: error: unrecognized arguments: --epocs 1'; not restarting" in err
    assert "attempt 0: started" in err and "attempt 1" not in err and "restarting the job" not in err


@pytest.mark.multiprocess
def test_the_same_error_on_alternating_ranks_is_the_same_failure(tmp_path):
    # The first task to fail changes with each attempt; what failed does not: the third time ends the job.
    write_script(tmp_path, """
        from conveyor.cluster import failure_report
        from conveyor.errors import ConveyorError
        class Damaged(ConveyorError):
            pass
        failure_report.install(os.environ)  # what conveyor.init() does under conveyor run
        attempt = int(os.environ["CONVEYOR_RESTART_COUNT"])
        if int(os.environ["RANK"]) != attempt % 2:
            time.sleep(30)  # the other rank: stopped when the first fails
        raise Damaged("checkpoint step-00000010 is damaged")
    """)
    code, _, err = finish(launcher(tmp_path, "-n", "2", "--max-restarts", "5", "--restart-delay", "0.1", "task.py"),
                          tmp_path, timeout=60)
    assert code == 1
    assert err.count("restarting the job") == 2 and "attempt 2: started" in err and "attempt 3" not in err
    assert "the same way 3 times in a row without progress (no new checkpoint): " \
           "'checkpoint step-00000010 is damaged'" in err


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("when", ["after the end", "before the end"])
def test_a_task_that_aborts_after_its_script_ran_to_its_end_finished_one_that_aborts_before_failed(tmp_path, when):
    # gloo can abort a finished process in the interpreter's finalization (pytorch/pytorch PR 179291, ~1 run in
    # 20): os.abort() from an atexit handler registered before conveyor.init() runs after init's record of the end
    early = when == "before the end"
    write_script(tmp_path, f"""
        import atexit
        import conveyor
        atexit.register(os.abort)  # the finalization's abort; registered first, it runs last of conveyor's
        job = conveyor.init()
        job.barrier()
        job.shutdown()
        if {early}:
            os.abort()  # the script had not finished its work: a failure
        print("results written", flush=True)
    """)
    code, out, err = finish(launcher(tmp_path, "-n", "2", "--max-restarts", "1", "--restart-delay", "0.1",
                                     "--timeout", "60", "task.py"), tmp_path, timeout=200)
    if early:
        assert code == 1, err
        assert "worker:0 was killed by SIGABRT" in err or "worker:1 was killed by SIGABRT" in err, err
        assert "restarting the job" in err and "counted as finished" not in err, err
    else:
        assert code == 0, err
        assert out.count("results written") == 2 and "restarting the job" not in err, err
        for rank in (0, 1):
            assert f"worker:{rank} was killed by SIGABRT after its script ran to its end (an abort in the " \
                   f"interpreter's finalization" in err and "counted as finished" in err, err


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_task_and_its_children(tmp_path, signum):
    # Each task starts a child (in its process group) and both sleep: nothing may survive the launcher.
    write_script(tmp_path, """
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(os.path.join(os.environ["MARK_DIR"], "pids"), "a") as f:
            f.write(f"{os.getpid()}\\n{child.pid}\\n")
        time.sleep(60)
    """)
    proc = launcher(tmp_path, "-n", "2", "task.py")
    pids = [int(p) for p in wait_for_lines(tmp_path / "pids", 4)]
    assert not any(gone(pid) for pid in pids)
    proc.send_signal(signum)
    code, _, err = finish(proc, tmp_path, timeout=15)
    assert code == 128 + signum
    assert f"interrupted by {signal.Signals(signum).name}; every task was stopped" in err
    assert [pid for pid in pids if not gone(pid)] == []


# -- hardening -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_every_task_exits_when_the_launcher_is_killed_with_sigkill(tmp_path):
    # What the OOM killer or a scheduler does: no handler runs in the launcher, so the kernel must end the tasks.
    write_script(tmp_path, """
        with open(os.path.join(os.environ["MARK_DIR"], "pids"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(60)
    """)
    proc = launcher(tmp_path, "-n", "2", "--ps", "1", "--strategy", "ps-sync", "task.py")
    tasks: list[psutil.Process] = []
    try:
        tasks = [psutil.Process(int(p)) for p in wait_for_lines(tmp_path / "pids", 3)]
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not all(gone(t.pid) for t in tasks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [t.pid for t in tasks if not gone(t.pid)] == []
    finally:
        for t in tasks:
            try:
                t.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv, needle", [
    (["run", "--timeout", "inf", "task.py"], "--timeout inf: expected a finite number of seconds > 0"),
    (["run", "--timeout", "nan", "task.py"], "--timeout nan"),
    (["run", "--timeout", "0", "task.py"], "--timeout 0"),
    (["run", "--timeout", "1e9", "task.py"], "at most 86400"),
    (["run", "-n", "-1", "task.py"], "--workers -1"),
    (["run", "-n", "100000", "task.py"], "ulimit -n"),
    (["run", "--ps", "-2", "task.py"], "--ps -2"),
    (["run", "--ps", "100000", "--strategy", "ps-sync", "task.py"], "ulimit -n"),
    (["run", "--max-restarts", "-1", "task.py"], "--max-restarts -1"),
    (["run", "--restart-delay", "-1", "task.py"], "--restart-delay -1"),
])
def test_impossible_numbers_are_refused_at_the_command_line(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    write_script(tmp_path, "print('never')\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "output").exists()


def test_the_open_file_limit_message_says_how_many_tasks_fit_and_how_to_raise_it(tmp_path, capsys, monkeypatch):
    import resource

    monkeypatch.chdir(tmp_path)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert main(["run", "-n", "100000", "task.py"]) == 2
    err = capsys.readouterr().err
    assert f"open-file limit ({soft})" in err and "ulimit -n" in err


@pytest.mark.parametrize("env", [{}, {"CONVEYOR_JOB_SECRET": ""}])
def test_a_job_on_several_machines_refuses_to_start_without_a_secret(tmp_path, capsys, monkeypatch, env):
    monkeypatch.chdir(tmp_path)
    write_script(tmp_path, "print('never')\n")
    monkeypatch.delenv("CONVEYOR_JOB_SECRET", raising=False)
    monkeypatch.delenv("CONVEYOR_JOB_SECRET_FILE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--nnodes", "2", "--node-rank", "0", "--rdzv", "127.0.0.1:1", "task.py"]) == 2
    err = capsys.readouterr().err
    assert "--job-secret-file" in err and "CONVEYOR_JOB_SECRET" in err and "chmod 600" in err
    assert "same" in err  # every node gets the same secret


def test_a_secret_file_readable_by_others_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(SECRET_HEX)
    secret.chmod(0o644)
    assert main(["run", "--dry-run", "--job-secret-file", "secret", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--job-secret-file secret is readable by other users (mode 0644)" in err and "chmod 600 secret" in err
    assert SECRET_HEX[:12] not in err


def test_the_omp_default_is_said_in_one_short_line(tmp_path):
    from conveyor.cli.run import omp_note
    from conveyor.cluster.variables import OMP_DEFAULT_VAR
    from conveyor.launch.plan import RunOptions, local_plan

    opts = RunOptions(script="train.py", data_dir=str(tmp_path), output_dir=str(tmp_path), workers=2, ps=1,
                      strategy="ps-async")
    plan = local_plan(opts, [1, 2, 3], master_port=4, secret=b"s" * 32, environ={})
    assert all(t.env.get(OMP_DEFAULT_VAR) == "1" for t in plan.tasks)
    note = omp_note(plan)
    assert note.startswith("[conveyor] OMP_NUM_THREADS=1 for the 3 tasks here") and len(note) <= 100
    plan = local_plan(opts, [1, 2, 3], master_port=4, secret=b"s" * 32, environ={"OMP_NUM_THREADS": "4"})
    assert omp_note(plan) is None  # the user chose: nothing to say


def test_a_secret_file_another_user_owns_is_refused_even_with_mode_600(tmp_path, capsys, monkeypatch):
    """In a folder others can write, another user can create the file first and keep it open: owning it, they
    read whatever secret is written into it later, whatever its mode says now."""
    monkeypatch.chdir(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(SECRET_HEX)
    secret.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(secret, 65534, -1)  # nobody
    else:  # an unprivileged user cannot give a file away: pretend to be someone else instead
        monkeypatch.setattr(os, "geteuid", lambda: secret.stat().st_uid + 1)
    assert main(["run", "--dry-run", "--job-secret-file", "secret", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--job-secret-file secret belongs to another user" in err and "write a fresh one" in err
    assert SECRET_HEX[:12] not in err


def test_the_secret_can_come_from_the_environment_and_never_appears_in_argv(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONVEYOR_JOB_SECRET", SECRET_HEX)
    assert main(["run", "--dry-run", "-n", "1", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "CONVEYOR_JOB_SECRET=<masked: 66 hex digits>" in out and SECRET_HEX[:12] not in out
    secret_file = tmp_path / "s"
    secret_file.write_text(SECRET_HEX)
    secret_file.chmod(0o600)
    monkeypatch.delenv("CONVEYOR_JOB_SECRET")
    monkeypatch.setenv("CONVEYOR_JOB_SECRET_FILE", str(secret_file))
    assert main(["run", "--dry-run", "-n", "1", "train.py"]) == 0
    assert "CONVEYOR_JOB_SECRET=<masked: 66 hex digits>" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_a_single_machine_job_listens_on_nothing_but_its_tasks(tmp_path):
    # No rendezvous store on one machine: the launcher itself listens on no port at all.
    write_script(tmp_path, """
        import psutil
        launcher = psutil.Process(os.getppid())
        print("LISTEN", sorted(c.laddr for c in launcher.net_connections("inet") if c.status == "LISTEN"))
    """)
    code, out, err = finish(launcher(tmp_path, "-n", "1", "task.py"), tmp_path)
    assert code == 0, err
    assert "[worker:0] LISTEN []" in out


@pytest.mark.multiprocess
def test_logs_follow_the_umask(tmp_path):
    write_script(tmp_path, "print('hello')\n")
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        out_dir = tmp_path / f"out-{umask:o}"
        previous = os.umask(umask)  # inherited by the launcher started below
        try:
            proc = launcher(tmp_path, "--output-dir", str(out_dir), "task.py")
        finally:
            os.umask(previous)
        code, _, err = finish(proc, tmp_path)
        assert code == 0, err
        assert (out_dir / "logs" / "worker-0.log").stat().st_mode & 0o777 == mode


@pytest.mark.multiprocess
def test_a_second_job_on_the_same_output_dir_is_refused_until_the_first_is_killed(tmp_path):
    """Issue 22, defect 4: the output folder's lock, held by the launcher, refused at once, freed by a kill -9."""
    shared = tmp_path / "out"
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    for folder in (first_dir, second_dir):
        folder.mkdir()
        write_script(folder, """
            with open(os.path.join(os.environ["MARK_DIR"], "pids"), "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(float(sys.argv[1]))
        """)
    first = launcher(first_dir, "-n", "1", "--output-dir", str(shared), "task.py", "60")
    try:
        wait_for_lines(first_dir / "pids", 1)
        started = time.monotonic()
        code, _, err = finish(launcher(second_dir, "-n", "1", "--output-dir", str(shared), "task.py", "0"),
                              second_dir)
        assert code == 1 and time.monotonic() - started < 20, err
        assert f"output folder {shared} is in use by another job: pid {first.pid} on host " in err
        assert "another --output-dir" in err and not (second_dir / "pids").exists()  # nothing of it started
        first.kill()  # kill -9: no handler runs, the kernel releases the lock
        first.wait(timeout=10)
        code, _, err = finish(launcher(second_dir, "-n", "1", "--output-dir", str(shared), "task.py", "0"),
                              second_dir)
        assert code == 0, err
        assert wait_for_lines(second_dir / "pids", 1)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
