"""Trainer: a single-process run writes every output; a crashed run resumes to the uninterrupted result."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conveyor.data import Dataset, set_seed
from conveyor.strategies import Strategy
from conveyor.train.checkpoint import CheckpointError, CheckpointManager
from conveyor.train.trainer import ResumeError, TrainConfig, Trainer, accuracy

N, BATCH, CLASSES = 40, 8, 3  # 5 steps per epoch

# ---------------------------------------------------------------------------------------------------------------------
# a job: conveyor.init() once it exists, else a stand-in with the same attributes (docs/training.md)


class FakeStrategy(Strategy):
    name = "local"
    distributed = False

    def prepare(self, model, optimizer, *, split=None):
        return model, optimizer


class FakeJob:
    """World-size-1 Job as the contracts page describes it, without a process group."""

    def __init__(self, output_dir: Path, resume: bool = True, restart_count: int = 0):
        self.rank, self.world_size, self.local_rank, self.local_world_size = 0, 1, 0, 1
        self.is_chief, self.task_type, self.task_index, self.cluster = True, "chief", 0, None
        self.strategy = FakeStrategy()
        self.device = torch.device("cpu")
        self.data_dir = Path("./data")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.restart_count = restart_count
        self.resume = resume

    def prepare(self, model, optimizer):
        return model, optimizer

    def barrier(self) -> None:
        pass

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        return bytes(data)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def shutdown(self) -> None:
        pass


def make_job(out: Path, monkeypatch, resume: bool = True, restarts: int = 0):
    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CONVEYOR_STRATEGY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CONVEYOR_OUTPUT_DIR", str(out))
    monkeypatch.setenv("CONVEYOR_RESUME", "1" if resume else "0")
    monkeypatch.setenv("CONVEYOR_RESTART_COUNT", str(restarts))
    try:
        from conveyor.train.job import init
    except ImportError:
        return FakeJob(out, resume, restarts)
    return init()


# ---------------------------------------------------------------------------------------------------------------------
# a tiny deterministic problem


def data(seed: int | None = 7, n: int = N) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    x[:, 0] = np.arange(n, dtype=np.float32) / n  # a sample's id, readable from the batch
    y = (x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 0.5).astype(np.int64)
    return Dataset.from_tensor_slices((x, y)).shuffle(16, seed=seed).batch(BATCH)


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, CLASSES))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


class Recorder:
    """A callback that records the sample ids of every step, and can 'crash' after a step."""

    def __init__(self, crash_after: int | None = None):
        self.seen: dict[int, list[int]] = {}
        self.crash_after = crash_after

    def __call__(self, event) -> None:
        self.seen[event.step] = [round(float(v) * N) for v in event.inputs[:, 0]]
        if event.step == self.crash_after:
            raise KeyboardInterrupt("simulated crash")  # not an Exception: nothing may swallow it


def run(out: Path, monkeypatch, ds=None, crash_after=None, resume=True, scheduler=None, **options):
    """Train (`scheduler(optimizer)`: an LR scheduler for it); returns (summary, sample ids by step, parameters)."""
    job = make_job(out, monkeypatch, resume=resume)
    model, opt = job.prepare(*make_model())
    rec = Recorder(crash_after)
    options = {"epochs": 2, "checkpoint_every_steps": 3, "log_every_steps": 2, "progress": False, **options}
    trainer = Trainer(job, model, opt, nn.functional.cross_entropy, data() if ds is None else ds,
                      callbacks=[rec], scheduler=scheduler(opt) if scheduler else None, **options)
    summary = None
    try:
        summary = trainer.fit()
    except KeyboardInterrupt:
        if crash_after is None:
            raise
    params = [p.detach().clone() for p in trainer.module.parameters()]
    return summary, rec.seen, params


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------------
# outputs


def test_fit_writes_every_output(tmp_path, monkeypatch):
    job = make_job(tmp_path, monkeypatch)
    ticks = iter(range(10**6))
    model, opt = job.prepare(*make_model())
    job.strategy.step.comm_seconds = lambda: next(ticks) * 1e-4  # a strategy that reports communication
    trainer = Trainer(job, model, opt, nn.functional.cross_entropy, data().repeat(3),
                      eval_data=data(seed=None), epochs=2, eval_every_steps=10, log_every_steps=3,
                      checkpoint_every_steps=10, progress=False)
    summary = trainer.fit()

    train = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in train] == [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    for r in train:
        assert {"step", "epoch", "loss", "samples_per_second", "input_wait_fraction", "lr", "time"} <= set(r)
        assert r["samples_per_second"] > 0 and 0 <= r["input_wait_fraction"] <= 1 and r["lr"] == 0.05
    assert train[-1]["loss"] < train[0]["loss"] * 0.8  # it learns
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, 30]  # the end (30) is evaluated once
    assert list(tmp_path.glob("tensorboard/events.out.tfevents.*"))

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["strategy"] == "local" and summary["world_size"] == 1 and summary["restarts"] == 0
    assert summary["steps"] == 30 and summary["epochs"] == 2 and summary["samples"] == 30 * BATCH
    assert summary["samples_per_second"] > 0 and summary["wall_seconds"] > 0
    assert 0 < summary["eval_accuracy"] <= 1 and summary["eval_loss"] > 0
    assert 0 <= summary["input_wait_fraction"] <= 1 and 0 <= summary["accelerator_idle_fraction"] <= 1
    assert set(summary["step_breakdown"]) >= {"input_wait", "forward_backward", "communication", "optimizer"}
    assert summary["step_breakdown"]["communication"] == pytest.approx(1e-4)
    scaling = summary["scaling"]  # what `conveyor predict` reads
    nbytes = sum(p.numel() * p.element_size() for p in trainer.module.parameters())
    assert scaling["parameter_bytes"] == scaling["gradient_bytes"] == nbytes
    assert scaling["batch_size"] == BATCH and scaling["device"] == "cpu" and scaling["compute_threads"] >= 1
    assert scaling["input_core_seconds_per_batch"] is None  # no map stage reports its workers' time here
    assert "allreduce_bus_bandwidth" not in scaling  # one worker: nothing to measure
    assert Path(summary["checkpoints"]) == tmp_path / "checkpoints"
    assert CheckpointManager(tmp_path / "checkpoints").list_steps() == [10, 20, 30]

    trace = json.loads((tmp_path / "trace" / "worker-0.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"step", "input_wait", "forward_backward", "communication", "optimizer", "eval", "checkpoint"} <= names
    assert all(e["dur"] >= 0 and e["pid"] == 0 for e in trace["traceEvents"] if e["ph"] == "X")
    for plot in summary["outputs"]["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", Path(plot).read_bytes()[16:24])[0] > 100  # width


def test_evaluate_with_a_custom_metric(tmp_path, monkeypatch):
    def top2(outputs, targets):
        return (outputs.topk(2, dim=-1).indices == targets[:, None]).any(dim=-1).float().mean()

    job = make_job(tmp_path, monkeypatch)
    model, opt = job.prepare(*make_model())
    trainer = Trainer(job, model, opt, nn.functional.cross_entropy, data(), eval_data=data(), metric_fn=top2,
                      progress=False)
    summary = trainer.fit()
    assert "eval_accuracy" not in summary and 0 < summary["eval_top2"] <= 1 and summary["eval_loss"] > 0
    again = trainer.evaluate()  # callable on its own; deterministic (dropout off)
    assert again["eval_top2"] == summary["eval_top2"] and again["eval_samples"] == N
    assert trainer.module.training  # evaluate() puts the model back in training mode


def test_accuracy_metric():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0]])
    assert accuracy(logits, torch.tensor([0, 1, 1])).item() == pytest.approx(2 / 3)
    assert accuracy(torch.tensor([[1.5], [-2.0]]), torch.tensor([1, 1])).item() == 0.5  # one logit: binary


def test_max_steps_runs_as_many_epochs_as_needed(tmp_path, monkeypatch):
    summary, seen, _ = run(tmp_path, monkeypatch, epochs=None, max_steps=12, checkpoint_every_steps=None)
    assert summary["steps"] == 12 and summary["epochs"] == 2  # two full passes, then 2 steps of the third
    assert sorted(sum((seen[s] for s in range(1, 6)), [])) == list(range(N))  # every sample once per epoch
    assert sorted(sum((seen[s] for s in range(6, 11)), [])) == list(range(N))
    assert [seen[s] for s in range(1, 6)] != [seen[s] for s in range(6, 11)]  # reshuffled each epoch


# ---------------------------------------------------------------------------------------------------------------------
# resume


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`run` with its defaults, never interrupted: (summary, seen, params), the reference of the resume tests."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run(tmp_path_factory.mktemp("reference"), monkeypatch)


@pytest.mark.parametrize("crash_after", [4, 7])  # 4: resume from step 3 in epoch 0; 7: from step 6 in epoch 1
def test_resume_sees_the_same_samples_and_ends_with_the_same_weights(tmp_path, monkeypatch, crash_after,
                                                                      uninterrupted):
    ref_summary, ref_seen, ref_params = uninterrupted
    assert ref_summary["steps"] == 10 and sorted(ref_seen) == list(range(1, 11))

    out = tmp_path / "crashed"
    _, before, _ = run(out, monkeypatch, crash_after=crash_after)
    assert sorted(before) == list(range(1, crash_after + 1))
    summary, after, params = run(out, monkeypatch)

    resumed_from = (crash_after // 3) * 3
    assert summary["resumed_from_step"] == resumed_from and summary["steps"] == 10
    assert sorted(after) == list(range(resumed_from + 1, 11))
    assert {**before, **after} == ref_seen  # the same batches, in the same order: nothing lost or repeated
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert train[0]["step"] == 2  # appended to the crashed run's records, not started over


def test_resume_keeps_an_unseeded_pipelines_order(tmp_path, monkeypatch):
    """A rebuilt Dataset draws a new root seed; epochs started after the resume must use the saved one."""
    set_seed(123)
    _, ref_seen, ref_params = run(tmp_path / "reference", monkeypatch, ds=data(seed=None))
    set_seed(123)
    _, before, _ = run(tmp_path / "crashed", monkeypatch, ds=data(seed=None), crash_after=4)
    set_seed(None)
    _, after, params = run(tmp_path / "crashed", monkeypatch, ds=data(seed=None))
    assert {**before, **after} == ref_seen
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_resume_of_a_finished_run_does_nothing_more(tmp_path, monkeypatch, capsys):
    run(tmp_path, monkeypatch)
    capsys.readouterr()
    summary, seen, _ = run(tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert f"resumed from step 10 ({tmp_path / 'checkpoints' / 'step-00000010'}), written " in err
    assert "by a job of 1 worker(s), strategy local, in epoch 2" in err
    assert "this job already finished: it trained 10 steps over 2 epoch(s)" in err and "--no-resume" in err
    assert summary["steps"] == 10 and summary["steps_this_run"] == 0 and seen == {}
    summary, seen, _ = run(tmp_path, monkeypatch, epochs=3)  # asked for more: the next epoch follows
    assert summary["steps"] == 15 and sorted(seen) == list(range(11, 16))


def test_no_resume_starts_over(tmp_path, monkeypatch, uninterrupted):
    _, ref_seen, ref_params = uninterrupted
    run(tmp_path / "out", monkeypatch, crash_after=7)
    summary, seen, params = run(tmp_path / "out", monkeypatch, resume=False)
    assert summary["resumed_from_step"] is None and seen == ref_seen
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    train = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10]  # the old run's records are gone


def test_resume_skips_a_damaged_step_out_loud_and_says_where_it_resumed(tmp_path, monkeypatch, capsys, caplog):
    run(tmp_path, monkeypatch, crash_after=7, keep_checkpoints=None)  # checkpoints at steps 3 and 6
    (tmp_path / "checkpoints" / "step-00000006" / "COMPLETE").write_text("garbage")
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="conveyor.train.checkpoint"):
        summary, _, _ = run(tmp_path, monkeypatch)
    assert summary["resumed_from_step"] == 3
    assert [r.getMessage() for r in caplog.records if "step-00000006" in r.getMessage()]
    err = capsys.readouterr().err
    assert f"resumed from step 3 ({tmp_path / 'checkpoints' / 'step-00000003'})" in err

    for step in (3, 6, 9, 10):  # every checkpoint damaged: refuse rather than silently start over
        folder = tmp_path / "checkpoints" / f"step-{step:08d}"
        if folder.exists():
            (folder / "COMPLETE").write_text("garbage")
    with pytest.raises(CheckpointError, match="--no-resume"):
        run(tmp_path, monkeypatch)
    summary, _, _ = run(tmp_path, monkeypatch, resume=False)  # the named fix works
    assert summary["resumed_from_step"] is None and summary["steps"] == 10


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def logged_lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"}


def test_an_lr_scheduler_resumes_where_it_was(tmp_path, monkeypatch):
    _, ref_seen, ref_params = run(tmp_path / "reference", monkeypatch, scheduler=halving)
    out = tmp_path / "crashed"
    _, before, _ = run(out, monkeypatch, crash_after=7, scheduler=halving)  # checkpoints at steps 3 and 6
    summary, after, params = run(out, monkeypatch, scheduler=halving)
    assert summary["resumed_from_step"] == 6 and {**before, **after} == ref_seen
    lrs = logged_lrs(tmp_path / "reference")
    assert lrs == {2: 0.025, 4: 0.0125, 6: 0.00625, 8: 0.003125, 10: 0.0015625}  # the schedule did run
    assert logged_lrs(out) == lrs  # steps 8 and 10 from the resumed run: the LR went on from step 6's
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_checkpoint_without_the_scheduler_is_refused_naming_the_fix(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch, crash_after=4)  # no scheduler: the checkpoint of step 3 holds none
    with pytest.raises(ResumeError, match=r"holds no 'scheduler'.*resume without 'scheduler', or .*--no-resume"):
        run(tmp_path, monkeypatch, scheduler=halving)
    summary, _, _ = run(tmp_path, monkeypatch)  # the named fix works
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 10


def as_written_before_items(folder: Path) -> None:
    """Make `folder` what conveyor wrote before checkpoint items: a state.json that lists no trees."""
    state = json.loads((folder / "state.json").read_text())
    assert state.pop("trees") == ["rng", "model", "optimizer"]
    data = json.dumps(state).encode()
    (folder / "state.json").write_bytes(data)
    manifest = json.loads((folder / "COMPLETE").read_text())
    manifest["parts"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "COMPLETE").write_text(json.dumps(manifest))


def test_a_checkpoint_from_before_items_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, uninterrupted):
    _, ref_seen, ref_params = uninterrupted
    _, before, _ = run(tmp_path, monkeypatch, crash_after=7)
    as_written_before_items(tmp_path / "checkpoints" / "step-00000006")
    summary, after, params = run(tmp_path, monkeypatch)
    assert summary["resumed_from_step"] == 6 and {**before, **after} == ref_seen
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def fake_checkpoint(out: Path, world_size: int, workers: list[int]) -> None:
    model, opt = make_model()
    state = {"format": "conveyor.trainer.data", "version": 1, "epoch": 0, "batches": 1, "root_seed": 1,
             "iterator": None, "rng": None}
    CheckpointManager(out / "checkpoints", fsync=False).save(
        3, {"model": model.state_dict(), "optimizer": opt.state_dict()}, extra={"epoch": 0, "world_size": world_size},
        docs={f"data/worker-{r}": state for r in workers})


def test_a_checkpoint_from_another_world_size_is_refused(tmp_path, monkeypatch):
    fake_checkpoint(tmp_path, world_size=2, workers=[0, 1])
    with pytest.raises(ResumeError, match=r"2 worker\(s\); this job has 1.*-n 2.*--no-resume"):
        run(tmp_path, monkeypatch)
    summary, _, _ = run(tmp_path, monkeypatch, resume=False)  # the named fix works
    assert summary["steps"] == 10


def sharded(world: int, rank: int) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    x[:, 0] = np.arange(N, dtype=np.float32) / N
    return Dataset.from_tensor_slices((x, (x[:, 1] > 0).astype(np.int64))).shard(world, rank).shuffle(6, seed=7) \
        .batch(BATCH)


def test_a_checkpoint_of_two_workers_resumes_on_one_with_every_sample_once(tmp_path, monkeypatch, capsys):
    """Two workers took one batch each and checkpointed (step 1); one worker finishes the epoch with the rest
    of both shards, every sample once, and the chief says so."""
    taken, states = [], []
    for rank in range(2):
        it = sharded(2, rank).iterator(root_seed=5, iteration=0)
        taken += [round(float(v) * N) for v in next(it)[0][:, 0]]
        states.append(it.state_dict())
        it.close()
    model, opt = make_model()
    docs = {f"data/worker-{r}": {"format": "conveyor.trainer.data", "version": 1, "epoch": 0, "batches": 1,
                                 "root_seed": 5, "iterator": states[r], "rng": None} for r in range(2)}
    CheckpointManager(tmp_path / "checkpoints", fsync=False).save(
        1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, extra={"epoch": 0, "world_size": 2},
        docs=docs)
    summary, seen, _ = run(tmp_path, monkeypatch, ds=sharded(1, 0), epochs=2, checkpoint_every_steps=2)
    assert "resumed step 1, written by 2 workers, on 1 workers: data redistributed" in capsys.readouterr().err
    first_epoch = [i for step in sorted(seen) if step <= 1 + 3 for i in seen[step]]  # 24 left: 3 batches of 8
    assert sorted(taken + first_epoch) == list(range(N))
    assert sorted(i for step in seen if step > 4 for i in seen[step]) == list(range(N))  # then whole epochs
    assert summary["steps"] == 1 + 3 + 5


def test_a_generator_pipeline_is_not_redistributed_and_the_refusal_names_the_op_and_the_way_out(tmp_path,
                                                                                                 monkeypatch):
    fake_checkpoint(tmp_path, world_size=2, workers=[0, 1])
    x, y = np.zeros((N, 4), np.float32), np.zeros(N, np.int64)
    generated = Dataset.from_generator(lambda: zip(x, y, strict=True)).shard(1, 0).batch(BATCH)
    with pytest.raises(ResumeError, match=r"2 worker\(s\); this job has 1.*the from_generator op cannot be "
                                          r"redistributed.*-n 2.*--no-resume"):
        run(tmp_path, monkeypatch, ds=generated)


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch)
    job = make_job(tmp_path, monkeypatch)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, CLASSES), nn.Softmax(-1))
    other.register_buffer("scale", torch.ones(1))
    model, opt = job.prepare(other, torch.optim.Adam(other.parameters(), lr=0.05))
    trainer = Trainer(job, model, opt, nn.functional.cross_entropy, data(), epochs=3, progress=False)
    differs = r"\(not in the checkpoint: scale; other shapes: 0.bias \(16,\) in the checkpoint, \(32,\) here"
    with pytest.raises(ResumeError, match=r"another model than this job's " + differs + ".*--no-resume.*--output-dir"):
        trainer.fit()


def test_another_scripts_checkpoint_is_refused_as_another_model_not_as_another_worker_count(tmp_path, monkeypatch):
    """Two scripts in one output folder (the default): the first fix named must not lead to a second error. A
    checkpoint of another model written by 2 workers used to be refused for its worker count, whose fix
    (-n 2) then met the model's refusal."""
    fake_checkpoint(tmp_path, world_size=2, workers=[0, 1])
    job = make_job(tmp_path, monkeypatch)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    model, opt = job.prepare(other, torch.optim.Adam(other.parameters(), lr=0.05))
    trainer = Trainer(job, model, opt, nn.functional.cross_entropy, data(), epochs=3, progress=False)
    with pytest.raises(ResumeError, match=r"another model than this job's .*another script's run.*--no-resume"
                                          r".*--output-dir") as refused:
        trainer.fit()
    assert "worker(s)" not in str(refused.value)


