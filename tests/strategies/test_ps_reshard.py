"""Resuming a parameter-server checkpoint on another number of ps tasks: the shards are re-split by placement.

A ps-sync job of one worker and P=2 ps tasks (servers in threads, real sockets) trains k steps with Adam
and saves through its checkpoint items; jobs with Q=1, 2, 3 ps tasks restore that step. Pieces are kept
small (256 bytes) so the first layer's weight is cut in different places for each Q: the restored
servers must hold bit for bit the saved parameters and optimizer state, and the next steps must give
the same losses as the job resumed on P=2. End to end, `conveyor run` resumes the digits demo written
by 2 workers and 2 ps tasks on 3 ps tasks, to the model the uninterrupted run on 2 ends with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conveyor.launch.ports import free_ports
from conveyor.strategies import PSStrategy
from conveyor.strategies.ps import place
from conveyor.strategies.ps.client import PSClient
from conveyor.strategies.ps.reshard import ReshardError, reshard
from conveyor.strategies.ps.server import ParameterServer
from conveyor.strategies.ps.task import shard_stores
from conveyor.train.checkpoint import CheckpointManager, ResumeError, StepWrite, commit
from conveyor.train.resume import restore

SECRET = b"ps-reshard-secret"
CHUNK = 256  # bytes: "0.weight" (128 floats) is cut into pieces, differently for 1, 2 and 3 servers
SAVED_AT, MORE = 3, 3


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


class Job:
    """One worker's job against `num_ps` ps-sync servers run in this process."""

    def __init__(self, num_ps: int, out: Path, seed: int) -> None:
        ports = free_ports(num_ps)
        stores = shard_stores(out, CheckpointManager)
        self.servers = [ParameterServer(f"127.0.0.1:{port}", SECRET, index=i, num_workers=1, mode="sync",
                                        shards=stores).start() for i, port in enumerate(ports)]
        self.strategy = PSStrategy("sync")
        self.strategy._job = SimpleNamespace(rank=0, world_size=1, is_chief=True, device=torch.device("cpu"),
                                             barrier=lambda: None)
        self.strategy.client = PSClient([f"127.0.0.1:{p}" for p in ports], SECRET, rank=0, num_workers=1,
                                        sender="worker:0", timeout=20.0, chunk_bytes=CHUNK)
        model = make_model(seed)
        self.model, self.optimizer = self.strategy.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
        self.items = self.strategy.checkpoint_items(self.model, self.optimizer)
        self.checkpoints = CheckpointManager(out / "checkpoints")

    def train(self, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = batch(step)
            self.optimizer.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())
        return losses

    def save(self, step: int) -> None:
        out = StepWrite(step, is_chief=True, root=self.checkpoints.root)
        for name, item in self.items.items():
            item.save(name, out)
        commit(self.checkpoints, out, timeout=20)

    def restore(self, step: int) -> None:
        restore(self.strategy._job, self.checkpoints.load(step), self.items)  # as the Trainer's resume does

    def whole_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Every server's state joined and cut for one server: comparable whatever the number of ps tasks."""
        return canonical(self.optimizer.state_dict())

    def close(self) -> None:
        self.strategy.client.close()
        for server in self.servers:
            server.close()


