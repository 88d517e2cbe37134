"""Filling one checkpoint step folder while it still has its temporary name, and sealing it with the manifest.

`CheckpointManager` makes the temporary folder, calls these, and renames it into place: the files
here need no atomicity of their own (nobody reads a `.tmp-*` folder), only durability — each one
fsynced (`fsync`), then every folder, deepest first, so the rename publishes finished bytes. The trees
and documents come staged (`staging`: host copies and bytes), so this may run beside training.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor import fault
from conveyor.fileio import sync_dir, write_file
from conveyor.train.checkpoint.read import FORMAT, MANIFEST, PART_RE, VERSION, CheckpointError, hash_file
from conveyor.train.checkpoint.staging import StagedTree
from conveyor.train.state_io import flatten_state, save_tensors


def json_bytes(obj: Any) -> bytes:
    """Compact strict JSON (no NaN): what every JSON file of a step folder is written as."""
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def doc_files(docs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`{"<group>/<name>.json": doc}` for `save`'s `docs`, names checked before anything is written."""
    files = {}
    for doc, value in (docs or {}).items():
        name = f"{doc}.json"
        if "/" not in doc or not PART_RE.fullmatch(name):
            raise ValueError(f"checkpoint document {doc!r}: name it <group>/<name> (such as data/<task name>) in "
                             f"letters, digits, '.', '_' and '-' only")
        files[name] = value
    return files


def tree_names(trees: Mapping[str, Any]) -> list[str]:
    """The names of `save`'s `trees`, checked: each becomes `<name>.safetensors` + `<name>.json` in the step."""
    for name in trees:
        if not (isinstance(name, str) and "/" not in name and PART_RE.fullmatch(f"{name}.safetensors")):
            raise ValueError(f"checkpoint tree name {name!r}: use letters, digits, '.', '_' and '-' only")
    return list(trees)


def extra_meta(extra: Mapping[str, Any] | None) -> Any:
    """`extra` as state.json stores it (a `state_io` tree); tensors are refused: state.json has no file for them."""
    try:
        tensors, meta = flatten_state(dict(extra or {}))
    except TypeError as e:
        raise TypeError(f"extra: {e}") from e
    if tensors:
        raise TypeError(f"extra holds tensors {sorted(tensors)}; store numbers (.item()) or lists (.tolist())")
    return meta


def doc_bytes(docs: Mapping[str, Any]) -> dict[str, bytes]:
    """`doc_files`' documents as the bytes written (serialized when the save is staged: later changes are not)."""
    out = {}
    for name, doc in docs.items():
        try:
            out[name] = json.dumps(doc, sort_keys=True).encode()
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} is not JSON ({e}): a checkpoint document such as a data iterator state must be "
                            f"JSON") from e
    return out


def write_own(folder: Path, trees: Mapping[str, StagedTree], docs: Mapping[str, bytes], fsync: bool) -> list[str]:
    """Write the chief's own files of `CheckpointManager.save` (trees staged, documents as `doc_bytes`) into
    `folder`; returns their names."""
    files = []
    for name, tree in trees.items():
        files += write_tree(folder, name, tree, fsync)
    for name, data in docs.items():
        files.append(write_member(folder, name, data, fsync))
    return files


def write_tree(folder: Path, name: str, tree: StagedTree, fsync: bool) -> list[str]:
    """`<name>.safetensors` + `<name>.json` (see state_io) in `folder`; returns their names."""
    tree.ready()  # copies from a GPU have landed in host memory
    save_tensors(folder / f"{name}.safetensors", tree.tensors, {"format": FORMAT})  # fsynced by `seal`'s hashing
    write_file(folder / f"{name}.json", json_bytes(tree.meta), fsync=fsync)
    return [f"{name}.safetensors", f"{name}.json"]


def write_member(folder: Path, name: str, data: bytes, fsync: bool) -> str:
    """Write file `name` (maybe `data/<task>.json`) of `folder`; returns `name`."""
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    write_file(folder / name, data, fsync=fsync)
    return name


def write_state(folder: Path, step: int, extra: Any, trees: list[str], fsync: bool) -> str:
    """state.json: step, time, format version, `extra_meta(extra)` and the names of the chief's `trees`."""
    state = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(), "extra": extra, "trees": trees}
    return write_member(folder, "state.json", json_bytes(state), fsync)


def collect_parts(step: int, staging: Path, folder: Path, names: list[str], timeout: float) -> list[str]:
    """Wait up to `timeout` s for parts `names` in `staging` (`.parts-step-*`), then move them into `folder`."""
    if not names:
        return []
    deadline = time.monotonic() + max(0.0, float(timeout))
    missing = [n for n in names if not (staging / n).is_file()]
    while missing and time.monotonic() < deadline:
        time.sleep(0.02)
        missing = [n for n in missing if not (staging / n).is_file()]
    if missing:
        raise CheckpointError(
            f"step {step}: parts {missing} did not arrive in {staging} within {timeout:g}s. The tasks that "
            f"write them may have died or be slow: check their logs, raise the timeout, or save without them."
        )
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, folder / name)
    return names


def return_parts(staging: Path, folder: Path, names: list[str]) -> None:
    """Undo `collect_parts` after a failed save, so other tasks' work survives for a retry."""
    for name in names:
        try:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / name, staging / name)
        except OSError:
            pass  # the folder was already renamed into place, or is gone: nothing to give back


def seal(step: int, folder: Path, files: list[str], fsync: bool) -> None:
    """Write the manifest (every file's size and sha256) and, with `fsync`, make the whole folder durable."""
    parts = {}
    for name in sorted(files):
        size, digest = hash_file(folder / name, fsync=fsync)
        parts[name] = {"size": size, "sha256": digest}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(), "parts": parts}
    write_file(folder / MANIFEST, json_bytes(manifest), fsync=fsync)
    fault.point("after-manifest", step)
    if fsync:
        for sub in sorted({folder} | {(folder / n).parent for n in files}, key=lambda p: len(p.parts), reverse=True):
            sync_dir(sub)  # deepest first: data/ before the step folder that holds it
