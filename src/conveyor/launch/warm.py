"""Warm task starts: each task forked from a template process that has torch imported, instead of a new interpreter.

    warm.configure(True, python=sys.executable, environ=task_like_env)   # `conveyor run`: started at once
    proc = warm.spawn(argv, env, cpus, say)     # a WarmProcess (pid, stdout, poll, wait), or None: use Popen

:func:`spawn` forks ``PYTHON SCRIPT ARGS`` / ``PYTHON -m MODULE ARGS`` from this launcher's template
(:mod:`conveyor.launch.template`) when it can; it returns None - the caller starts the task with Popen as
always - where it cannot: warm starts are off, ``argv`` is another interpreter or has interpreter flags,
the task's environment differs from the template's in a variable read only at an interpreter's or a
library's start (:func:`load_time_difference`), the template is still importing and the script does not
import torch or conveyor itself (a new interpreter is ready sooner), or the template failed or died (said
once). The process it returns is the task's own (its pid leads its process group); its exit status comes
from the template, which reaps it, and is -SIGKILL for every task still running when the template dies (its
tasks die with it). ``CONVEYOR_WARM_START=1`` turns warm starts on where :func:`configure` was not called (the tests'
supervisors). Why and the limits: ``docs/launcher.md``, "Warm starts".
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from conveyor.cluster.variables import WARM_START_VAR
from conveyor.launch.template import MAX_MESSAGE, path_prefix

__all__ = ["Template", "WarmProcess", "configure", "imports_torch", "load_time_difference", "shutdown", "spawn"]

READY_TIMEOUT = 120.0  # the template's imports under load; a task's start waits for them at most this long
REPLY_TIMEOUT = 30.0
#: Variables read when an interpreter or a library loads (so a fork of the template cannot take a new value):
#: Python's own, the dynamic loader's and allocator's, OpenMP's and MKL's, and torch's read at import (its C++
#: logging, TORCH_LOGS, dynamo's and inductor's configuration); torch's others (TORCH_NCCL_*, ...) are read
#: when used. OMP_NUM_THREADS is applied in the child (torch.set_num_threads); a PYTHONPATH that adds folders
#: before the template's is applied too.
LOAD_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_CPP_",
                      "TORCH_SHOW_CPP", "TORCH_LOGS", "TORCH_COMPILE", "TORCHDYNAMO_", "TORCHINDUCTOR_")


def load_time_difference(template_env: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """The first variable read only at start-up whose value in ``env`` differs from the template's, as
    ``NAME (value vs template's value)``; None when a fork of the template is the same as a new process."""
    for name in sorted(set(template_env) | set(env)):
        if not name.startswith(LOAD_TIME_PREFIXES):
            continue
        if name == "OMP_NUM_THREADS" and env.get(name, "").isdigit() and int(env[name]) > 0:
            continue
        if name == "PYTHONPATH" and path_prefix(template_env.get(name, ""), env.get(name, "")) is not None:
            continue
        if template_env.get(name) != env.get(name):
            return f"{name} ({env.get(name, 'unset')} for the task, {template_env.get(name, 'unset')} in the template)"
    return None


class WarmProcess:
    """A task forked by the template, as much of ``subprocess.Popen`` as the launcher uses: ``pid``,
    ``stdout`` (its merged output), ``returncode``, ``poll()``, ``wait(timeout)``."""

    def __init__(self, template: Template, pid: int, stdout) -> None:
        self.template = template
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self.args = ()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.template.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.template.changed(0.5 if left is None else min(left, 0.5))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Template:
    """This launcher's template process and the thread that started it and reads its messages.

    The thread starts the template (so that PR_SET_PDEATHSIG ties the template to a thread that lives as long
    as the launcher's process, not to whichever thread asked first) and records the exit statuses it sends.
    """

    def __init__(self, python: str, environ: Mapping[str, str]) -> None:
        self.python = python
        self.environ = dict(environ)
        self.failure: str | None = None  # why it cannot start tasks (set once; then every start falls back)
        self.ready = threading.Event()
        self._cond = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()  # the pids it started whose exit it has not reported
        self._next_id = 0
        self._send_lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
        self._thread = threading.Thread(target=self._main, args=(theirs,), name="conveyor-warm-template",
                                         daemon=True)
        self._thread.start()

    def _main(self, theirs: socket.socket) -> None:
        from conveyor.launch.tasks import _child_setup

        try:
            self.proc = subprocess.Popen(
                [self.python, "-c", "from conveyor.launch.template import main; main()", str(theirs.fileno())],
                env=self.environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a Ctrl-C at the terminal is the launcher's to handle, not the template's
                preexec_fn=_child_setup(os.getpid()))
        except OSError as e:
            self._fail(f"the template could not start ({e})")
            return
        finally:
            theirs.close()
        self._read()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                try:
                    code = self.proc.wait(timeout=10.0) if self.proc is not None else None
                except subprocess.TimeoutExpired:
                    code = "unknown: still running"
                self._fail(f"the template process exited (status {code})")
                self.sock.close()
                return
            message = json.loads(data)
            with self._cond:
                if "exit" in message:
                    self._exits[message["exit"]] = message["status"]
                    self._live.discard(message["exit"])
                elif "id" in message:
                    self._replies[message["id"]] = message
                elif "error" in message:
                    self.failure = message["error"]
                self._cond.notify_all()
            if "ready" in message or "error" in message:
                self.ready.set()

    def _fail(self, why: str) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = why
            self._cond.notify_all()
        self.ready.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread's recv; close alone would not
        except OSError:
            pass  # the template is gone already

    def status(self, pid: int) -> int | None:
        """``pid``'s exit status, None while it runs. Once the template is gone its tasks die with it
        (PR_SET_PDEATHSIG): -SIGKILL as soon as the process is gone."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self.failure is None or not self.ready.is_set():
                return None
        return None if _running(pid) else -signal.SIGKILL

    def changed(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for any message."""
        with self._cond:
            self._cond.wait(timeout)

    def start(self, argv: Sequence[str], env: Mapping[str, str], cpus: Sequence[int]) -> WarmProcess:
        """Fork one task; OSError when the template cannot (then ``failure`` says why where it is for good)."""
        if not self.ready.wait(READY_TIMEOUT):  # a loaded machine: this task starts anew, later ones may not
            raise OSError(f"the template had not finished its imports after {READY_TIMEOUT:g} s")
        if self.failure is not None:
            raise OSError(self.failure)
        out_r, out_w = os.pipe()
        try:
            with self._cond:
                self._next_id += 1
                ident = self._next_id
            request = json.dumps({"id": ident, "argv": list(argv), "env": dict(env), "cpus": list(cpus),
                                  "cwd": os.getcwd()}).encode()
            with self._send_lock:
                socket.send_fds(self.sock, [request], [out_w])
        except OSError as e:
            os.close(out_r)
            self._fail(f"cannot reach the template ({e})")
            raise OSError(self.failure) from None
        finally:
            os.close(out_w)
        reply = self._reply(ident)
        if reply is None or "pid" not in reply:
            os.close(out_r)
            raise OSError(self.failure or (reply or {}).get("error", "no reply"))
        with self._cond:
            self._live.add(reply["pid"])
        return WarmProcess(self, reply["pid"], open(out_r, "rb"))

    def _reply(self, ident: int) -> dict | None:
        deadline = time.monotonic() + REPLY_TIMEOUT
        with self._cond:
            while ident not in self._replies and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._replies.pop(ident, None)

    def close(self) -> None:
        """End the template (its tasks, if any still run, die with it) and wait for it."""
        importing = not self.ready.is_set()
        self._fail("the template was closed")
        if importing and self.proc is not None:
            self.proc.kill()  # it reads the socket only once its imports are done
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5.0)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


