"""Existing scripts run unchanged under `conveyor run`: torchrun DDP scripts, TensorFlow 2 and 1 patterns.

The scripts are written as their authors write them for torchrun or TensorFlow, not for conveyor: the DDP
one follows pytorch/examples' ``multigpu_torchrun.py`` (CPU and gloo here); the TensorFlow ones are
plain-Python stand-ins that behave like TF's tutorials (a serving task blocks forever in
``server.join()``), since TensorFlow is not installed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.launch import free_ports
from conveyor.launch.plan import TORCHRUN_VARS

pytestmark = pytest.mark.multiprocess

DDP_SCRIPT = '''
import json, os, sys
import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SEEN = ["OMP_NUM_THREADS", *sys.argv[4].split(",")]


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main(total_epochs, batch_size, out):
    ddp_setup()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = MyTrainDataset(256)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer)
    trainer.train(total_epochs)
    env = {k: os.environ.get(k) for k in SEEN}
    env["threads"] = torch.get_num_threads()
    with open(os.path.join(out, f"env-{os.environ['RANK']}.json"), "w") as f:
        json.dump(env, f)
    if trainer.global_rank == 0:
        params = [[float(x).hex() for x in p.detach().flatten().tolist()] for p in trainer.model.module.parameters()]
        with open(os.path.join(out, "params.json"), "w") as f:
            json.dump(params, f)
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
'''


def run_to_end(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> tuple[int, str]:
    """Run a launcher to its end; on a timeout kill its whole process group (its tasks too) and fail."""
    with open(cwd / "launcher.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise AssertionError(f"{argv[:4]} did not end within {timeout} s:\n{(cwd / 'launcher.log').read_text()}")
    return code, (cwd / "launcher.log").read_text()


def clean_env() -> dict[str, str]:
    drop = set(TORCHRUN_VARS) | {"OMP_NUM_THREADS", "TF_CONFIG"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("CONVEYOR_")}


def test_a_torchrun_ddp_script_gives_the_same_result_under_conveyor_run_as_under_torchrun(tmp_path):
    script = tmp_path / "multigpu_torchrun.py"
    script.write_text(DDP_SCRIPT)
    results = {}
    for launcher in ("torchrun", "conveyor"):
        out = tmp_path / launcher
        out.mkdir()
        args = [str(script), "3", "16", str(out), ",".join(TORCHRUN_VARS)]
        if launcher == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(free_ports(1)[0]), *args]
        else:
            argv = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--output-dir", str(out / "o"),
                    "--max-restarts", "0", *args]
        code, log = run_to_end(argv, tmp_path, clean_env())
        assert code == 0, log
        assert "OMP_NUM_THREADS" in log  # both say that they chose one thread per process
        envs = [json.loads((out / f"env-{rank}.json").read_text()) for rank in (0, 1)]
        results[launcher] = (json.loads((out / "params.json").read_text()), envs)
    (torch_params, torch_envs), (our_params, our_envs) = results["torchrun"], results["conveyor"]
    assert our_params == torch_params  # bit for bit
    differ_by_design = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"}
    for theirs, ours in zip(torch_envs, our_envs, strict=True):
        assert {k for k, v in theirs.items() if v is None} == {k for k, v in ours.items() if v is None} == set()
        assert {k: v for k, v in theirs.items() if k not in differ_by_design} == \
            {k: v for k, v in ours.items() if k not in differ_by_design}
