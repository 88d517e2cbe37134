"""The warm-start template process (``docs/launcher.md``, "Warm starts"): torch imported once, a task forked per start.

    python -c 'from conveyor.launch.template import main; main()' FD   # what conveyor.launch.warm starts

The template imports :data:`PRELOAD`, freezes its heap (``gc.freeze``) and serves, single-threaded, the
requests of its launcher on the SOCK_SEQPACKET socket ``FD``: JSON ``{"id", "argv", "env", "cpus", "cwd"}``
with the write end of the task's output pipe as the one file descriptor attached. For each it forks a child
and answers ``{"id", "pid"}`` (or ``{"id", "error"}``); when a child exits it sends ``{"exit": pid,
"status": <exit code as Popen's returncode>}``. It first sends ``{"ready": ...}`` and exits when the socket
closes; it dies with its launcher (PR_SET_PDEATHSIG), and its children die with it.

A child leads a new session, dies with the template, is bound to the task's CPUs, has exactly the task's
environment (torch's thread count taken from it), its stdout and stderr on the pipe, fresh ``random`` and
numpy seeds, and runs ``argv`` (``PYTHON SCRIPT ARGS`` or ``PYTHON -m MODULE ARGS``) as ``python`` would: the
script as ``__main__`` with its folder first on sys.path; an uncaught exception is printed by
``sys.excepthook`` and exits 1, ``sys.exit(n)`` exits n, and the interpreter's exit (threads, exit handlers,
finalization) is the usual one. Must never initialise CUDA: forking after that is broken.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys
import time

#: What the template imports before serving: what every training task imports anyway (torch imports dynamo
#: on an optimizer's first step and in DDP's constructor), and conveyor's training modules.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.utils.data", "conveyor.train", "conveyor.strategies",
           "conveyor.launch.tasks")
MAX_MESSAGE = 4 << 20  # the largest request (a task's environment); the launcher sends nothing larger


def main() -> None:
    """The template's entry point: preload, serve; in a forked child, run the task and exit with its status."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    started = time.process_time()
    import torch

    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - what is not preloaded is imported by the task that needs it, as before
            pass

    if torch.cuda.is_initialized():  # an import above must never do this: forked children could not use CUDA
        _send(sock, {"error": "CUDA was initialised while preloading; warm starts need a template without it"})
        return
    gc.collect()
    gc.freeze()  # the children do not copy the template's heap when their collector walks it
    _send(sock, {"ready": True, "pid": os.getpid(), "preload_cpu_s": round(time.process_time() - started, 3),
                 "threads": len(os.listdir("/proc/self/task"))})
    job = _serve(sock)
    if job is None:
        os._exit(0)  # nothing to flush; the interpreter's finalization of torch would cost a CPU-second
    sys.exit(_run(job))


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _serve(sock: socket.socket) -> dict | None:
    """Answer requests until the launcher closes the socket (None); in a forked child, its job."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        ready = sel.select(timeout=1.0)  # the timeout: a lost wakeup costs a second, not a task's exit status
        _drain(wake_r)
        _reap(sock)
        if not any(key.fileobj is sock for key, _ in ready):
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)  # readable: a message, or the end
        if not data:
            return None  # the launcher closed its end: it is done (or gone)
        job = json.loads(data)
        pid = os.fork()
        if pid == 0:
            sel.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w, sock.detach()):
                os.close(fd)
            job["out_fd"] = fds[0]
            return job
        for fd in fds:
            os.close(fd)
        _send(sock, {"id": job["id"], "pid": pid})


def _drain(fd: int) -> None:
    """Empty the wakeup pipe (only that a signal came matters)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(sock: socket.socket) -> None:
    """Tell the launcher the exit status of every child that has exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _run(job: dict) -> int:
    """In the forked child: become the task, run its script; the status it exits with."""
    from conveyor.launch.tasks import _child_setup

    os.setsid()
    setup = _child_setup(os.getppid(), tuple(job["cpus"]))  # what a Popen'd task does between fork and exec
    if setup is not None:
        setup()
    out = job["out_fd"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    before = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    first = 0 if sys.flags.safe_path else 1  # after the script's folder, as the interpreter puts PYTHONPATH
    sys.path[first:first] = [os.path.abspath(p) for p in path_prefix(before, job["env"].get("PYTHONPATH", ""))]
    _fresh_state(job["env"], job["cpus"])
    sys.orig_argv = list(job["argv"])
    return _run_main(job["argv"][1:])


def path_prefix(template: str, task: str) -> list[str] | None:
    """The folders ``task``'s PYTHONPATH puts before ``template``'s, which it ends with; None when it does not."""
    if task == template:
        return []
    if not template:
        return task.split(os.pathsep)
    if task.endswith(os.pathsep + template):
        return task[:-len(template) - 1].split(os.pathsep)
    return None


def _fresh_state(env: dict, cpus: list[int]) -> None:
    """What a new interpreter would have that the fork copied from the template: random seeds, torch's
    thread count (OpenMP reads OMP_NUM_THREADS, and the CPUs it may use, when it is loaded)."""
    import random

    import torch

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    elif cpus:
        torch.set_num_threads(len(cpus))


def _run_main(args: list[str]) -> int:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__`` in a new ``__main__`` module, as ``python`` does;
    the exit status (an uncaught exception: printed by sys.excepthook, 1)."""
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = sys.modules["builtins"]
    sys.modules["__main__"] = main
    try:
        if args[0] == "-m":
            import runpy

            sys.argv = ["-m", *args[2:]]  # runpy puts the module's file in argv[0], as `python -m` does
            if not sys.flags.safe_path:
                sys.path[0] = os.getcwd()
            runpy._run_module_as_main(args[1], alter_argv=True)
        else:
            _run_script(main, args[0], args[1:])
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException as e:
        _uncaught(e)
        return 1
    return 0


def _run_script(main, script: str, args: list[str]) -> None:
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(script)  # __file__ is absolute since Python 3.9
    sys.argv = [script, *args]
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    main.__dict__.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path),
                         __spec__=None, __package__=None, __doc__=None)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _exit_code(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``: None 0, an int itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _uncaught(e: BaseException) -> None:
    """Report ``e`` as the interpreter reports an uncaught exception: sys.last_* set, then sys.excepthook, with
    the template's own frames left out of the traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    e = e.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
    sys.excepthook(type(e), e, tb)
