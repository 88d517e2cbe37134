"""Pipeline × FSDP (``--shard-stages``) across real processes (gloo on 127.0.0.1): 2 stages × 2 shards.

Each launch starts this file as a script on 4 processes (``python test_pipeline_sharded.py SCENARIO OUT_DIR``)
with the environment ``conveyor run -n 4 --strategy pipeline --stages 2 --shard-stages`` gives each; every
process writes its stage's whole parameters (gathered from the shards) to JSON, and the tests compare them
with one process training the whole model with Adam on the replicas' combined batch (fp32).

    pytest tests/strategies/test_pipeline_sharded.py -m multiprocess --durations=5
"""

from __future__ import annotations

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


def make_model() -> nn.Module:
    torch.manual_seed(0)  # widths not divisible by 2 on every dim 0: FSDP2's uneven chunks are exercised
    return nn.Sequential(nn.Linear(4, 15), nn.Tanh(), nn.Linear(15, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS * REPLICAS * BATCH, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(len(x), 1, generator=g)


def batches(replica: int):
    """Global batch k is rows [k*R*B, (k+1)*R*B), of which replica r takes its r-th B rows."""
    x, y = make_data()
    for k in range(STEPS):
        rows = slice((k * REPLICAS + replica) * BATCH, (k * REPLICAS + replica + 1) * BATCH)
        yield x[rows], y[rows]


def reference() -> tuple[dict[str, torch.Tensor], nn.Module]:
    model = make_model()
    optimizer = make_optimizer(model)
    x, y = make_data()
    size = REPLICAS * BATCH
    for k in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[k * size:(k + 1) * size]), y[k * size:(k + 1) * size]).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, model


def launch(scenario: str, out: Path, deadline: float = 150.0) -> list[dict | None]:
    out.mkdir(parents=True, exist_ok=True)
    from taskrun import local_job_envs, wait_all  # here: this file also runs as the workers' script, outside pytest

    procs = []
    for rank, env in enumerate(local_job_envs(out, WORLD, "pipeline")):
        env |= {"CONVEYOR_TIMEOUT": "60", "CONVEYOR_PIPELINE_STAGES": str(STAGES),
                "CONVEYOR_PIPELINE_MICROBATCHES": "4", "CONVEYOR_PIPELINE_SHARD_STAGES": "1"}
        log = open(out / f"rank{rank}.log", "wb")  # closed by wait_all
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    wait_all(procs, deadline, f"{scenario}: sharded pipeline processes", lambda: logs(out))
    return [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
            for r in range(WORLD)]


def logs(out: Path) -> str:
    return "\n".join(f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text(errors='replace')[-4000:]}"
                     for r in range(WORLD) if (out / f"rank{r}.log").exists())


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
    job = Path(__file__).resolve().parents[1] / "train" / "export_job.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "4", "--strategy", "pipeline", "--stages", "2",
               "--shard-stages", "--output-dir", str(tmp_path / "out"), "--timeout", "120", str(job)]
    found, said = [], []
    for _ in range(2):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        found.append(json.loads((tmp_path / "out" / "probe.json").read_text()))
        said.append(proc.stdout + proc.stderr)
    parts = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step-*/stage-*-shard-*.safetensors"))
    assert {p[len("stage-0-shard-0"):] for p in parts} == {".safetensors"} and len(parts) % 4 == 0, parts
    assert found[0]["eval_loss"] is not None
    assert found[1] == pytest.approx(found[0], rel=1e-12)
    assert "resumed from" not in said[0] and "resumed from" in said[1], said[1][-3000:]


def test_shard_stages_needs_the_pipeline_strategy_and_two_replicas_per_stage() -> None:
    with pytest.raises(ValueError, match="--shard-stages belong"):
        JobSettings(strategy="allreduce", shard_stages=True).check_job(4)
    with pytest.raises(ValueError, match="nothing to shard it across; run -n 4"):
        JobSettings(strategy="pipeline", stages=2, shard_stages=True).check_job(2)
    JobSettings(strategy="pipeline", stages=2, shard_stages=True).check_job(4)
    JobSettings(strategy="pipeline", stages=2).check_job(2)  # without the flag: one replica is fine


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
    saved = SimpleNamespace(tree=lambda _: header, step=RESUME_AT, path=out,
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


def worker_main(scenario: str, out: Path) -> None:
    run = run_resume if scenario == "resume" else run_train
    with conveyor.init() as job:  # the JSON written inside: the job's rank is this process's
        (out / f"rank{job.rank}.json").write_text(json.dumps(run(job, out)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown


if __name__ == "__main__":
    worker_main(sys.argv[1], Path(sys.argv[2]))