_template: Template | None = None
_configured: bool | None = None  # None: not configured, CONVEYOR_WARM_START decides
_said: set[str] = set()
_lock = threading.Lock()


def configure(enabled: bool, python: str = sys.executable, environ: Mapping[str, str] | None = None) -> None:
    """Turn warm starts on or off for this process; on: start the template now, importing in parallel with
    whatever the launcher does next, with ``environ`` (what the tasks will inherit) as its environment."""
    global _configured, _template
    with _lock:
        _configured = enabled
        if enabled and _template is None:
            _template = Template(python, os.environ if environ is None else environ)
            atexit.unregister(shutdown)
            atexit.register(shutdown)  # waited for: its CPU (its tasks' too) is then counted as the launcher's


def shutdown() -> None:
    """End the template, if one was started, and forget :func:`configure`'s choice and the lines said."""
    global _template, _configured
    with _lock:
        template, _template, _configured = _template, None, None
        _said.clear()
    if template is not None:
        template.close()


def _current(env: Mapping[str, str]) -> Template | None:
    global _template
    with _lock:
        enabled = _configured if _configured is not None else os.environ.get(WARM_START_VAR) == "1"
        if enabled and _template is None:  # started by the first task: with its start-up variables
            loaded = {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}
            _template = Template(sys.executable, {**os.environ, **loaded})
            atexit.unregister(shutdown)
            atexit.register(shutdown)
        return _template if enabled else None


_TORCH_IMPORT = re.compile(rb"^[ \t]*(?:import|from)[ \t]+(?:torch|conveyor)\b", re.MULTILINE)


def imports_torch(argv: Sequence[str]) -> bool:
    """Whether the task's script imports torch or conveyor itself (read, not run); a module (-m) is assumed to."""
    if argv[1] == "-m":
        return True
    try:
        with open(argv[1], "rb") as f:
            return _TORCH_IMPORT.search(f.read(1 << 20)) is not None
    except OSError:
        return False


def _say_once(say: Callable[[str], None], message: str) -> None:
    if message not in _said:
        _said.add(message)
        say(message)


def spawn(argv: Sequence[str], env: Mapping[str, str], cpus: Sequence[int],
          say: Callable[[str], None]) -> WarmProcess | None:
    """``argv`` forked from the template, or None: start it with Popen (why, where it is worth a line: once)."""
    template = _current(env)
    if template is None or len(argv) < 2 or os.path.abspath(argv[0]) != os.path.abspath(template.python):
        return None
    if argv[1].startswith("-") and (argv[1] != "-m" or len(argv) < 3):
        return None  # interpreter flags (-u, -X ...) take effect at its start only
    if not set(cpus) <= os.sched_getaffinity(0):
        return None  # Popen's binding fails, naming the way out
    if not template.ready.is_set() and not imports_torch(argv):
        return None  # a new interpreter is ready sooner than the template's imports, which it would not use
    different = load_time_difference(template.environ, env)
    if different is not None:
        _say_once(say, f"warm start not used for {' '.join(argv[1:3])}: {different} is read at start-up only; "
                       f"started with a new interpreter")
        return None
    try:
        return template.start(argv, env, cpus)
    except OSError as e:
        _say_once(say, f"warm start not used: {e}; started with a new interpreter")
        return None
