"""Pipeline × FSDP (``--shard-stages``) across real processes (gloo on 127.0.0.1): 2 stages × 2 shards.

Each launch starts this file as a script on 4 processes (``python test_pipeline_sharded.py SCENARIO OUT_DIR``)
with the environment ``conveyor run -n 4 --strategy pipeline --stages 2 --shard-stages`` gives each; every
process writes its stage's whole parameters (gathered from the shards) to JSON, and the tests compare them
with one process training the whole model with Adam on the replicas' combined batch (fp32). The resume on
another replica count launches 6 (2 × 3) on the checkpoint of 4; the kill -9 test runs sharded_pipeline_job.py
under ``conveyor run`` itself, with the test-only fault hook (``CONVEYOR_FAULT``), and the resume on another ``-n``
runs it under ``conveyor run -n 4``, stopped, then ``-n 6``, against one process on the batches its id logs name.

    pytest tests/strategies/test_pipeline_sharded.py -m multiprocess --durations=5
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from conveyor.cluster.settings import JobSettings

BATCH = 8  # per replica
STEPS = 6
RESUME_AT = 3
WORLD, STAGES, REPLICAS = 4, 2, 2
RESHARD_ROWS = 24  # rows per step of the resume on 3 replicas: 12 per replica on 2, 8 on 3 (4 microbatches each)
ROOT = Path(__file__).resolve().parents[2]


def make_model() -> nn.Module:
    torch.manual_seed(0)  # widths not divisible by 2 on every dim 0: FSDP2's uneven chunks are exercised
    return nn.Sequential(nn.Linear(4, 15), nn.Tanh(), nn.Linear(15, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def make_data(rows: int = STEPS * REPLICAS * BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(len(x), 1, generator=g)


def batches(replica: int, replicas: int = REPLICAS, batch: int = BATCH):
    """Global batch k is rows [k*R*B, (k+1)*R*B), of which replica r takes its r-th B rows."""
    x, y = make_data(STEPS * replicas * batch)
    for k in range(STEPS):
        rows = slice((k * replicas + replica) * batch, (k * replicas + replica + 1) * batch)
        yield x[rows], y[rows]


def reference(size: int = REPLICAS * BATCH) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """One process training the whole model on the replicas' combined batches of `size` rows."""
    model = make_model()
    optimizer = make_optimizer(model)
    x, y = make_data(STEPS * size)
    for k in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[k * size:(k + 1) * size]), y[k * size:(k + 1) * size]).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, model


def launch(scenario: str, out: Path, deadline: float = 150.0, world: int = WORLD) -> list[dict | None]:
    out.mkdir(parents=True, exist_ok=True)
    from sharded_helpers import WORKER_PATH
    from taskrun import local_job_envs, wait_all  # here: this file also runs as the workers' script, outside pytest

    procs = []
    for rank, env in enumerate(local_job_envs(out, world, "pipeline")):
        env |= {"PYTHONPATH": WORKER_PATH, "CONVEYOR_TIMEOUT": "60", "CONVEYOR_PIPELINE_STAGES": str(STAGES),
                "CONVEYOR_PIPELINE_MICROBATCHES": "4", "CONVEYOR_PIPELINE_SHARD_STAGES": "1"}
        log = open(out / f"rank{rank}.log", "wb")  # closed by wait_all
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    wait_all(procs, deadline, f"{scenario}: sharded pipeline processes", lambda: logs(out))
    return [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
            for r in range(world)]


def logs(out: Path) -> str:
    return "\n".join(f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text(errors='replace')[-4000:]}"
                     for r in range(8) if (out / f"rank{r}.log").exists())


def merged(results: list[dict | None], replica: int, key: str = "params") -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for r in results[replica * STAGES:(replica + 1) * STAGES]:
        assert r is not None
        state |= {k: torch.tensor(v) for k, v in r[key].items()}
    return state


