"""Asynchronous checkpoints (issue 19, item 5): a save blocks the training loop only while the state is copied;
the write runs in the background, its error surfaces, and the end of training waits for it.

Nothing here measures time: the write is held on an event that only the training loop's next steps release.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor.cluster.settings import JobSettings
from conveyor.train import trainer as trainer_module
from conveyor.train.checkpoint import BackgroundSaves, CheckpointError, CheckpointManager
from conveyor.train.checkpoint.staging import HostBuffers, stage_tree
from conveyor.train.trainer import TrainConfig, Trainer
from train.test_trainer import data, make_job, make_model

HELD = 30.0  # seconds a held write waits for its release before it fails the test (never reached when it works)


def trainer_with(out: Path, monkeypatch, callbacks=(), **options) -> Trainer:
    job = make_job(out, monkeypatch)
    model, opt = job.prepare(*make_model())
    options = {"epochs": 2, "checkpoint_every_steps": 3, "progress": False, **options}
    return Trainer(job, model, opt, nn.functional.cross_entropy, data(), callbacks=list(callbacks), **options)


def hold_writes(trainer: Trainer, release: threading.Event, started: list[int]) -> None:
    """Every background write of `trainer` waits for `release` before it writes anything."""
    write = trainer.checkpoints.write_staged

    def held(staged):
        started.append(staged.step)
        if not release.wait(HELD):
            raise RuntimeError(f"step {staged.step}: the write was never released")
        return write(staged)

    trainer.checkpoints.write_staged = held


def test_training_goes_on_while_the_save_is_written_and_the_save_holds_the_state_of_its_step(tmp_path, monkeypatch):
    release, started, at_save, seen = threading.Event(), [], {}, []
    root = tmp_path / "checkpoints"

    def callback(event):
        seen.append(event.step)
        if event.step == 3:  # after the save of step 3 returned: its write is held
            at_save.update({k: v.detach().clone() for k, v in trainer.module.state_dict().items()})
        if event.step == 5:  # two steps trained while step 3 was still unwritten
            assert not (root / "step-00000003").exists()
            release.set()

    trainer = trainer_with(tmp_path, monkeypatch, [callback], keep_checkpoints=None)
    hold_writes(trainer, release, started)
    summary = trainer.fit()
    assert seen == list(range(1, 11)) and started == [3, 6, 9, 10]
    saved = CheckpointManager(root).load(3).trees["model"]
    assert all(torch.equal(saved[k], v) for k, v in at_save.items())  # the copy, not the weights of step 5
    assert not all(torch.equal(saved[k], v) for k, v in trainer.module.state_dict().items())
    saves = json.loads((tmp_path / "summary.json").read_text())["checkpoint_saves"]
    assert saves == summary["checkpoint_saves"] and saves["async"] is True
    assert [s["step"] for s in saves["saves"]] == [3, 6, 9, 10]
    for s in saves["saves"]:
        assert 0 <= s["blocked_seconds"] <= s["total_seconds"]
    assert saves["blocked_seconds"]["total"] == pytest.approx(sum(s["blocked_seconds"] for s in saves["saves"]))


def test_the_final_save_is_complete_when_fit_returns(tmp_path, monkeypatch):
    release, started = threading.Event(), []
    trainer = trainer_with(tmp_path, monkeypatch, checkpoint_every_steps=None)
    hold_writes(trainer, release, started)
    threading.Timer(0.2, release.set).start()  # fit() would return with the write pending if it did not wait
    trainer.fit()
    assert started == [10] and CheckpointManager(tmp_path / "checkpoints").list_steps() == [10]


def test_an_error_of_a_background_write_surfaces_at_the_next_save(tmp_path, monkeypatch):
    trainer = trainer_with(tmp_path, monkeypatch)
    write = trainer.checkpoints.write_staged

    def failing(staged):
        if staged.step == 3:
            raise OSError(28, "No space left on device")
        return write(staged)

    trainer.checkpoints.write_staged = failing
    with pytest.raises(CheckpointError, match=r"checkpoint of step 3, written in the background, failed: .*No space"):
        trainer.fit()
    assert CheckpointManager(tmp_path / "checkpoints").list_steps() == []  # nothing half-written became visible


def test_an_error_of_the_last_write_surfaces_at_the_end_of_training(tmp_path, monkeypatch):
    trainer = trainer_with(tmp_path, monkeypatch, checkpoint_every_steps=None)
    trainer.checkpoints.write_staged = lambda staged: (_ for _ in ()).throw(OSError(5, "Input/output error"))
    with pytest.raises(CheckpointError, match="step 10, written in the background, failed"):
        trainer.fit()
    assert not (tmp_path / "summary.json").exists()


def test_an_interrupted_run_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    release, started = threading.Event(), []

    def callback(event):
        if event.step == 4:
            threading.Timer(0.2, release.set).start()
            raise KeyboardInterrupt("Ctrl-C")

    trainer = trainer_with(tmp_path, monkeypatch, [callback])
    hold_writes(trainer, release, started)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert started == [3] and CheckpointManager(tmp_path / "checkpoints").list_steps() == [3]


def test_synchronous_saves_write_before_the_loop_goes_on(tmp_path, monkeypatch):
    seen = []
    root = tmp_path / "checkpoints"
    trainer = trainer_with(tmp_path, monkeypatch, [lambda e: seen.append((e.step, (root / "step-00000003").exists()))],
                           async_checkpoint=False)
    summary = trainer.fit()
    assert (3, True) in seen and summary["checkpoint_saves"]["async"] is False
    assert all(s["blocked_seconds"] == s["total_seconds"] for s in summary["checkpoint_saves"]["saves"])


def test_the_setting_and_the_option_decide_together(tmp_path):
    class Job:
        settings = JobSettings(checkpoint_sync=True)

    assert JobSettings.from_environ({"CONVEYOR_CHECKPOINT_SYNC": "1"}).checkpoint_sync is True
    assert trainer_module._async_checkpoint(TrainConfig(), object()) is True
    assert trainer_module._async_checkpoint(TrainConfig(), Job()) is False
    assert trainer_module._async_checkpoint(TrainConfig(async_checkpoint=True), Job()) is True
    with pytest.raises(ValueError, match="async_checkpoint must be True, False or None"):
        TrainConfig(async_checkpoint="yes")


def test_one_save_in_flight_the_next_waits_and_close_warns_of_an_error():
    saves, order, gate = BackgroundSaves(timeout=HELD), [], threading.Event()

    def stage(step):
        order.append(f"stage {step}")
        return lambda: (gate.wait(HELD), order.append(f"written {step}"))

    saves.save(1, lambda: stage(1))
    assert saves.in_flight and order == ["stage 1"]
    threading.Timer(0.2, gate.set).start()
    saves.save(2, lambda: stage(2))  # staged only once 1 is written: one copy of the state at a time
    saves.finish()
    assert order == ["stage 1", "written 1", "stage 2", "written 2"] and not saves.in_flight
    saves.save(3, lambda: lambda: 1 / 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saves.close()
    assert any("step 3, written in the background, failed: division by zero" in str(w.message) for w in caught)
    saves.finish()  # reported once: not raised again


def test_a_write_that_outlives_its_timeout_is_named():
    saves, gate = BackgroundSaves(timeout=0.05), threading.Event()
    saves.save(7, lambda: lambda: gate.wait(HELD))
    with pytest.raises(CheckpointError, match="conveyor-checkpoint-7 is still running after 0.05s"):
        saves.wait()
    gate.set()
    saves.wait(HELD)


def test_staging_copies_so_later_changes_are_not_written():
    weight = torch.ones(3)
    staged = stage_tree("model", {"w": weight, "n": 2})
    weight.add_(1)
    staged.ready()
    assert torch.equal(staged.tensors["w"], torch.ones(3)) and staged.meta["tree"]


def test_host_buffers_are_reused_from_one_save_to_the_next():
    buffers, weight = HostBuffers(), torch.ones(4)
    first = CheckpointManager("unused").stage(1, {"model": {"w": weight}}, buffers=buffers).trees["model"]
    weight.add_(1)
    assert torch.equal(first.tensors["w"], torch.ones(4))
    pointer = first.tensors["w"].data_ptr()
    second = CheckpointManager("unused").stage(2, {"model": {"w": weight}}, buffers=buffers).trees["model"]
    assert second.tensors["w"].data_ptr() == pointer and torch.equal(second.tensors["w"], weight)
    third = CheckpointManager("unused").stage(3, {"model": {"w": torch.ones(2, 3)}}, buffers=buffers).trees["model"]
    assert third.tensors["w"].shape == (2, 3)  # another shape: another buffer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_is_copied_to_pinned_memory_without_blocking_and_later_kernels_do_not_change_it():
    weight = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    want = weight.cpu()
    buffers = HostBuffers()
    for _ in range(2):  # the second save reuses the pinned buffer
        buffers.start()
        staged = stage_tree("model", {"w": weight}, buffers=buffers)
        weight.mul_(3)  # queued after the copy on the same stream
        staged.ready()
        assert staged.tensors["w"].is_pinned() and torch.equal(staged.tensors["w"], want)
        want = weight.cpu()