def test_an_optimizer_state_that_does_not_fit_is_refused_naming_both_strategies(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch)
    job = make_job(tmp_path, monkeypatch)
    model, _ = make_model()
    model, opt = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # Adam wrote the state
    trainer = Trainer(job, model, opt, nn.functional.cross_entropy, data(), epochs=3, progress=False)
    with pytest.raises(ResumeError, match=r"state of optimizer Adam; this job trains with SGD.*--no-resume"):
        trainer.fit()


def test_a_checkpoint_without_this_workers_data_state_is_refused(tmp_path, monkeypatch):
    fake_checkpoint(tmp_path, world_size=1, workers=[])
    with pytest.raises(ResumeError, match=r"no data-iterator state for \['worker-0'\].*--no-resume"):
        run(tmp_path, monkeypatch)


def test_time_based_checkpoints(tmp_path, monkeypatch):
    run(tmp_path, monkeypatch, checkpoint_every_steps=None, checkpoint_every_seconds=1e-6, keep_checkpoints=None)
    assert CheckpointManager(tmp_path / "checkpoints").list_steps() == list(range(1, 11))


# ---------------------------------------------------------------------------------------------------------------------
# configuration and display


def test_options_are_validated(tmp_path, monkeypatch):
    job = make_job(tmp_path, monkeypatch)
    model, opt = make_model()
    with pytest.raises(TypeError, match="unknown option.*'epocs'"):
        Trainer(job, model, opt, nn.functional.cross_entropy, data(), epocs=2)
    with pytest.raises(ValueError, match="log_every_steps must be a positive integer"):
        Trainer(job, model, opt, nn.functional.cross_entropy, data(), log_every_steps=0)
    with pytest.raises(ValueError, match="progress must be"):
        TrainConfig(progress="yes")
    with pytest.raises(TypeError, match="conveyor.data Dataset"):
        Trainer(job, model, opt, nn.functional.cross_entropy, [(1, 2)])
    cfg = TrainConfig(epochs=4, log_every_steps=5)
    assert Trainer(job, model, opt, nn.functional.cross_entropy, data(), config=cfg, epochs=1).config == TrainConfig(
        epochs=1, log_every_steps=5
    )


