"""fsdp shards written by 2 ranks, loaded by 1 and by 3 (real processes, gloo on 127.0.0.1).

The "save" launch (2 ranks) trains a few Adam steps, writes its per-rank parts through the checkpoint
item and writes the whole model and optimizer state as torch's state-dict helpers give them
(``full_state_dict=True``). Each "load" launch (1 or 3 ranks) starts from other parameters, restores the
step through the item (each rank joins the saved shards and keeps its own chunk) and writes the same
whole state: it must equal the saved one bit for bit. The data side of a resume on another world is
the Trainer's data positions' (not here).

    pytest tests/strategies/test_fsdp_reshard.py -m multiprocess
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

from sharded_helpers import WORKER_PATH, Net, write_step

SAVED_AT = 3
LR = 0.01


def launch(scenario: str, out: Path, world: int) -> list[dict | None]:
    out.mkdir(parents=True, exist_ok=True)
    from taskrun import local_job_envs, wait_all  # here: this file also runs as the workers' script, outside pytest

    procs = []
    for rank, env in enumerate(local_job_envs(out, world, "fsdp")):
        env |= {"PYTHONPATH": WORKER_PATH, "CONVEYOR_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
        log = open(out / f"{scenario}{world}-rank{rank}.log", "wb")  # closed by wait_all
        procs.append((subprocess.Popen([sys.executable, __file__, scenario, str(out)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    wait_all(procs, 120.0, f"{scenario} on {world}: workers", lambda: logs(out))
    return [json.loads(p.read_text()) if (p := out / f"{scenario}{world}-rank{r}.json").exists() else None
            for r in range(world)]


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("*.log")))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp-reshard")
    results = launch("save", out, 2)
    assert all(r is not None and r.get("ok") for r in results), logs(out)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 3])
def test_shards_of_two_ranks_load_into_another_number_with_the_same_whole_state(saved: Path, world: int) -> None:
    results = launch("load", saved, world)
    assert all(r is not None and r.get("ok") for r in results), logs(saved)
    from safetensors.torch import load_file

    before, after = load_file(saved / "whole-2.safetensors"), load_file(saved / f"whole-{world}.safetensors")
    assert before.keys() == after.keys() and any(k.endswith("/exp_avg_sq") for k in before), sorted(before)[:8]
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    groups = {r: json.loads((saved / f"groups-{r}.json").read_text()) for r in (2, world)}
    assert groups[2] == groups[world]
    log = (saved / f"load{world}-rank0.log").read_text()
    assert f"resumed step {SAVED_AT}, written by 2 workers, on {world} workers: shards redistributed" in log, log
    assert [r["embed_rows"] for r in results] == [len(c) for c in torch.arange(5).chunk(world)]  # each its own


# -- the worker side ------------------------------------------------------------------------------------------------


def _whole(job, model: nn.Module, optimizer, out: Path) -> None:
    """Rank 0 writes the whole model and optimizer state (torch's full state dicts) for the test to compare."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if job.rank == 0:
        tensors = {f"model/{k}": v.clone() for k, v in model_state.items()}
        for fqn, entry in optim_state["state"].items():
            tensors.update({f"state/{fqn}/{k}": torch.as_tensor(v).clone() for k, v in entry.items()})
        save_file(tensors, str(out / f"whole-{job.world_size}.safetensors"))
        (out / f"groups-{job.world_size}.json").write_text(json.dumps(optim_state["param_groups"], default=str))


def _scenario(name: str, out: Path) -> dict:
    import conveyor
    from conveyor.train.checkpoint import CheckpointManager
    from conveyor.train.resume import restore

    job = conveyor.init("fsdp")
    torch.manual_seed(0 if name == "save" else 7)
    model = Net(width=5, depth=2)  # 5 rows in the first layer: uneven chunks on 2 and 3 ranks
    model, optimizer = job.prepare(model, torch.optim.Adam(model.parameters(), lr=LR))
    items = job.strategy.checkpoint_items(model, optimizer)
    manager = CheckpointManager(out / "ckpt", fsync=False)
    if name == "save":
        g = torch.Generator().manual_seed(1)
        for _ in range(SAVED_AT):
            x = torch.randn(4, 4, generator=g)[job.rank * 2:job.rank * 2 + 2]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
            optimizer.step()
        write_step(job, items, manager, SAVED_AT)
    else:
        restore(job, manager.load(SAVED_AT), items)  # as the Trainer's resume does: the chief's one line
    _whole(job, model, optimizer, out)
    return {"world": int(job.world_size), "embed_rows": int(model.embed.weight.to_local().shape[0])}


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    result = _scenario(scenario, out_dir)
    task = os.environ.get("CONVEYOR_TASK_INDEX", "0")
    (out_dir / f"{scenario}{result['world']}-rank{task}.json").write_text(json.dumps({"ok": True, **result}))
