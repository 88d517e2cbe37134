"""`conveyor checkpoint export` and `conveyor checkpoint show`: Hugging Face-style files from every strategy's
checkpoints, loaded strictly in one plain process, and the listing of a run's steps.

The multi-process tests run `export_job.py` (beside this file) under `conveyor run` with allreduce,
ps-sync, ps-async (2 ps tasks, which split its 4.26 MB weight between them) and the pipeline (2 stages),
export the last step and compare what the loaded model computes with what the run saved (fsdp:
tests/strategies/test_fsdp.py). The rest builds checkpoint folders with `CheckpointManager` in this process.

    pytest tests/train/test_export.py -m "not multiprocess"     # seconds
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from conveyor.cli.main import main
from conveyor.train.checkpoint import CheckpointManager
from conveyor.train.checkpoint.export import INDEX, export_model, parse_size, plan_shards
from conveyor.train.checkpoint.show import describe, format_text
from conveyor.train.checkpoint.sources import Entry

sys.path.insert(0, str(Path(__file__).parent))
import export_job  # noqa: E402  (the job's model and data, for the reference in this process)

JOB = Path(__file__).parent / "export_job.py"
_FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (as language models tie them), and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 50, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.embed(ids))) * self.scale)


def load_export(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export as `transformers` finds them: model.safetensors, or each shard the index names."""
    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    index = json.loads((folder / INDEX).read_text())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(str(folder / file))
        assert all(index["weight_map"][k] == file for k in part), f"{file} holds tensors the index puts elsewhere"
        state.update(part)
    assert set(state) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    return state


def saved_run(root: Path, steps: tuple[int, ...] = (2, 4)) -> tuple[nn.Module, Path]:
    """A run folder whose checkpoints hold a `Tied` model (as the Trainer's allreduce/local chief writes it)."""
    torch.manual_seed(0)
    model = Tied()
    mgr = CheckpointManager(root / "checkpoints", keep=None, fsync=False)
    for step in steps:
        with torch.no_grad():
            model.mid.bias.add_(step)
        mgr.save(step, {"model": model.state_dict(), "optimizer": {"lr": 0.1}},
                 extra={"epoch": step // 2, "strategy": "allreduce", "world_size": 2})
    return model, root


# -- in this process ------------------------------------------------------------------------------------------------


def test_sizes_parse_as_hugging_face_counts_them() -> None:
    assert parse_size("5GB") == 5_000_000_000 and parse_size("500MB") == 500_000_000
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5kb") == 1500 and parse_size(1234) == 1234
    for bad in ("", "5XB", "-1MB", "0"):
        with pytest.raises(ValueError, match="such as 5GB"):
            parse_size(bad)


def test_shards_are_split_as_huggingface_hub_splits_them() -> None:
    """huggingface_hub's docstring example: [6, 6, 2, 6, 2, 2] GB at 10 GB -> [6], [6+2], [6+2+2]; larger alone."""
    entries = [Entry(f"t{i}", (n,), torch.uint8, lambda: None) for i, n in enumerate([6, 6, 2, 6, 2, 2])]
    assert [[e.nbytes for e in s] for s in plan_shards(entries, 10)] == [[6], [6, 2], [6, 2, 2]]
    big = [Entry("a", (3,), torch.uint8, lambda: None), Entry("b", (20,), torch.uint8, lambda: None),
           Entry("c", (4,), torch.uint8, lambda: None)]
    assert [[e.name for e in s] for s in plan_shards(big, 10)] == [["b"], ["a", "c"]]
    assert plan_shards([], 10) == [[]]


@pytest.mark.parametrize("limit", ["5GB", "2kB"])
def test_tied_weights_export_in_one_file_or_shards_and_load_strictly(tmp_path: Path, limit: str) -> None:
    trained, run = saved_run(tmp_path / "run")
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(run), "--to", str(out), "--max-shard-size", limit]) == 0
    files = sorted(p.name for p in out.iterdir())
    if limit == "5GB":
        assert files == ["model.safetensors"]
    else:  # 50x16 float32 = 3.2 kB each for embed and out: over 2 kB, so each alone; the rest together, last
        assert files == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)] + [INDEX], files
        weight_map = json.loads((out / INDEX).read_text())["weight_map"]
        assert weight_map["embed.weight"] == files[0] and weight_map["out.weight"] == files[1]
        assert weight_map["mid.weight"] == weight_map["mid.bias"] == weight_map["scale"] == files[2]
        with safe_open(str(out / files[0]), framework="pt") as f:
            assert f.metadata()["format"] == "pt"  # transformers refuses a safetensors file without it
    fresh = Tied()
    fresh.load_state_dict(load_export(out), strict=True)
    ids = torch.arange(12).reshape(3, 4)
    assert torch.equal(fresh(ids), trained(ids))
    assert fresh.out.weight is fresh.embed.weight, "loading keeps the model's own tie"