def test_an_endless_dataset_needs_steps_per_epoch_or_max_steps(tmp_path, monkeypatch):
    job = make_job(tmp_path, monkeypatch)
    model, opt = make_model()
    endless = data().repeat()
    for options in ({"epochs": 20}, {}, {"epochs": 2, "max_steps": 7}):
        with pytest.raises(ValueError, match=r"repeats forever.*steps_per_epoch=N.*max_steps=N"):
            Trainer(job, model, opt, nn.functional.cross_entropy, endless, **options)
    assert endless.is_endless() and not data().is_endless() and not endless.take(3).is_endless()
    assert data().repeat(2).is_endless() is False and endless.take(3).repeat().is_endless()


def test_steps_per_epoch_ends_epochs_of_an_endless_dataset(tmp_path, monkeypatch):
    summary, seen, _ = run(tmp_path, monkeypatch, ds=data().repeat(), epochs=3, steps_per_epoch=7,
                           checkpoint_every_steps=None)
    assert summary["steps"] == 21 and summary["epochs"] == 3 and sorted(seen) == list(range(1, 22))
    summary, _, _ = run(tmp_path / "bounded", monkeypatch, ds=data().repeat(), epochs=None, max_steps=4)
    assert summary["steps"] == 4


def test_batches_must_be_pairs(tmp_path, monkeypatch):
    job = make_job(tmp_path, monkeypatch)
    model, opt = make_model()
    ds = Dataset.from_tensor_slices(np.zeros((8, 4), np.float32)).batch(4)
    with pytest.raises(TypeError, match=r"\(inputs, targets\) batches"):
        Trainer(job, model, opt, nn.functional.cross_entropy, ds, progress=False).fit()


