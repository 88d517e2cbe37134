"""Fixtures of the data-service tests: TFRecord files of numbered records, a secret, and role processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.data import TFRecordWriter
from conveyor.data.service import Service

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the workers' pipeline module and the helpers, for the tests here

from svc_pipelines import FILES, PER_FILE, free_port  # noqa: E402


@pytest.fixture
def record_dir(tmp_path: Path) -> Path:
    """FILES TFRecord files of PER_FILE records ``id-<n>``, ids 0 .. FILES*PER_FILE-1."""
    data = tmp_path / "data"
    data.mkdir()
    for f in range(FILES):
        with TFRecordWriter(str(data / f"part-{f}.tfrecord")) as w:
            for r in range(PER_FILE):
                w.write(f"id-{f * PER_FILE + r}".encode())
    return data


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.secret"
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


class Roles:
    """Starts `conveyor data serve` / `worker` processes; kills every one at the end of the test."""

    def __init__(self, tmp_path: Path, record_dir: Path, secret_file: Path) -> None:
        self.tmp, self.secret_file = tmp_path, secret_file
        self.env = {**os.environ, "SVC_TEST_DIR": str(record_dir),
                    "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        self.dispatcher = f"127.0.0.1:{free_port()}"

    @property
    def service(self) -> Service:
        return Service(self.dispatcher, bytes.fromhex(self.secret_file.read_text()))

    def _start(self, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"role-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "conveyor", "data", *args, "--secret-file",
                                     str(self.secret_file)], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append((proc, log))
        return proc, log

    def serve(self, *extra: str) -> None:
        port = self.dispatcher.rsplit(":", 1)[1]
        self.wait_for(*self._start(["serve", "--host", "127.0.0.1", "--port", port, *extra]), "listening")

    def log_of(self, index: int) -> str:
        return self.procs[index][1].read_text()

    def worker(self, pipeline: str = "svc_pipelines:records", *extra: str, ready: bool = True):
        proc, log = self._start(["worker", "--dispatcher", self.dispatcher, "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--pipeline", pipeline, *extra])
        if ready:
            self.wait_for(proc, log, "serving on")
        return proc, log

    @staticmethod
    def wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"role did not say {text!r} (exit {proc.poll()}): {log.read_text()}")
            time.sleep(0.05)

    def close(self) -> None:
        for proc, _ in self.procs:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def roles(tmp_path: Path, record_dir: Path, secret_file: Path):
    made = Roles(tmp_path, record_dir, secret_file)
    yield made
    made.close()