def canonical(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    shards = [(s["tensors"], s["meta"]) for s in state["servers"]]
    one = place([(n, p.shape, p.dtype) for n, p in make_model(0).named_parameters()], 1, CHUNK)
    return reshard(shards, one)[0]


def assert_identical(a: tuple[dict[str, torch.Tensor], dict], b: tuple[dict[str, torch.Tensor], dict]) -> None:
    assert a[1] == b[1]
    assert a[0].keys() == b[0].keys()
    for key in a[0]:
        assert a[0][key].dtype == b[0][key].dtype and torch.equal(a[0][key], b[0][key]), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """The P=2 job's output folder with step SAVED_AT, and its whole state at that step."""
    out = tmp_path_factory.mktemp("ps-reshard")
    job = Job(2, out, seed=0)
    try:
        job.train(range(SAVED_AT))
        job.save(SAVED_AT)
        state = job.optimizer.state_dict()
        assert [p.key for p in job.strategy.client.placement.pieces_of("0.weight")] == ["0.weight[0:64]",
                                                                                        "0.weight[64:128]"]
    finally:
        job.close()
    return out, state


def resumed(out: Path, num_ps: int) -> tuple[Job, tuple[dict[str, torch.Tensor], dict], list[float], list[float]]:
    job = Job(num_ps, out, seed=num_ps + 7)  # another start: everything must come from the checkpoint
    try:
        job.restore(SAVED_AT)
        state = job.whole_state()
        params = [p.detach().clone() for p in job.model.parameters()]
        losses = job.train(range(SAVED_AT, SAVED_AT + MORE))
    finally:
        job.close()
    return job, state, params, losses


@pytest.mark.timeout(60)
def test_a_checkpoint_of_two_ps_tasks_resumes_on_one_and_three_as_on_two(saved, capsys) -> None:
    out, state_at_save = saved
    base, base_state, base_params, base_losses = resumed(out, 2)
    assert "redistributed" not in capsys.readouterr().err
    assert_identical(base_state, canonical(state_at_save))
    for num_ps in (1, 3):
        job, state, params, losses = resumed(out, num_ps)
        cuts = [p.key for p in job.strategy.client.placement.pieces_of("0.weight")]
        assert num_ps == 1 or len(cuts) == 3, cuts  # on 3 servers the weight is cut where no saved piece was
        assert_identical(state, base_state)
        assert all(torch.equal(a, b) for a, b in zip(params, base_params, strict=True))
        assert losses == base_losses  # bit-identical floats, step after step
        assert f"resumed step {SAVED_AT}, written by 1 workers with 2 ps tasks, on 1 workers with {num_ps}: shards " \
            f"redistributed (" \
            in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_state_dict_of_two_ps_tasks_loads_into_three(saved) -> None:
    out, state_at_save = saved
    job = Job(3, out, seed=5)
    try:
        job.optimizer.load_state_dict(state_at_save)
        assert_identical(job.whole_state(), canonical(state_at_save))
    finally:
        job.close()


def test_pieces_that_took_different_numbers_of_steps_cannot_be_cut_across_and_say_why(saved) -> None:
    _, state = saved
    shards = [({k: v.clone() for k, v in s["tensors"].items()}, s["meta"]) for s in state["servers"]]
    late = next((t, key) for t, m in shards for key in m["pieces"] if key.startswith("0.weight[64:"))
    late[0][f"state/{late[1]}/step"] += 1  # as if ps-async saved while one server had applied one more push
    named = [(n, p.shape, p.dtype) for n, p in make_model(0).named_parameters()]
    assert len(reshard(shards, place(named, 1, CHUNK))) == 1  # one server keeps the saved cut: nothing crosses
    with pytest.raises(ReshardError, match=r"pieces of '0.weight' hold different 'step' \(3.0, 4.0\).*ps-async"):
        reshard(shards, place(named, 3, CHUNK))


@pytest.mark.timeout(60)
def test_a_checkpoint_that_cannot_be_re_split_is_refused_on_resume_naming_why(saved) -> None:
    """Step SAVED_AT + 1: the saved step with one piece a step ahead (as ps-async may save it); P=2 -> Q=3 refuses."""
    from safetensors.torch import load as load_safetensors
    from safetensors.torch import save as save_safetensors

    out, _ = saved
    checkpoints = CheckpointManager(out / "checkpoints")
    ckpt = checkpoints.load(SAVED_AT)
    late = load_safetensors(ckpt.read_part("ps-1.safetensors"))
    late["state/0.weight[64:128]/step"] += 1
    parts = {"ps-0.safetensors": ckpt.read_part("ps-0.safetensors"), "ps-0.json": ckpt.read_part("ps-0.json"),
             "ps-1.safetensors": save_safetensors(late), "ps-1.json": ckpt.read_part("ps-1.json")}
    for name, data in parts.items():
        checkpoints.save_part(SAVED_AT + 1, name, data)
    checkpoints.save(SAVED_AT + 1, dict(ckpt.trees), extra=ckpt.extra, parts=list(parts), parts_timeout=10)
    job = Job(3, out, seed=1)
    try:
        with pytest.raises(ResumeError, match=r"written with 2 ps tasks and cannot be re-split onto this job's 3: "
                                              r"the saved pieces of '0.weight' hold different 'step' \(3.0, 4.0\).*"
                                              r"Resume with the number of ps tasks that wrote it"):
            job.restore(SAVED_AT + 1)
    finally:
        job.close()

# -- end to end: `conveyor run` with the digits demo, 2 workers, --ps 2 and then --ps 3 --------------------------------

ROOT = Path(__file__).resolve().parents[2]


def run_digits(data: Path, out: Path, num_ps: int, epochs: int) -> str:
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--ps", str(num_ps), "--strategy", "ps-sync",
           "--data-dir", str(data), "--output-dir", str(out), "--max-restarts", "0",
           str(ROOT / "examples" / "digits" / "train.py"), "--epochs", str(epochs), "--batch-size", "64",
           "--checkpoint-every", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_conveyor_run_resumes_a_two_ps_job_on_three_to_the_same_model(tmp_path: Path) -> None:
    """Two epochs (22 steps) on --ps 2; a copy rewound to its step 15 (mid-epoch) finishes on --ps 3: the same model."""
    from safetensors.torch import load_file

    data, two, three = tmp_path / "data", tmp_path / "two", tmp_path / "three"
    assert "redistributed" not in run_digits(data, two, 2, epochs=2)
    shutil.copytree(two, three)
    for later in ("step-00000020", "step-00000022"):
        shutil.rmtree(three / "checkpoints" / later)
    (three / "checkpoints" / "latest").write_text("step-00000015")
    log = run_digits(data, three, 3, epochs=2)
    assert "resumed step 15, written by 2 workers with 2 ps tasks, on 2 workers with 3: shards redistributed" in log, \
        log[-3000:]
    final = [load_file(str(out / "checkpoints" / "step-00000022" / "model.safetensors")) for out in (two, three)]
    assert final[0].keys() == final[1].keys() and final[0]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])  # bit for bit, as if never re-split
    assert sorted(p.name for p in (three / "checkpoints" / "step-00000022").glob("ps-*.json")) == \
        ["ps-0.json", "ps-1.json", "ps-2.json"]
