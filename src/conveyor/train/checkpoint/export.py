"""The whole model of a checkpoint step as safetensors under its own parameter names, as Hugging Face lays it out.

    export_model("runs/x", to="runs/x-export")        # -> runs/x-export/model.safetensors
    model.load_state_dict(safetensors.torch.load_file("runs/x-export/model.safetensors"), strict=True)

Reads the step whatever the strategy that wrote it (`sources`). Up to ``max_shard_size`` bytes of
tensors (default 5 GB, Hugging Face's): one ``model.safetensors``; above it, shards
``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` (``{"metadata":
{"total_size": N}, "weight_map": {name: file}}``), split as ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` does (in the model's order, a new file when the next tensor would
overflow, a tensor larger than the limit alone), which ``transformers`` and ``huggingface_hub`` read.
Tied weights are written under every name, as separate copies, so that a strict ``load_state_dict``
finds each. Every part of the step is checked against its sha256 first; the files are written into a
temporary folder and moved in at the end. An output folder that exists is refused without ``force``
(with it, only earlier export files there are replaced).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

from conveyor.fileio import write_file
from conveyor.stepfolders import step_numbers
from conveyor.train.checkpoint.read import CheckpointError, check_folder
from conveyor.train.checkpoint.sources import Entry, model_entries
from conveyor.train.checkpoint.store import CheckpointReader
from conveyor.train.state_io import save_tensors

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX", "export_model", "parse_size", "plan_shards", "checkpoint_root"]

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000  # huggingface_hub's MAX_SHARD_SIZE
INDEX = "model.safetensors.index.json"
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"500MB"`` -> 500_000_000 (KB/MB/GB decimal as Hugging Face counts, KiB/MiB/GiB binary, or bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"size {text!r}: give a positive number of bytes with an optional unit, such as 5GB, "
                         f"500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def plan_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """huggingface_hub's split: in order, a new shard when the next tensor would overflow; a larger one alone."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > max_shard_size:
            shards.append([e])
            continue
        if current and size + e.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    return shards + [current] if current or not shards else shards


def checkpoint_root(run_dir: str | Path) -> Path:
    """The checkpoint folder of ``run_dir`` (a run's output folder, or that folder itself); refused, naming what
    was expected, where it holds no step folder at all."""
    run = Path(run_dir)
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    if not run.is_dir():
        raise CheckpointError(f"{run} is not a folder: give a run's output folder (the one holding checkpoints/) or "
                              f"its checkpoints folder")
    if not any(p.name.startswith(("step-", ".tmp-step-", ".parts-step-")) for p in root.iterdir()):
        if root != run:
            raise CheckpointError(f"{run} holds no checkpoint yet ({root} has no step folder): let the run save one "
                                  f"(checkpoint_every_steps=) or give another run's folder")
        raise CheckpointError(f"{run} is not a run or checkpoint folder: it holds no checkpoints/ and no "
                              f"step-XXXXXXXX folders; give a run's output folder (--output-dir of conveyor run) or "
                              f"its checkpoints folder")
    return root


def choose_step(root: Path, step: int | None) -> int:
    """``step`` if it is a complete step under ``root`` (default: the latest); else the steps there are, named."""
    reader = CheckpointReader(root)
    complete = reader.list_steps()
    chosen = reader.latest_step() if step is None else step
    if chosen is not None and chosen in complete:
        return chosen
    every = sorted(step_numbers(p.name for p in root.iterdir()))
    unfinished = sorted(set(every) - set(complete))
    said = (f"no step {step}" if step is not None else "no complete step") + f" under {root}"
    raise CheckpointError(f"{said}: its complete steps are {complete or 'none'}"
                          + (f" (incomplete, unusable: {unfinished})" if unfinished else "")
                          + ("; give one with --step N" if complete else ""))


def export_model(run_dir: str | Path, to: str | Path, *, step: int | None = None, force: bool = False,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, progress: bool | None = None) -> list[Path]:
    """Write step ``step`` (default: the latest) of the run in ``run_dir`` into ``to``; the files written.
    ``progress``: a bar on stderr (default: when stderr is a terminal)."""
    root, out = checkpoint_root(run_dir), Path(to)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: give another --to folder, or --force to replace the model files in it")
    folder = CheckpointReader(root).step_dir(choose_step(root, step))
    check_folder(folder, verify=True)  # every part's sha256: a damaged file is refused, named
    shards = plan_shards(model_entries(folder), max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".export-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        names = _write(shards, tmp, {"format": "pt", "conveyor_checkpoint": str(folder)},
                       sys.stderr.isatty() if progress is None else progress)
        for old in out.iterdir():
            if _OURS.fullmatch(old.name):
                old.unlink()  # an earlier export's files would mix with these (a stale index or shard)
        for name in names:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in names]


def _write(shards: list[list[Entry]], folder: Path, metadata: dict[str, str], progress: bool) -> list[str]:
    """Each shard in turn (its tensors read, written, dropped), then the index where there are several."""
    from tqdm import tqdm

    total = sum(e.nbytes for shard in shards for e in shard)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not progress, file=sys.stderr) as bar:
        for file, shard in zip(files, shards, strict=True):
            tensors = {}
            for e in shard:
                tensors[e.name] = _checked(e)
                bar.update(e.nbytes)
            save_tensors(folder / file, tensors, metadata)
            del tensors
    if n == 1:
        return files
    weight_map = {e.name: f for f, s in zip(files, shards, strict=True) for e in s}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_file(folder / INDEX, json.dumps(index, indent=2, sort_keys=True).encode(), fsync=False)
    return [*files, INDEX]


def _checked(e: Entry):
    tensor = e.load()
    if tuple(tensor.shape) != e.shape:
        raise CheckpointError(f"model tensor {e.name} read as {list(tensor.shape)}, not the {list(e.shape)} its "
                              f"header says: the step is damaged")
    return tensor
