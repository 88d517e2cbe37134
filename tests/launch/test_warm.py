"""Warm task starts (conveyor.launch.warm): tasks forked from a template with torch imported behave as new processes.

Real processes: each test's tasks are forked by a template of its own (the ``template`` fixture), run through
``RunningTask`` or the supervisor, and compared with what a plain ``python`` run of the same script gives.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.cluster.spec import TaskId
from conveyor.launch import RunOptions, Supervisor, free_ports, local_plan, warm
from conveyor.launch.plan import TaskLaunch
from conveyor.launch.tasks import Console, RunningTask
from conveyor.launch.template import path_prefix

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]  # the template's imports, under load

WAIT = 300.0  # a task's whole life, the template's imports included, on a loaded machine


@pytest.fixture(scope="module")
def template():
    """A template of this module's own (its imports take a minute on a loaded machine: paid once), started with
    the tests' environment plus a variable the tasks do not get; ended afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONUNBUFFERED", "1")
        patch.setenv("WARM_TEST_LAUNCHER_ONLY", "1")  # in the template's environment, not in the tasks'
        warm.shutdown()
        warm.configure(True)
        shared = warm._template
        assert shared.ready.wait(WAIT)  # else a script without torch would start a new interpreter
        yield shared
        warm.shutdown()


def write(tmp_path: Path, body: str, name: str = "task.py") -> Path:
    script = tmp_path / name
    script.write_text(textwrap.dedent(body))
    return script


def task_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WARM_TEST_LAUNCHER_ONLY"}
    return {**env, **more}


def start(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None, cpus: tuple[int, ...] = (),
          index: int = 0):
    err = io.StringIO()
    launch = TaskLaunch(task=TaskId("worker", index), argv=(sys.executable, *argv), env=env or task_env(),
                        log_path=str(tmp_path / f"worker-{index}.log"), cpus=cpus)
    out = io.StringIO()
    task = RunningTask.start(launch, 0, Console(out, err))
    return task, out, err


def finish(task: RunningTask) -> int | None:
    task.proc.wait(WAIT)
    task.pump.join(10)
    return task.poll()


def test_exit_statuses_and_output(template, tmp_path):
    cases = {"print('fine')": 0, "import sys; print('three'); sys.exit(3)": 3,
             "def f():\n    raise ValueError('boom')\nf()": 1, "import sys; sys.exit('a message')": 1}
    for i, (body, code) in enumerate(cases.items()):
        task, out, _ = start(tmp_path, [str(write(tmp_path, body, f"s{i}.py"))], index=i)
        assert isinstance(task.proc, warm.WarmProcess)
        assert finish(task) == code, out.getvalue()
    lines = (tmp_path / "worker-2.log").read_text().splitlines()
    assert lines[1:] == ["Traceback (most recent call last):", f'  File "{tmp_path / "s2.py"}", line 3, in <module>',
                         "    f()", f'  File "{tmp_path / "s2.py"}", line 2, in f',
                         "    raise ValueError('boom')", "ValueError: boom"]
    assert "[worker:0] fine" in (tmp_path / "worker-0.log").read_text() + "[worker:0] fine"
    assert (tmp_path / "worker-3.log").read_text().splitlines()[1:] == ["a message"]


