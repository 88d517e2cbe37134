"""One process per GPU: the device rule (pure), its thin torch part with a faked CUDA, and conveyor.init's use."""

from __future__ import annotations

import pytest
import torch

from conveyor.cluster.variables import TASK_TYPE_VAR
from conveyor.train import devices
from conveyor.train.devices import GpuPlacementError, choose_gpu, share_gpus_from, task_device


@pytest.mark.parametrize("local_rank, local_world, visible, share, expected", [
    (0, 1, 0, False, None),     # no GPU: the CPU
    (3, 4, 0, False, None),
    (0, 1, 1, False, 0),
    (1, 2, 4, False, 1),        # fewer tasks than GPUs: GPU = local rank
    (3, 4, 4, False, 3),
    (3, 4, 2, True, 1),         # sharing asked for: round robin
    (2, 4, 2, True, 0),
    (5, 8, 1, True, 0),
])
def test_each_task_takes_the_gpu_of_its_local_rank(local_rank, local_world, visible, share, expected):
    assert choose_gpu(local_rank, local_world, visible, share) == expected


def test_more_tasks_than_gpus_is_refused_naming_the_counts_and_the_fixes():
    with pytest.raises(GpuPlacementError) as e:
        choose_gpu(2, 3, 2, False, visible_names="0,1")
    text = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "3 training tasks" in text and "2 visible GPU(s) (CUDA_VISIBLE_DEVICES=0,1)" in text
    assert "local rank 2 would share GPU 0" in text
    for fix in ("conveyor run -n 2", "--share-gpus", "CONVEYOR_SHARE_GPUS=1", "share_gpus=True", "gloo"):
        assert fix in text


def test_a_task_with_gpus_of_its_own_is_not_sharing():
    assert choose_gpu(3, 4, 1, False, own_gpus=True) == 0  # Slurm --gpus-per-task: each sees only its own


def test_a_local_rank_outside_the_local_world_is_an_error():
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is outside 0..1"):
        choose_gpu(2, 2, 4, False)


def test_sharing_comes_from_the_argument_else_the_variable():
    assert share_gpus_from(None, {"CONVEYOR_SHARE_GPUS": "1"}) is True
    assert share_gpus_from(None, {"CONVEYOR_SHARE_GPUS": "0"}) is False
    assert share_gpus_from(None, {}) is False
    assert share_gpus_from(False, {"CONVEYOR_SHARE_GPUS": "1"}) is False
    assert share_gpus_from(True, {}) is True


class FakeCuda:
    def __init__(self, count: int) -> None:
        self.count, self.current = count, None

    def install(self, monkeypatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: setattr(self, "current", i))
        return self


def test_task_device_sets_the_current_gpu_and_reads_what_is_visible(monkeypatch):
    cuda = FakeCuda(2).install(monkeypatch)
    assert task_device(1, 2, False, {}) == torch.device("cuda", 1) and cuda.current == 1
    with pytest.raises(GpuPlacementError, match="CUDA_VISIBLE_DEVICES=3"):
        FakeCuda(1).install(monkeypatch)
        task_device(1, 2, False, {"CUDA_VISIBLE_DEVICES": "3"})
    assert task_device(1, 2, False, {devices.SLURM_GPUS_PER_TASK: "1"}) == torch.device("cuda", 0)
    FakeCuda(2).install(monkeypatch)  # srun --gpus-per-task=2 ... conveyor run -n 2: the launcher's GPUs, shared out
    launched = {devices.SLURM_GPUS_PER_TASK: "2", TASK_TYPE_VAR: "worker"}
    assert task_device(1, 2, False, launched) == torch.device("cuda", 1)
    FakeCuda(0).install(monkeypatch)
    assert task_device(1, 2, False, {}) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: see the next test")
def test_init_on_a_cpu_machine_trains_on_the_cpu_whatever_the_sharing(tmp_path):
    import conveyor

    env = {"CONVEYOR_OUTPUT_DIR": str(tmp_path / "out"), "CONVEYOR_SHARE_GPUS": "1"}
    with conveyor.init(environ=env, share_gpus=False) as job:
        assert job.device == torch.device("cpu") and job.backend == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_init_on_a_gpu_machine_takes_gpu_0_and_nccl_unless_shared(tmp_path):
    import conveyor

    env = {"CONVEYOR_OUTPUT_DIR": str(tmp_path / "out")}
    with conveyor.init(environ=env) as job:
        assert job.device == torch.device("cuda", 0) and job.backend == "nccl"
        assert torch.cuda.current_device() == 0
    with conveyor.init(environ=env, share_gpus=True) as job:
        assert job.device == torch.device("cuda", 0) and job.backend == "gloo"  # NCCL refuses ranks sharing a GPU


def test_pipeline_stages_on_shared_gpus_are_refused_at_setup():
    from types import SimpleNamespace

    from conveyor.cluster.settings import JobSettings
    from conveyor.strategies.pipeline.strategy import PipelineStrategy

    job = SimpleNamespace(world_size=2, rank=0, timeout=5.0, device=torch.device("cuda", 0), backend="gloo",
                          settings=JobSettings())
    with pytest.raises(ValueError, match="one stage per GPU"):
        PipelineStrategy(stages=2).setup(job)