def test_progress_prints_lines_when_not_a_terminal(tmp_path, monkeypatch, capsys):
    run(tmp_path, monkeypatch, progress=True, log_every_steps=5)
    err = capsys.readouterr().err
    assert "step 5  epoch 0  loss" in err and "step 10/10  epoch 1  loss" in err  # the total is known after epoch 0
    assert "samples/s  input wait" in err and "\r" not in err



def test_the_step_log_and_summary_show_tflops_memory_and_mfu_only_with_a_peak(tmp_path, monkeypatch, capsys):
    summary, _, _ = run(tmp_path / "a", monkeypatch, progress=True, log_every_steps=5)
    err = capsys.readouterr().err
    assert "input wait" in err and " TFLOPS  mem " in err and "GiB\n" in err
    assert "MFU" not in err  # the CPU has no known peak
    train = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if r["event"] == "train"]
    assert all(r["tflops"] > 0 and r["peak_memory_gib"] > 0 and "mfu" not in r for r in train)
    assert "tokens_per_second" not in train[0] and "tokens_per_second" not in summary  # float features
    assert summary["tflops"] > 0 and summary["peak_memory_gib"] > 0 and "mfu" not in summary
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["tflops"] == summary["tflops"]

    summary, _, _ = run(tmp_path / "b", monkeypatch, progress=True, log_every_steps=5, peak_tflops=0.5)
    err = capsys.readouterr().err
    assert " TFLOPS  MFU " in err
    train = [r for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if r["event"] == "train"]
    assert all(r["mfu"] == pytest.approx(r["tflops"] / 0.5) for r in train)
    assert summary["mfu"] == pytest.approx(summary["tflops"] / 0.5)


