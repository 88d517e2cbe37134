"""The whole model of a checkpoint step as one ``model.safetensors`` under its own parameter names.

    export_model("runs/x", to="runs/x-export", step=None, force=False)   # -> runs/x-export/model.safetensors
    model.load_state_dict(safetensors.torch.load_file("runs/x-export/model.safetensors"), strict=True)

Reads the step whatever the strategy that wrote it: the chief's ``model`` tree (local, allreduce, ps),
the pipeline's stage parts (each stage's parameters under whole-model names), or the fsdp shards of
every rank joined (:func:`conveyor.strategies.fsdp.checkpoint.full_model`). ``RUN_DIR`` is a run's
output folder (its ``checkpoints/``) or a checkpoint folder itself. An output folder that exists is
refused without ``force``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from conveyor.train.checkpoint.read import Checkpoint, CheckpointError
from conveyor.train.checkpoint.store import CheckpointReader

__all__ = ["export_model", "model_state"]


def model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The whole model's state in checkpoint ``ckpt``, by parameter and buffer name."""
    fsdp = ckpt.trees.get("fsdp")
    if isinstance(fsdp, dict) and fsdp.get("format") == "conveyor.fsdp.shards":
        from conveyor.strategies.fsdp.checkpoint import full_model  # FSDP2 brings in DTensor: only when needed

        return full_model(ckpt, fsdp)
    header = ckpt.trees.get("optimizer")
    if isinstance(header, dict) and header.get("format") == "conveyor.pipeline.stages":
        state: dict[str, torch.Tensor] = {}
        for part in header["stages"]:
            state.update(ckpt.part_tree(part)["model"])
        return state
    if isinstance(ckpt.trees.get("model"), dict):
        return dict(ckpt.trees["model"])
    raise CheckpointError(f"checkpoint {ckpt.path} holds no model this command can read (trees "
                          f"{sorted(ckpt.trees)}): it was not written by a conveyor Trainer's strategy")


def export_model(run_dir: str | Path, to: str | Path, *, step: int | None = None, force: bool = False) -> Path:
    """Write step ``step`` (default: the latest) of the run in ``run_dir`` as ``<to>/model.safetensors``."""
    run, out = Path(run_dir), Path(to)
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: give another --to folder, or --force to replace its model.safetensors")
    ckpt = CheckpointReader(root).load(step)
    state = {k: _plain(k, v) for k, v in model_state(ckpt).items()}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"conveyor_step": str(ckpt.step), "conveyor_checkpoint": str(ckpt.path)})
    shutil.move(str(tmp), str(out / "model.safetensors"))
    return out / "model.safetensors"


def _plain(name: str, value: Any) -> torch.Tensor:
    """A tensor as safetensors writes it: contiguous, on the CPU, sharing no memory with another."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"model entry {name!r} is a {type(value).__name__}, not a tensor")
    return value.detach().cpu().contiguous().clone()