def assert_equal_to(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert torch.allclose(state[key], value, rtol=0, atol=atol), (key, (state[key] - value).abs().max())


def launched_equal_to_one_process(scenario: str, out: Path) -> tuple[list[dict], dict, nn.Module]:
    """SCENARIO's results, checked: every replica's stages hold what one process trained on the whole batch."""
    results = launch(scenario, out)
    assert all(r is not None for r in results), logs(out)
    expected, model = reference()
    for replica in range(REPLICAS):
        assert_equal_to(merged(results, replica), expected)
    return results, expected, model


def conveyor_run(script: Path, out: Path, *flags: str, env: dict[str, str] | None = None, processes: int = 4,
                 args: tuple[str, ...] = (), fails: bool = False) -> str:
    """`conveyor run -n PROCESSES --strategy pipeline --stages 2 --shard-stages FLAGS --output-dir OUT SCRIPT ARGS`
    in a clean environment (no launcher's variables, no GPU, one thread a process); its output, once it succeeded
    (or, with ``fails``, once it failed)."""
    from taskrun import launcher_var  # keeps the quick exit and the port range (tests/taskrun.py)

    clean = {k: v for k, v in os.environ.items() if not launcher_var(k)
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")}
    clean.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {}))
    command = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(processes), "--strategy", "pipeline",
               "--stages", "2", "--shard-stages", "--output-dir", str(out), "--timeout", "120", *flags, str(script),
               *args]
    proc = subprocess.run(command, env=clean, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert (proc.returncode != 0) == fails, said[-4000:]
    return said


def final_step(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's last checkpoint (the chief's trees and every process's shard part), by file."""
    from safetensors.torch import load_file

    step = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert (step / "COMPLETE").is_file(), step
    return {f"{step.name}/{p.name}:{k}": v for p in sorted(step.glob("*.safetensors")) for k, v in load_file(p).items()}


# -- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_stages_by_two_shards_equal_one_process_with_adam(tmp_path: Path) -> None:
    results, expected, _ = launched_equal_to_one_process("train", tmp_path)
    assert not torch.allclose(expected["0.weight"], make_model().state_dict()["0.weight"]), "training must move it"
    # each process holds its dim-0 chunk only: 15 rows of layer 0 as 8 + 7, 16 rows of layer 2 as 8 + 8
    assert results[0]["local"]["0.weight"] == [8, 4] and results[2]["local"]["0.weight"] == [7, 4]
    assert results[1]["local"]["2.weight"] == [8, 15] and results[3]["local"]["2.weight"] == [8, 15]
    assert results[0]["losses"] == pytest.approx(results[1]["losses"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_resume_from_the_shard_parts_ends_where_the_uninterrupted_run_ends_and_evaluates(tmp_path: Path) -> None:
    # RESUME_AT steps, a restore into a fresh model and optimizer, the rest: as the uninterrupted run
    results, expected, model = launched_equal_to_one_process("resume", tmp_path)
    for replica in range(REPLICAS):
        # the same from a part of unsharded stages (as without --shard-stages): re-split into this job's shards
        assert_equal_to(merged(results, replica, "from_whole"), expected)
    parts = {r["part"] for r in results}
    assert parts == {"stage-0-shard-0", "stage-1-shard-0", "stage-0-shard-1", "stage-1-shard-1"}
    header = results[0]["header"]
    assert header["shards"] == 2 and header["sharded"][1] == {"2.weight": [16, 15], "2.bias": [16],
                                                              "4.weight": [1, 16], "4.bias": [1]}
    with torch.no_grad():
        want = model.eval()(make_data()[0][:6])
    for r in results:  # the last stage of each replica gives the outputs; the first gives None
        if r["stage"] == 0:
            assert r["outputs"] is None
        else:
            assert torch.allclose(torch.tensor(r["outputs"]), want, rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_trainer_run_resumes_its_shard_parts_from_disk_and_evaluates_alike(tmp_path: Path) -> None:
    """tests/train/export_job.py (a Trainer with checkpoints and evaluation, a BatchNorm's buffers) under
    `conveyor run -n 4 --strategy pipeline --stages 2 --shard-stages`, then again on the same output folder: the
    second run restores every process's shard part from disk, trains nothing and evaluates as the first ended."""
    found, said = [], []
    for _ in range(2):
        said.append(conveyor_run(ROOT / "tests" / "train" / "export_job.py", tmp_path / "out"))
        found.append(json.loads((tmp_path / "out" / "probe.json").read_text()))
    parts = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step-*/stage-*-shard-*.safetensors"))
    assert {p[len("stage-0-shard-0"):] for p in parts} == {".safetensors"} and len(parts) % 4 == 0, parts
    assert found[0]["eval_loss"] is not None
    assert found[1] == pytest.approx(found[0], rel=1e-12)
    assert "resumed from" not in said[0] and "resumed from" in said[1], said[1][-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shard_killed_mid_run_restarts_from_its_checkpoint_and_ends_bit_identical(tmp_path: Path) -> None:
    """sharded_pipeline_job.py (a Trainer, 12 steps, a checkpoint every 4) on 2 stages x 2 shards, uninterrupted and
    with worker 3 (stage 1's shard 1) killed by SIGKILL after step 6: the launcher restarts the job, which resumes
    from step 4, and its last checkpoint equals the uninterrupted run's bit for bit. On CPU with gloo every step is
    deterministic: the same shards, microbatches and reduce-scatter order on both runs."""
    job = ROOT / "tests" / "strategies" / "sharded_pipeline_job.py"
    conveyor_run(job, tmp_path / "want")
    said = conveyor_run(job, tmp_path / "got", "--max-restarts", "1", "--restart-delay", "0",
                        env={"CONVEYOR_FAULT": "worker:3:after-step:6"})
    assert "conveyor fault: SIGKILL at after-step step 6" in said, said[-3000:]
    summary = json.loads((tmp_path / "got" / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 4, summary
    got, want = final_step(tmp_path / "got"), final_step(tmp_path / "want")
    assert got.keys() == want.keys() and any("stage-1-shard-1.safetensors" in k for k in got), sorted(got)[:8]
    assert sorted(got)[0].startswith("step-00000012/"), sorted(got)[:2]
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{name} differs from the uninterrupted run"


def applied_steps(out: Path, kept: dict[str, int | None]) -> list[tuple[str, int, int, list[list[int]]]]:
    """(run, epoch, step, each replica's ids) of every step that stayed in the model, in order: sharded_pipeline_job's
    id logs of the first stages' processes (ranks 0, 2, ...), a run's steps after its `kept` step left out (undone)."""
    steps: dict[tuple[str, int], tuple[int, list[list[int]]]] = {}
    for log in sorted(out.glob("ids-*.jsonl")):
        if int(log.stem.split("-")[1]) % STAGES == 0:
            for e in map(json.loads, log.read_text().splitlines()):
                if kept[e["run"]] is None or e["step"] <= kept[e["run"]]:
                    steps.setdefault((e["run"], e["step"]), (e["epoch"], []))[1].append(e["ids"])
    return [(run, epoch, step, ids) for (run, step), (epoch, ids) in sorted(steps.items(), key=lambda i: i[0][1])]


def one_process_on(steps: list[tuple[int, list[list[int]]]]) -> dict[str, torch.Tensor]:
    """One process taking `steps` (the job's replica count, each replica's ids) on the job's data: each step's
    loss the replicas' mean of their batch-mean losses (a replica with no batch adds zero, as a zero-weight step)."""
    model = make_model()
    optimizer = make_optimizer(model)
    x, y = make_data()
    for replicas, batches in steps:
        optimizer.zero_grad()
        sum(nn.functional.mse_loss(model(x[ids]), y[ids]) for ids in batches).div(replicas).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_conveyor_run_of_two_replicas_resumed_on_three_reads_each_record_once_and_ends_as_one_process(
        tmp_path: Path) -> None:
    """sharded_pipeline_job.py under `conveyor run -n 4 --shard-stages` (2 stages x 2 replicas) checkpoints at step 4
    and stops after step 5; `conveyor run -n 6` (2 x 3) resumes it. The chief says the data and the shards were
    redistributed; the 32 records the first epoch had left (16 per old replica) are dealt over the 3 replicas and
    reach the model once each, as every record of the second epoch; the last checkpoint holds each stage's 3 shard
    parts, and exported whole it equals one process taking the same steps on the same batches (Adam, fp32)."""
    job, out = ROOT / "tests" / "strategies" / "sharded_pipeline_job.py", tmp_path / "out"
    # microbatches of 1 (under GPipe: 1F1B wants one per stage at least): the redistributed epoch has batches of 3
    flags = ("--schedule", "gpipe", "--microbatches", "1", "--max-restarts", "0")
    stopped = conveyor_run(job, out, *flags, args=("--run", "first", "--stop-at", "5"), fails=True)
    assert "exited with status 3" in stopped, stopped[-3000:]
    conveyor_run(job, out, *flags, processes=6, args=("--run", "second"))
    said = (out / "logs" / "worker-0.log").read_text()
    assert ("resumed step 4, written by 4 workers, on 6 workers: data and shards redistributed (each stage's 2 "
            "shards re-split into 3)\n") in said, said[-3000:]
    steps = applied_steps(out, {"first": 4, "second": None})
    assert [(run, epoch, step, len(ids)) for run, epoch, step, ids in steps][3:6] == [
        ("first", 0, 4, 2), ("second", 0, 5, 3), ("second", 0, 6, 3)], steps  # the leftover: 2 steps, 3 replicas
    for epoch in (0, 1):  # the redistributed epoch, then one of the 3 replicas' own shards
        counts = collections.Counter(i for _, e, _, ids in steps if e == epoch for batch in ids for i in batch)
        assert sorted(counts) == list(range(STEPS * REPLICAS * BATCH)), (epoch, sorted(counts))
        assert set(counts.values()) == {1}, (epoch, [i for i, c in counts.items() if c > 1])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"], summary["world_size"]) == (len(steps), 4, 6), summary
    last = out / "checkpoints" / f"step-{len(steps):08d}"
    assert (last / "COMPLETE").is_file() and sorted(p.name for p in last.glob("stage-*.safetensors")) == [
        f"stage-{s}-shard-{r}.safetensors" for s in range(STAGES) for r in range(3)], sorted(last.iterdir())
    from safetensors.torch import load_file

    from conveyor.train.checkpoint.export import export_model

    (path,) = export_model(out, tmp_path / "whole")  # every stage's 3 shards joined
    got = load_file(path)
    assert all(torch.isfinite(v).all() for v in got.values())
    assert_equal_to(got, one_process_on([({"first": REPLICAS, "second": 3}[run], ids) for run, _, _, ids in steps]))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shards_of_two_replicas_resume_on_three_with_the_same_whole_state_and_train_on(tmp_path: Path) -> None:
    """2 stages x 2 shards train RESUME_AT steps and commit a checkpoint; 2 stages x 3 shards (6 processes, other
    starting parameters) restore it as the Trainer does: each stage's shards re-split. The whole state (every
    stage's parameters and Adam state, gathered) equals the saved one bit for bit, and the rest of the steps end
    where one process training on the combined batches ends. Model side only: a `conveyor run` resume on another
    `-n`, through the Trainer and its data, is the test above."""
    from safetensors.torch import load_file

    saved = launch("reshard-save", tmp_path / "save")
    assert all(r is not None for r in saved), logs(tmp_path / "save")
    loaded = launch("reshard-load", tmp_path / "load", deadline=300.0, world=6)
    assert all(r is not None for r in loaded), logs(tmp_path / "load")
    for stage in range(STAGES):
        before = load_file(tmp_path / "save" / f"whole-stage{stage}.safetensors")
        after = load_file(tmp_path / "load" / f"whole-stage{stage}.safetensors")
        assert before.keys() == after.keys() and any(k.endswith("/exp_avg_sq") for k in before), sorted(before)
        for key in before:
            assert torch.equal(before[key], after[key]), (stage, key)
    log = (tmp_path / "load" / "rank0.log").read_text()
    assert (f"resumed step {RESUME_AT}, written by 4 workers, on 6 workers: shards redistributed (each stage's 2 "
            f"shards re-split into 3)") in log, log[-3000:]
    assert [r["local"]["0.weight"] for r in loaded[0::STAGES]] == [[5, 4], [5, 4], [5, 4]]  # 15 rows as 5 + 5 + 5
    expected, _ = reference(RESHARD_ROWS)
    for replica in range(3):
        assert_equal_to(merged(loaded, replica), expected)


def test_shard_stages_needs_the_pipeline_strategy_and_two_replicas_per_stage() -> None:
    with pytest.raises(ValueError, match="--shard-stages belong"):
        JobSettings(strategy="allreduce", shard_stages=True).check_job(4)
    with pytest.raises(ValueError, match="nothing to shard it across; run -n 4"):
        JobSettings(strategy="pipeline", stages=2, shard_stages=True).check_job(2)
    JobSettings(strategy="pipeline", stages=2, shard_stages=True).check_job(4)
    JobSettings(strategy="pipeline", stages=2).check_job(2)  # without the flag: one replica is fine


def test_a_sharded_checkpoint_resumed_without_shard_stages_is_refused_naming_the_fix() -> None:
    """`-n 2` (one replica a stage) cannot take --shard-stages, so a checkpoint of -n 4 --shard-stages resumed there
    is refused (as a resume on any job without the flag), naming the flag and the export."""
    from types import SimpleNamespace

    from conveyor.strategies.pipeline.checkpoint import CHECKPOINT_FORMAT, StagesItem
    from conveyor.strategies.pipeline.split import plan_split

    plan = plan_split(make_model(), stages=STAGES)
    strategy = SimpleNamespace(_plan=lambda: plan, shard_stages=False)
    header = {"format": CHECKPOINT_FORMAT, "split": plan.signature(), "replicas": 2, "shards": 2}
    with pytest.raises(ValueError, match=r"written with --shard-stages \(each stage in 2 FSDP shards\) and this job "
                                         r"does not shard its stages: resume with --shard-stages .*conveyor checkpoint "
                                         r"export"):
        StagesItem(strategy, optimizer=None).restore("optimizer", SimpleNamespace(tree=lambda name: header))


def test_shard_stages_reaches_the_tasks_as_its_variable() -> None:
    settings = JobSettings(strategy="pipeline", stages=2, shard_stages=True)
    env = settings.environ()
    assert env["CONVEYOR_PIPELINE_SHARD_STAGES"] == "1"
    assert JobSettings.from_environ(env) == settings
    assert "CONVEYOR_PIPELINE_SHARD_STAGES" not in JobSettings(strategy="pipeline", stages=2).environ()


# -- the workers --------------------------------------------------------------------------------------------------


def whole_params(model) -> tuple[dict, dict]:
    """The stage's whole parameters (gathered from the stage's shards: a collective) and this process's shapes."""
    from torch.distributed.tensor import DTensor

    state = model.model_state_dict()
    whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist() for k, v in state.items()}
    local = {k: list(v.to_local().shape) for k, v in state.items() if isinstance(v, DTensor)}
    return whole, local


def run_train(job, out: Path) -> dict:
    model = make_model()
    model, optimizer = job.prepare(model, make_optimizer(model))
    _, replica = job.data_shard
    losses = [float(job.train_step(model, optimizer, nn.functional.mse_loss, x, y)) for x, y in batches(replica)]
    params, local = whole_params(model)
    return {"params": params, "local": local, "losses": losses, "stage": job.strategy.stage}


def gathered(tree):
    """``tree`` with every DTensor gathered whole (a collective over the stage's replicas)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {k: gathered(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [gathered(v) for v in tree]
    return tree


def resumed(job, out: Path, header: dict, name: str, part: dict) -> tuple[object, dict]:
    """A fresh model and optimizer restored from part ``name`` under ``header``, trained for the rest of the steps."""
    from types import SimpleNamespace

    model = make_model()
    model, optimizer = job.prepare(model, make_optimizer(model))
    saved = SimpleNamespace(tree=lambda _: header, step=RESUME_AT, path=out, reworld=[],  # the resume line's parts
                            part_tree=lambda asked: part if asked == name else pytest.fail("read " + asked))
    job.strategy.checkpoint_items(model, optimizer)["optimizer"].restore("optimizer", saved)
    for x, y in list(batches(job.data_shard[1]))[RESUME_AT:]:
        job.train_step(model, optimizer, nn.functional.mse_loss, x, y)
    return model, whole_params(model)[0]


def run_resume(job, out: Path) -> dict:
    """RESUME_AT steps, a checkpoint (the bytes of this process's part and the chief's header); a fresh model and
    optimizer restored from it train the rest of the steps, and another from this stage's whole state as a job
    without --shard-stages writes it; then a forward-only pass (evaluation)."""
    from conveyor.train.checkpoint import StepWrite
    from conveyor.train.state_io import state_from_bytes

    strategy, replica = job.strategy, job.data_shard[1]
    model = make_model()
    model, optimizer = job.prepare(model, make_optimizer(model))
    for x, y in list(batches(replica))[:RESUME_AT]:
        job.train_step(model, optimizer, nn.functional.mse_loss, x, y)
    step = StepWrite(RESUME_AT, is_chief=True, root=out)  # every process records the chief's header too
    strategy.checkpoint_items(model, optimizer)["optimizer"].save("optimizer", step)
    mine = f"stage-{strategy.stage}-shard-{replica}"
    part = state_from_bytes(step.parts[f"{mine}.safetensors"], step.parts[f"{mine}.json"])
    header = json.loads(json.dumps(step.trees["optimizer"]))  # as a checkpoint holds it
    whole = {"model": gathered(model.model_state_dict()), "optimizer": gathered(optimizer.state_dict())}
    unsharded = {k: v for k, v in header.items() if k not in ("shards", "sharded")}
    _, from_whole = resumed(job, out, unsharded, f"stage-{strategy.stage}", whole)
    model, params = resumed(job, out, header, mine, part)
    model.eval()
    outputs = strategy.step.eval_forward(model, make_data()[0][:6])
    return {"params": params, "from_whole": from_whole, "stage": strategy.stage, "part": mine, "header": header,
            "outputs": None if outputs is None else outputs.tolist()}


def save_whole(job, model, optimizer, out: Path) -> None:
    """Replica 0's process of each stage writes the stage's whole state (parameters gathered from the shards, and
    the optimizer's state likewise: collectives every replica joins) as ``whole-stage<s>.safetensors``."""
    from safetensors.torch import save_file

    state, optim = gathered(model.model_state_dict()), gathered(optimizer.state_dict())
    if job.strategy.replica == 0:
        tensors = {f"model/{k}": v.detach().clone() for k, v in state.items()}
        tensors |= {f"state/{i}/{k}": torch.as_tensor(v).clone() for i, entry in optim["state"].items()
                    for k, v in entry.items()}
        save_file(tensors, str(out / f"whole-stage{job.strategy.stage}.safetensors"))


def run_reshard(job, out: Path, save: bool) -> dict:
    """``save`` (2 replicas): RESUME_AT steps, a committed checkpoint in ``out/../ckpt`` (shared with the load
    launch), the whole state. Else (3 replicas): other parameters, the checkpoint restored, the whole state, the
    rest of the steps. Either on RESHARD_ROWS rows per step, split among the replicas."""
    from conveyor.train.checkpoint import CheckpointManager
    from conveyor.train.resume import restore
    from sharded_helpers import write_step  # on the workers' PYTHONPATH (launch)

    replicas, replica = job.data_shard
    model = make_model()
    if not save:
        with torch.no_grad():  # the restore must overwrite every parameter
            for p in model.parameters():
                p.add_(1.0)
    model, optimizer = job.prepare(model, make_optimizer(model))
    items = job.strategy.checkpoint_items(model, optimizer)
    manager = CheckpointManager(out.parent / "ckpt", fsync=False)
    mine = list(batches(replica, replicas, RESHARD_ROWS // replicas))
    if save:
        for x, y in mine[:RESUME_AT]:
            job.train_step(model, optimizer, nn.functional.mse_loss, x, y)
        write_step(job, items, manager, RESUME_AT)
    else:
        restore(job, manager.load(RESUME_AT), items)  # as the Trainer's resume does
    save_whole(job, model, optimizer, out)
    if not save:
        for x, y in mine[RESUME_AT:]:
            job.train_step(model, optimizer, nn.functional.mse_loss, x, y)
    params, local = whole_params(model)
    return {"params": params, "local": local, "stage": job.strategy.stage}


def worker_main(scenario: str, out: Path) -> None:
    runs = {"resume": run_resume, "reshard-save": lambda job, out: run_reshard(job, out, save=True),
            "reshard-load": lambda job, out: run_reshard(job, out, save=False)}
    run = runs.get(scenario, run_train)
    with conveyor.init() as job:  # the JSON written inside: the job's rank is this process's
        (out / f"rank{job.rank}.json").write_text(json.dumps(run(job, out)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown


if __name__ == "__main__":
    worker_main(sys.argv[1], Path(sys.argv[2]))
