"""What a run's checkpoint folder holds, for a person (`format_text`) or a program (`describe`, JSON-able).

    info = describe("runs/x")      # {"root", "latest", "steps": [...], "leftovers": [...]}
    print(format_text(info))

Each step folder is listed: a complete one (sealed: its manifest valid, every part present at its
size; sha256s are not read, `conveyor checkpoint export` checks them) with its items (the chief's trees
and the parts other tasks wrote, by name, with sizes), strategy, world shape (workers; ps tasks;
stages x replicas; fsdp ranks), step, epoch and when it was written; an incomplete one with why. Leftovers
of crashed writers (``.tmp-*``, ``.parts-*``, ``.trash-*``) are named as such. Reads headers and JSON only.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from conveyor.stepfolders import step_numbers
from conveyor.train.checkpoint.export import checkpoint_root
from conveyor.train.checkpoint.read import LEGACY_TREES, CheckpointError, _read_state, check_folder
from conveyor.train.checkpoint.sources import tree_header
from conveyor.train.checkpoint.store import CheckpointReader

__all__ = ["describe", "format_text"]

_PART_ITEM = re.compile(r"(.+?)\.(safetensors|json)$")


def describe(run_dir: str | Path) -> dict[str, Any]:
    """The checkpoints of ``run_dir`` (a run's output folder or its checkpoints folder), JSON-able."""
    root = checkpoint_root(run_dir)
    reader = CheckpointReader(root)
    latest = reader.latest_step()
    steps = [_step(reader.step_dir(s), s, latest) for s in sorted(step_numbers(p.name for p in root.iterdir()))]
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".parts-", ".trash-")))
    return {"root": str(root), "latest": latest, "steps": steps,
            "leftovers": [{"name": n, "what": _leftover(n)} for n in leftovers]}


def _leftover(name: str) -> str:
    if name.startswith(".parts-"):
        return "parts staged for a step not (yet) sealed: incomplete"
    if name.startswith(".trash-"):
        return "a step being deleted: incomplete"
    return "a step being written, or left by a writer that crashed: incomplete"


def _step(folder: Path, step: int, latest: int | None) -> dict[str, Any]:
    try:
        manifest = check_folder(folder, verify=False)
    except (OSError, CheckpointError) as e:
        return {"step": step, "complete": False, "latest": False, "why": str(e)}
    parts = manifest["parts"]
    extra, _, trees = _read_state(folder, list(LEGACY_TREES)) if "state.json" in parts else ({}, None, [])
    items: dict[str, int] = {}
    for name, entry in parts.items():
        m = _PART_ITEM.fullmatch(name)
        item = name.split("/")[0] if "/" in name else (m.group(1) if m else name)
        items[item] = items.get(item, 0) + int(entry["size"])
    items.pop("state", None)
    written = manifest.get("time")
    return {"step": step, "complete": True, "latest": step == latest, "epoch": extra.get("epoch"),
            "written": None if written is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(written)),
            "strategy": extra.get("strategy"), "world": _world(folder, extra, trees),
            "size": sum(int(e["size"]) for e in parts.values()), "items": items}


def _world(folder: Path, extra: dict[str, Any], trees: list[str]) -> dict[str, Any]:
    """The shape of the job that wrote the step, from its headers (trees without their tensors)."""
    world: dict[str, Any] = {"workers": extra.get("world_size")}
    fsdp = tree_header(folder, "fsdp") if "fsdp" in trees else None
    if isinstance(fsdp, dict) and "world" in fsdp:
        world["fsdp_ranks"] = fsdp["world"]
    header = tree_header(folder, "optimizer") if "optimizer" in trees else None
    if isinstance(header, dict) and header.get("format") == "conveyor.pipeline.stages":
        world["stages"] = len(header["stages"])
        if isinstance(world["workers"], int):
            world["replicas"] = world["workers"] // max(1, world["stages"])
        if header.get("shards"):  # --shard-stages: each stage sharded with FSDP2 across its replicas
            world["shards_per_stage"] = header["shards"]
    elif isinstance(header, dict) and "num_ps" in header:
        world["ps_tasks"] = header["num_ps"]
    return world


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _shape(world: dict[str, Any]) -> str:
    said = [f"{world['workers']} worker(s)"] if world.get("workers") is not None else []
    if "ps_tasks" in world:
        said.append(f"{world['ps_tasks']} ps task(s)")
    if "stages" in world:
        said.append(f"{world['stages']} stage(s) x {world.get('replicas', '?')} replica(s)"
                    + (" (stages sharded)" if "shards_per_stage" in world else ""))
    if "fsdp_ranks" in world:
        said.append(f"{world['fsdp_ranks']} fsdp rank(s)")
    return ", ".join(said) or "unknown"


def format_text(info: dict[str, Any]) -> str:
    """``describe``'s answer as lines for a terminal."""
    lines = [f"checkpoints in {info['root']} (latest: {info['latest'] if info['latest'] is not None else 'none'})"]
    for s in info["steps"]:
        if not s["complete"]:
            lines.append(f"  step {s['step']}: INCOMPLETE, unusable ({s['why']})")
            continue
        mark = "sealed, complete" + (", latest" if s["latest"] else "")
        lines.append(f"  step {s['step']} ({mark}): epoch {s['epoch']}, strategy {s['strategy']}, "
                     f"{_shape(s['world'])}; {_size(s['size'])}, written {s['written']}")
        lines.append("    items: " + ", ".join(f"{k} {_size(v)}" for k, v in sorted(s["items"].items())))
    for left in info["leftovers"]:
        lines.append(f"  {left['name']}: {left['what']}")
    if not info["steps"]:
        lines.append("  no step folders")
    return "\n".join(lines)