def test_a_run_counting_flops_ends_as_one_that_does_not(tmp_path, monkeypatch):
    counted, _, params = run(tmp_path / "counted", monkeypatch, checkpoint_every_steps=None)
    plain, _, plain_params = run(tmp_path / "plain", monkeypatch, checkpoint_every_steps=None, count_flops=False)
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))  # dropout's RNG too
    assert counted["tflops"] > 0 and "tflops" not in plain and plain["peak_memory_gib"] > 0


def test_token_batches_log_tokens_per_second(tmp_path, monkeypatch):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (N, 6))
    ds = Dataset.from_tensor_slices((ids.numpy(), ids[:, 0].numpy() % CLASSES)).batch(BATCH)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(6 * 8, CLASSES))
    job = make_job(tmp_path, monkeypatch)
    summary = Trainer(job, model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, ds,
                      epochs=1, log_every_steps=5, progress=False).fit()
    train = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    assert train[0]["tokens_per_second"] == pytest.approx(6 * train[0]["samples_per_second"])
    assert summary["tokens_per_second"] == pytest.approx(6 * summary["samples_per_second"])


def test_progress_bar_when_forced_and_silence_elsewhere():
    import io

    from conveyor.train.progress import Progress

    stream = io.StringIO()
    bar = Progress(enabled=True, mode="always", total=4, stream=stream)
    assert bar.is_bar
    bar.advance()
    bar.write({"event": "train", "step": 1, "loss": 0.5, "samples_per_second": 1234.0, "input_wait_fraction": 0.25})
    bar.advance()
    bar.close()
    assert "loss=0.5000 samples/s=1234 input-wait=25.0%" in stream.getvalue() and "2/4" in stream.getvalue()
    bar = Progress(enabled=True, mode="always", total=4, stream=stream)
    bar.write({"event": "train", "step": 1, "loss": 0.5, "samples_per_second": 1234.0, "input_wait_fraction": 0.25,
               "tokens_per_second": 9872.0, "tflops": 0.000213, "mfu": 0.0042, "peak_memory_gib": 0.5})
    bar.close()
    assert "input-wait=25.0% tokens/s=9872 TFLOPS=0.000213 MFU=0.4% mem=0.50GiB" in stream.getvalue()
    for progress in (Progress(enabled=False, stream=stream), Progress(enabled=True, mode=False, stream=stream)):
        before = stream.getvalue()
        progress.advance()
        progress.write({"event": "train", "step": 2, "loss": 0.4})
        progress.close()
        assert stream.getvalue() == before and not progress.is_bar