def test_killed_from_outside(template, tmp_path):
    task, _, _ = start(tmp_path, [str(write(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(300)"))])
    deadline = time.monotonic() + WAIT
    while not task.tail and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(task.proc.pid, signal.SIGKILL)
    assert finish(task) == -signal.SIGKILL
    assert not task.group_alive()


PROBE = """
import json, os, sys
import helper  # a module beside the script
out = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "helper": helper.VALUE,
       "spec": __spec__ and [__spec__.name, __spec__.origin], "package": __package__,
       "cwd": os.getcwd(), "pythonpath": sys.path[1:3]}
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump(out, f)
"""


def test_the_script_sees_what_python_gives_it(template, tmp_path):
    script = write(tmp_path, PROBE)
    write(tmp_path, "VALUE = 42\n", "helper.py")
    extra = tmp_path / "extra"
    env = task_env(PYTHONPATH=os.pathsep.join(p for p in (str(extra), os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, str(script), "x"], env={**env, "PROBE_OUT": str(tmp_path / "plain.json")},
                   check=True, timeout=WAIT)
    task, out, _ = start(tmp_path, [str(script), "x"], env={**env, "PROBE_OUT": str(tmp_path / "warm.json")})
    assert isinstance(task.proc, warm.WarmProcess)
    assert finish(task) == 0, out.getvalue()
    plain, warmed = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("plain", "warm"))
    assert warmed == plain
    assert warmed["name"] == "__main__" and warmed["helper"] == 42 and warmed["pythonpath"][0] == str(extra)


def test_a_module_runs_as_python_m_runs_it(template, tmp_path, monkeypatch):
    write(tmp_path, PROBE, "probe_mod.py")
    write(tmp_path, "VALUE = 7\n", "helper.py")
    monkeypatch.chdir(tmp_path)
    env = task_env()
    subprocess.run([sys.executable, "-m", "probe_mod", "y"], env={**env, "PROBE_OUT": str(tmp_path / "plain.json")},
                   check=True, timeout=WAIT)
    task, out, _ = start(tmp_path, ["-m", "probe_mod", "y"], env={**env, "PROBE_OUT": str(tmp_path / "warm.json")})
    assert isinstance(task.proc, warm.WarmProcess)
    assert finish(task) == 0, out.getvalue()
    plain, warmed = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("plain", "warm"))
    assert warmed == plain


def test_environment_binding_and_threads(template, tmp_path):
    script = write(tmp_path, """
        import json, os, random, sys
        import torch
        out = {"env": dict(os.environ), "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
               "random": random.random(), "cuda": torch.cuda.is_initialized(), "ppid": os.getppid(),
               "group": os.getpgid(0) == os.getpid() == os.getsid(0)}
        json.dump(out, open(sys.argv[1], "w"))
    """)
    for i, (threads, cpus) in enumerate([("1", ()), ("2", ()), (None, (0,))]):
        env = task_env() if threads is None else task_env(OMP_NUM_THREADS=threads)
        env.pop("OMP_NUM_THREADS", None) if threads is None else None
        task, out, _ = start(tmp_path, [str(script), str(tmp_path / f"{i}.json")], env=env, cpus=cpus, index=i)
        assert finish(task) == 0, out.getvalue()
        seen = json.loads((tmp_path / f"{i}.json").read_text())
        expected_env = {**env, "CONVEYOR_RESTART_COUNT": "0"}
        assert seen["env"] == expected_env and "WARM_TEST_LAUNCHER_ONLY" not in seen["env"]
        assert seen["threads"] == (int(threads) if threads else 1)
        assert seen["cpus"] == (list(cpus) or sorted(os.sched_getaffinity(0)))
        assert seen["ppid"] == template.proc.pid and seen["group"] and not seen["cuda"]
    randoms = {json.loads((tmp_path / f"{i}.json").read_text())["random"] for i in range(3)}
    assert len(randoms) == 3  # each task seeds its own generators


def test_workers_inside_a_warm_task(template, tmp_path):
    script = write(tmp_path, """
        import multiprocessing
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        def square(x):
            return x * x

        if __name__ == "__main__":
            loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=8, num_workers=2)
            total = sum(float(b[0].sum()) for b in loader)
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                squares = sum(pool.map(square, range(10)))
            print(f"total={total:g} squares={squares}")
    """)
    task, out, _ = start(tmp_path, [str(script)])
    assert isinstance(task.proc, warm.WarmProcess)
    assert finish(task) == 0, out.getvalue()
    assert "[worker:0] total=2016 squares=285" in out.getvalue()


def make_plan(tmp_path: Path, body: str, workers: int = 1, **env: str):
    script = write(tmp_path, "import os, sys, time\n" + textwrap.dedent(body))
    options = RunOptions(script=str(script), workers=workers, data_dir=str(tmp_path / "data"),
                         output_dir=str(tmp_path / "output"), python=sys.executable)
    ports = free_ports(workers + 1)
    return local_plan(options, ports[:-1], master_port=ports[-1], secret=b"s" * 32, environ={**task_env(), **env})


def supervise(plan):
    out, err = io.StringIO(), io.StringIO()
    result = Supervisor(plan, out=out, err=err, restart_delay=0.01, max_restarts=2).run()
    return result, out.getvalue(), err.getvalue()


def test_a_restart_after_a_failure_is_forked_again(template, tmp_path):
    plan = make_plan(tmp_path, """
        print(f"attempt {os.environ['CONVEYOR_RESTART_COUNT']} parent {os.getppid()}")
        sys.exit(1 if os.environ["CONVEYOR_RESTART_COUNT"] == "0" else 0)
    """)
    result, out, err = supervise(plan)
    assert result.ok and result.restarts == 1, err
    assert f"[worker:0] attempt 0 parent {template.proc.pid}" in out, err
    assert f"[worker:0] attempt 1 parent {template.proc.pid}" in out


def test_an_abort_after_the_script_ended_counts_as_finished(template, tmp_path):
    plan = make_plan(tmp_path, """
        import atexit
        from conveyor.cluster.failure_report import install_finish
        atexit.register(os.abort)  # runs after install_finish's record (exit handlers run last first)
        install_finish(os.environ)
        print("done", os.getppid())
    """)
    result, out, err = supervise(plan)
    assert result.ok and result.restarts == 0, err
    assert f"done {template.proc.pid}" in out and "counted as finished" in err


def test_a_dead_template_falls_back_to_new_processes(template, tmp_path, monkeypatch):
    doomed = warm.Template(template.python, template.environ)  # the module's own stays for the other tests
    monkeypatch.setattr(warm, "_template", doomed)
    monkeypatch.setattr(warm, "_said", set())
    assert doomed.ready.wait(WAIT)
    doomed.proc.kill()
    doomed.proc.wait(WAIT)
    plan = make_plan(tmp_path, 'print(f"parent {os.getppid()}")\n', workers=2)
    result, out, err = supervise(plan)
    assert result.ok, err
    assert out.count(f"parent {os.getpid()}") == 2
    said = "warm start not used: the template process exited (status -9); started with a new interpreter"
    assert err.count(said) == 1


def test_a_start_up_variable_that_differs_is_a_new_process(template, tmp_path):
    plan = make_plan(tmp_path, 'print(f"parent {os.getppid()}")\n', PYTHONHASHSEED="7")
    result, out, err = supervise(plan)
    assert result.ok and f"parent {os.getpid()}" in out
    assert "PYTHONHASHSEED (7 for the task, unset in the template) is read at start-up only" in err


def test_which_differences_need_a_new_process():
    base = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "4"}
    assert warm.load_time_difference(base, {**base, "RANK": "3", "OMP_NUM_THREADS": "1"}) is None
    assert warm.load_time_difference(base, {**base, "PYTHONPATH": "/a"}) is None
    assert "OMP_NUM_THREADS" in warm.load_time_difference(base, {"PATH": "/bin", "PYTHONUNBUFFERED": "1"})
    assert "LD_PRELOAD" in warm.load_time_difference(base, {**base, "LD_PRELOAD": "x.so"})
    assert "PYTHONUNBUFFERED" in warm.load_time_difference(base, {"OMP_NUM_THREADS": "4"})
    assert path_prefix("/b", "/a:/b") == ["/a"] and path_prefix("", "/a") == ["/a"] and path_prefix("/b", "/a") is None


def test_conveyor_run_flag(tmp_path):
    write(tmp_path, "import os\nimport torch\nprint(f'parent {os.getppid()}')\n")
    for flag in ("--warm-start", "--no-warm-start"):
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", flag, "--output-dir",
                                 str(tmp_path / flag), str(tmp_path / "task.py")], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "CONVEYOR_WARM_START": "1"})
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        parents = [line.rsplit(" ", 1)[1] for line in out.splitlines() if " parent " in line]
        assert len(parents) == 2 and len(set(parents)) == 1, out
        assert (parents[0] == str(proc.pid)) == (flag == "--no-warm-start"), out