def test_an_existing_folder_is_refused_without_force_and_with_it_old_export_files_go(tmp_path: Path, capsys) -> None:
    _, run = saved_run(tmp_path / "run")
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(run), "--to", str(out), "--max-shard-size", "2kB"]) == 0
    (out / "README.md").write_text("the user's own file")
    assert main(["checkpoint", "export", str(run), "--to", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} exists" in err and "--force" in err, err
    assert len(list(out.glob("model-*.safetensors"))) == 3, "a refused export changes nothing"
    assert main(["checkpoint", "export", str(run), "--to", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"], "no stale shard or index"


def test_a_missing_step_names_the_steps_there_are(tmp_path: Path, capsys) -> None:
    _, run = saved_run(tmp_path / "run")
    (run / "checkpoints" / "step-00000004" / "COMPLETE").unlink()  # a step whose writer died before sealing it
    assert main(["checkpoint", "export", str(run), "--to", str(tmp_path / "x"), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "no step 3" in err and "complete steps are [2]" in err and "incomplete, unusable: [4]" in err, err
    assert main(["checkpoint", "export", str(run), "--to", str(tmp_path / "x"), "--step", "4"]) == 2
    assert "no step 4" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(run), "--to", str(tmp_path / "x")]) == 0, "the latest complete: 2"
    assert torch.equal(load_file(str(tmp_path / "x" / "model.safetensors"))["mid.bias"],
                       CheckpointManager(run / "checkpoints").load(2).trees["model"]["mid.bias"])


def test_a_damaged_part_is_refused_naming_the_file(tmp_path: Path, capsys) -> None:
    _, run = saved_run(tmp_path / "run")
    part = run / "checkpoints" / "step-00000004" / "model.safetensors"
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the sha256 can tell
    part.write_bytes(bytes(data))
    assert main(["checkpoint", "export", str(run), "--to", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"{part}: damaged" in err and "sha256" in err, err
    assert not (tmp_path / "x").exists(), "nothing is written from a damaged step"


def test_a_folder_that_is_no_run_is_named(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes").mkdir()
    for action in (["export", str(tmp_path / "notes"), "--to", str(tmp_path / "x")], ["show", str(tmp_path / "notes")],
                   ["show", str(tmp_path / "absent")]):
        assert main(["checkpoint", *action]) == 2
        err = capsys.readouterr().err
        assert "is not a run or checkpoint folder" in err or "is not a folder" in err, err
        assert "output folder" in err, err
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)  # a run that has not saved yet
    assert main(["checkpoint", "show", str(tmp_path / "fresh")]) == 2
    assert "holds no checkpoint yet" in capsys.readouterr().err


def test_show_lists_steps_items_sizes_strategy_and_leftovers(tmp_path: Path, capsys) -> None:
    _, run = saved_run(tmp_path / "run", steps=(2, 4, 6))
    root = run / "checkpoints"
    (root / "step-00000006" / "COMPLETE").unlink()
    (root / ".tmp-step-00000008-abcd").mkdir()
    (root / ".parts-step-00000008").mkdir()
    info = describe(run)
    assert [s["step"] for s in info["steps"]] == [2, 4, 6] and info["latest"] == 4
    two, four, six = info["steps"]
    assert two["complete"] and not two["latest"] and four["latest"] and not six["complete"]
    assert "no COMPLETE marker" in six["why"]
    assert four["strategy"] == "allreduce" and four["world"] == {"workers": 2} and four["epoch"] == 2
    model_bytes = (root / "step-00000004" / "model.safetensors").stat().st_size
    assert four["items"]["model"] == model_bytes + (root / "step-00000004" / "model.json").stat().st_size
    assert set(four["items"]) == {"model", "optimizer"} and four["size"] > sum(four["items"].values())
    assert four["written"].endswith("UTC")
    assert [x["name"] for x in info["leftovers"]] == [".parts-step-00000008", ".tmp-step-00000008-abcd"]
    assert all("incomplete" in x["what"] for x in info["leftovers"])
    text = format_text(info)
    assert "step 4 (sealed, complete, latest): epoch 2, strategy allreduce, 2 worker(s)" in text, text
    assert "step 6: INCOMPLETE, unusable" in text and ".tmp-step-00000008-abcd: a step being written" in text
    assert main(["checkpoint", "show", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == info


# -- every strategy's checkpoints, from real runs ---------------------------------------------------------------


def conveyor_run(out: Path, *flags: str, workers: int = 2) -> None:
    from taskrun import launcher_var  # keeps the quick exit and the port range (tests/taskrun.py)

    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not launcher_var(k)}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "conveyor.cli.main", "run", "-n", str(workers), *flags, "--output-dir",
                           str(out), "--timeout", "120", str(JOB)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("flags", "shape"), [
    ((), {"workers": 2}),
    (("--strategy", "ps-sync", "--ps", "2"), {"workers": 2, "ps_tasks": 2}),
    (("--strategy", "ps-async", "--ps", "2"), {"workers": 2, "ps_tasks": 2}),
    (("--strategy", "pipeline", "--stages", "2"), {"workers": 2, "stages": 2, "replicas": 1}),
    (("--strategy", "pipeline", "--stages", "2", "--shard-stages"),
     {"workers": 4, "stages": 2, "replicas": 2, "shards_per_stage": 2}),
], ids=["allreduce", "ps-sync", "ps-async", "pipeline", "pipeline-sharded"])
def test_every_strategys_checkpoint_exports_a_model_that_computes_what_the_run_trained(
        tmp_path: Path, flags: tuple[str, ...], shape: dict) -> None:
    conveyor_run(tmp_path / "run", *flags, workers=shape["workers"])
    info = describe(tmp_path / "run")
    last = info["steps"][-1]
    assert last["complete"] and last["latest"] and last["world"] == shape, info
    assert last["strategy"] == (flags[1] if flags else "allreduce")
    # 2 MB: the 4.26 MB first weight alone in a shard, the rest in another (ps: joined from both ps tasks' pieces)
    export_model(tmp_path / "run", tmp_path / "export", max_shard_size=2_000_000)
    weight_map = json.loads((tmp_path / "export" / INDEX).read_text())["weight_map"]
    model = export_job.make_model()
    assert set(weight_map) == set(model.state_dict()) and len(set(weight_map.values())) == 2, weight_map
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the reference's own values must not be what a test of the loaded ones sees
    model.load_state_dict(load_export(tmp_path / "export"), strict=True)
    model.eval()
    saved = json.loads((tmp_path / "run" / "probe.json").read_text())
    with torch.no_grad():
        if "outputs" in saved:  # the chief held the whole model: its outputs at the end of the run
            # ps-async: the trainer's end of run pulls after every worker's last commit (_PSStep.finish), so these
            # are the servers' final state, which the checkpoint's shards hold (without it, 1 run in 3 differed)
            assert torch.equal(model(export_job.probe()), torch.tensor(saved["outputs"]))
        else:  # pipeline stages: the eval figures the last stage computed with the trained stages
            x, y = export_job.data()
            outputs = model(x[:16])
            loss = nn.functional.cross_entropy(outputs, y[:16]).item()
            # 2 replicas: each evaluates its half and the sums are added, in float32 another order than one mean
            rel = 1e-5 if shape.get("replicas", 1) > 1 else 1e-6
            assert loss == pytest.approx(saved["eval_loss"], rel=rel, abs=0)
            batch_sums = [outputs[i:i + 8].double().sum().item() for i in (0, 8)]
            assert sum(batch_sums) / 2 == pytest.approx(saved["eval_outsum"], rel=rel, abs=1e-9)


def test_huggingface_hub_splits_and_loads_the_export_alike(tmp_path: Path) -> None:
    """Where huggingface_hub is installed (it is no dependency): its split of the same state dict names the same
    files, and its own loader reads the export strictly. Checked with huggingface_hub 2.4.0."""
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 40), nn.BatchNorm1d(40), nn.Linear(40, 30), nn.Linear(30, 5))
    CheckpointManager(tmp_path / "run" / "checkpoints", fsync=False).save(1, {"model": model.state_dict()})
    export_model(tmp_path / "run", tmp_path / "export", max_shard_size=4000)
    split = hub.split_torch_state_dict_into_shards(model.state_dict(), max_shard_size=4000)
    assert split.is_sharded and json.loads((tmp_path / "export" / INDEX).read_text())["weight_map"] == \
        split.tensor_to_filename
    fresh = nn.Sequential(nn.Linear(30, 40), nn.BatchNorm1d(40), nn.Linear(40, 30), nn.Linear(30, 5))
    hub.load_torch_model(fresh, tmp_path / "export", strict=True)
    x = torch.randn(4, 30)
    assert torch.equal(fresh.eval()(x), model.eval()(x))