def test_jsonl_sink_writes_strict_json(tmp_path):
    from conveyor.train.sinks import JsonlSink

    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"step": 1, "loss": float("nan")})
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 1, "loss": None}]  # flushed at once, NaN as null
    sink.close()
    JsonlSink(tmp_path / "m.jsonl", append=True).write({"step": 2})
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1, 2]

# ---------------------------------------------------------------------------------------------------------------------
# two workers (conveyor.init(), allreduce: DDP over gloo on 127.0.0.1): a killed worker, resume, uneven
# shards, time-based checkpoints

WORKER = r'''
import json, os, sys, warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import conveyor
from conveyor.data import Dataset
from conveyor.train.trainer import Trainer

out, kill_at, every_seconds = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) or None
job = conveyor.init()  # RANK, WORLD_SIZE, MASTER_ADDR/PORT, CONVEYOR_OUTPUT_DIR
rng = np.random.default_rng(0)
x = rng.normal(size=(49, 4)).astype(np.float32)
x[:, 0] = np.arange(49, dtype=np.float32)  # sample ids
y = (x[:, 1] > 0).astype(np.int64)
# 49 samples: worker 0 gets 25 (7 batches, the last of 1), worker 1 gets 24 (6 batches): worker 1 takes a
# zero-weight step 7 with worker 0's last batch, and every sample is trained on once per epoch
ds = Dataset.from_tensor_slices((x, y)).shard(2, job.rank).shuffle(8, seed=3).batch(4)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2))
model, opt = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
seen_path = out / f"seen-{job.rank}.json"
seen = json.loads(seen_path.read_text()) if seen_path.exists() else {}


def record(event):
    seen[str(event.step)] = [int(v) for v in event.inputs[:, 0]]
    seen_path.write_text(json.dumps(seen))
    if event.step == kill_at and job.rank == 1:
        os._exit(9)  # like kill -9: no cleanup, no finally


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    test = Dataset.from_tensor_slices((x, y)).batch(5)  # not sharded per worker: each sample must count once
    summary = Trainer(job, model, opt, nn.functional.cross_entropy, ds, eval_data=test, epochs=2,
                      checkpoint_every_steps=3,
                      checkpoint_every_seconds=every_seconds, keep_checkpoints=None, log_every_steps=2,
                      progress=False, callbacks=[record]).fit()
params = [p.detach().flatten().tolist() for p in model.module.parameters()]
(out / f"result-{job.rank}.json").write_text(json.dumps(
    {"params": params, "summary": summary, "warnings": [str(w.message) for w in caught]}))
job.shutdown()
# everything is written and the group destroyed: skip interpreter finalization, where gloo's threads can still
# hold work objects and abort a finished process (pytorch/pytorch PR 179291; Job.shutdown's docstring). Kept:
# _two_workers starts these processes itself and requires exit 0; only `conveyor run` forgives that abort
sys.stdout.flush()
os._exit(0)
'''


def _free_port() -> int:
    from conveyor.launch.ports import free_ports

    return free_ports(1)[0]  # from this xdist worker's range, if any (tests/conftest.py)


def _two_workers(script: Path, out: Path, kill_at: int = 0, every_seconds: float = 0.0):
    import os
    import subprocess
    import sys

    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(out), str(kill_at), str(every_seconds)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                   "CONVEYOR_OUTPUT_DIR": str(out), "CONVEYOR_TIMEOUT": "60"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    codes, logs = [], []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=90)[0].decode(errors="replace"))
        finally:
            p.kill()
        codes.append(p.returncode)
    assert codes == [0, 0] or kill_at, logs
    return codes, logs


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)  # three two-process jobs; each process imports torch (several seconds on a busy machine)
def test_two_workers_killed_one_resumes_to_the_uninterrupted_result(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ref, out = tmp_path / "reference", tmp_path / "killed"
    ref.mkdir()
    out.mkdir()
    _two_workers(script, ref)
    codes, logs = _two_workers(script, out, kill_at=8, every_seconds=0.01)  # worker 1 dies after step 8
    assert codes[1] == 9 and codes[0] != 0  # the chief's next collective fails: the job is down ...
    assert "PeerError" in logs[0] and "rank 1" in logs[0]  # ... and says who is gone
    _two_workers(script, out, every_seconds=0.01)  # the launcher's restart, in short

    expected = [json.loads((ref / f"result-{r}.json").read_text()) for r in range(2)]
    got = [json.loads((out / f"result-{r}.json").read_text()) for r in range(2)]
    assert got[0]["params"] == expected[0]["params"] == expected[1]["params"] == got[1]["params"]
    for r in range(2):
        ref_seen = json.loads((ref / f"seen-{r}.json").read_text())
        assert json.loads((out / f"seen-{r}.json").read_text()) == ref_seen  # same batches per step, per worker
    seen = [json.loads((ref / f"seen-{r}.json").read_text()) for r in range(2)]
    assert sorted(map(int, seen[0])) == list(range(1, 15))  # 7 steps per epoch: the longer shard decides ...
    assert sorted(map(int, seen[1])) == [*range(1, 7), *range(8, 14)]  # ... worker 1's steps 7, 14 carry no batch
    for epoch in (range(1, 8), range(8, 15)):  # every sample once per epoch, none dropped
        ids = [i for r in range(2) for step in epoch for i in seen[r].get(str(step), [])]
        assert sorted(ids) == list(range(49))
    assert not any("skips the rest of its shard" in w for w in expected[0]["warnings"] + expected[1]["warnings"])
    assert any("eval_data is not sharded per worker" in w for w in expected[0]["warnings"])
    evals = [r for r in read_jsonl(ref / "metrics.jsonl") if r["event"] == "eval"]
    assert evals[-1]["eval_samples"] == 49  # every sample of the unsharded test set once, not once per worker
    summary = got[0]["summary"]
    assert summary["world_size"] == 2 and summary["steps"] == 14 and summary["resumed_from_step"] >= 6
    since = range(summary["resumed_from_step"] + 1, 15)
    assert summary["strategy"] == "allreduce" and summary["samples"] == sum(1 if s % 7 == 0 else 8 for s in since)
    steps = CheckpointManager(out / "checkpoints").list_steps()
    assert len(steps) > 14 // 3 and steps[-1] == 14  # time-based saves on top of every 3rd step, all ranks agreeing


def test_the_trainer_options_are_public():
    import conveyor

    assert conveyor.TrainConfig is TrainConfig and "TrainConfig" in conveyor.__all__
    assert "max_steps" in TrainConfig.__doc__ and "steps_per_epoch" in TrainConfig.__doc__


# ---------------------------------------------------------------------------------------------------------------------
# a finished run run again, non-finite losses (issue 22, defects 2 and 3)


def output_files(out: Path) -> dict[str, bytes]:
    """Every output file but the checkpoints and the output lock, by path: what a run that trains nothing keeps."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and "checkpoints" not in p.parts and p.name != ".conveyor.lock"}


def test_a_finished_run_run_again_rewrites_none_of_its_outputs(tmp_path, monkeypatch, capsys):
    first, _, _ = run(tmp_path, monkeypatch)
    before = output_files(tmp_path)
    assert "summary.json" in before and any(name.startswith("trace") for name in before)
    summary, seen, _ = run(tmp_path, monkeypatch)
    assert "this job already finished" in capsys.readouterr().err and seen == {}
    assert output_files(tmp_path) == before  # summary, traces, metrics, plots: byte for byte
    assert summary["samples_per_second"] == first["samples_per_second"] and summary["steps_this_run"] == 0


def nan_at(step: int, calls: list[int] | None = None):
    """cross_entropy, NaN at the `step`-th call (a bad batch, a flaky device)."""
    calls = [0] if calls is None else calls

    def loss_fn(outputs, targets):
        calls[0] += 1
        loss = nn.functional.cross_entropy(outputs, targets)
        return loss * float("nan") if calls[0] == step else loss

    return loss_fn


def fit_with(out: Path, monkeypatch, loss_fn, **options):
    job = make_job(out, monkeypatch)
    model, opt = job.prepare(*make_model())
    options = {"epochs": 2, "checkpoint_every_steps": 3, "log_every_steps": 2, "progress": False, **options}
    trainer = Trainer(job, model, opt, loss_fn, data(), **options)
    return trainer, trainer.fit


def test_a_nan_loss_stops_the_run_naming_step_and_worker_and_keeps_the_finite_checkpoint(tmp_path, monkeypatch):
    from conveyor.errors import ConveyorError

    trainer, fit = fit_with(tmp_path, monkeypatch, nan_at(5), keep_checkpoints=1)
    with pytest.raises(ConveyorError, match=r"step 5: worker 0's training loss is nan") as caught:
        fit()
    assert type(caught.value).__name__ == "NonfiniteError" and caught.value.usage_error
    assert "nonfinite='skip'" in str(caught.value)
    assert not (tmp_path / "summary.json").exists()  # no "job finished" with ruined parameters
    mgr = CheckpointManager(tmp_path / "checkpoints")
    assert mgr.list_steps() == [3] and mgr.load(3).extra["finite"] is True
    assert all(torch.isfinite(t).all() for t in mgr.load(3).trees["model"].values())


def test_skip_drops_the_batch_with_a_nan_loss_and_trains_on(tmp_path, monkeypatch):
    trainer, fit = fit_with(tmp_path, monkeypatch, nan_at(5), nonfinite="skip")
    with pytest.warns(UserWarning, match=r"step 5: worker 0's loss is not finite; its batch is skipped"):
        summary = fit()
    assert summary["steps"] == 10
    assert all(torch.isfinite(p).all() for p in trainer.module.parameters())


def test_the_nonfinite_policy_is_validated(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"nonfinite must be one of \['stop', 'skip'\]"):
        fit_with(tmp_path, monkeypatch, nn.functional.cross_entropy, nonfinite="ignore")


SHORT_SHARD = r'''
import os, sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import conveyor
from conveyor.data import Dataset
from conveyor.train.trainer import Trainer

out = Path(sys.argv[1])
job = conveyor.init()
rng = np.random.default_rng(0)
n = 32 if job.rank == 0 else 8  # worker 1: 2 batches of 4, then zero-weight steps 3..8 (whole log windows)
x = rng.normal(size=(n, 4)).astype(np.float32)
y = (x[:, 1] > 0).astype(np.int64)
torch.manual_seed(0)
linear = nn.Linear(4, 2)
model, opt = job.prepare(linear, torch.optim.SGD(linear.parameters(), lr=0.05))
Trainer(job, model, opt, nn.functional.cross_entropy,
        Dataset.from_tensor_slices((x, y)).batch(4), epochs=1, log_every_steps=2, progress=False).fit()
job.shutdown()
sys.stdout.flush()
os._exit(0)
'''


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_worker_with_zero_weight_steps_only_since_the_last_record_still_takes_part_in_it(tmp_path):
    # Its log window was empty, so it skipped the record's all-reduce that the other worker made: the next
    # collectives met out of order and gloo aborted the job ("16 vs 4"), every restart alike (issue 19's goodput
    # run, after a loss left 3 workers over 8 files).
    script = tmp_path / "worker.py"
    script.write_text(SHORT_SHARD)
    codes, logs = _two_workers(script, tmp_path)
    assert codes == [0, 0], logs
    train = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    assert [(r["step"], r["samples"], r["workers"]) for r in train] == [(2, 16, 2), (4, 8, 2), (6, 8, 2),
                                                                           (8, 8, 2)]
