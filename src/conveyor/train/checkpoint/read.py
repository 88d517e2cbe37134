"""The files of one checkpoint step folder as a reader sees them: names, the manifest, parts, and what is damaged.

A step holds trees (`<name>.safetensors` + `<name>.json`, written by the chief and listed in
state.json), JSON documents (`<group>/<name>.json`, such as `data/worker-0.json`), `extra` (state.json)
and parts other tasks contributed; `Checkpoint` gives them back by name, knowing none of them.
A reader trusts nothing in the folder (`conveyor.train.checkpoint`, "What a reader trusts"): the
manifest is read only up to MANIFEST_MAX_BYTES and must be strict JSON of the right types, part
names must stay inside the step folder, a symlink leading out of it is refused, and every part that
fails its size, sha256 or parse raises `CheckpointError` naming the file, the step and the fix.
`CheckpointManager` decides which folder to read; this module reads one (`conveyor.stepfolders` checks it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from conveyor.stepfolders import (  # re-exported: their home before the launcher needed them without torch
    FORMAT,
    LATEST,
    MANIFEST,
    MANIFEST_MAX_BYTES,
    PART_NAME_MAX,
    PART_RE,
    STEP_RE,
    VERSION,
    CheckpointError,
    _check_size_and_hash,
    _is_number,
    _missing,
    _parse_json,
    check_folder,
    check_part,
    check_step,
    damaged,
    hash_file,
    is_plain_part_name,
    part_path,
    read_manifest,
    step_folder_name,
    step_numbers,
)
from conveyor.train.state_io import load_tensors, state_from_bytes, unflatten_state

__all__ = [
    "FORMAT", "LATEST", "MANIFEST", "MANIFEST_MAX_BYTES", "PART_NAME_MAX", "PART_RE", "STEP_RE", "VERSION",
    "Checkpoint", "CheckpointError", "ResumeError", "check_folder", "check_part_name", "check_step", "damaged",
    "hash_file", "read_manifest", "read_part", "read_step", "step_folder_name", "step_numbers",
]

# The trees of a step folder written before state.json listed them (the Trainer's, before checkpoint items):
# read so that those folders still load; also names no other task may give a part.
LEGACY_TREES = ("model", "optimizer", "rng")
RESERVED = {MANIFEST, "state.json"} | {f"{t}.{ext}" for t in LEGACY_TREES for ext in ("safetensors", "json")}


class ResumeError(CheckpointError):
    """The checkpoint found cannot be resumed by this job; the message names the fix."""

    usage_error = True  # a restart meets it again: `conveyor run` does not retry it


@dataclass
class Checkpoint:
    """Everything `CheckpointManager.load` read from one step folder, by name; parts are read on demand."""

    step: int
    path: Path
    trees: dict[str, Any] = field(default_factory=dict)  # the chief's state trees, by name
    docs: dict[str, Any] = field(default_factory=dict)  # JSON documents by name ("data/worker-0"), any writer's
    extra: dict[str, Any] = field(default_factory=dict)
    time: float | None = None
    parts: dict[str, Path] = field(default_factory=dict)  # every file the manifest lists, by part name
    # what restoring it re-dealt for a job of another shape: (count, saved, now, what, detail) as in
    # ("workers", 4, 3, "data", ""), ("ps tasks", 2, 1, "shards", "..."); `train.resume.announcement` says it
    reworld: list[tuple[str, int, int, str, str]] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.path.parent

    def tree(self, name: str) -> Any:
        """Tree `name`; `ResumeError` naming the fix when the job that wrote the step had none."""
        if name not in self.trees:
            raise ResumeError(f"checkpoint {self.path} holds no {name!r} (the job that wrote it had none; it holds "
                              f"{sorted(self.trees)}): resume without {name!r}, or " + self.start_over())
        return self.trees[name]

    def group(self, prefix: str) -> dict[str, Any]:
        """The documents `<prefix>/<name>`, by name: `group("data")` -> {"worker-0": ...}."""
        return {k[len(prefix) + 1 :]: v for k, v in self.docs.items() if k.startswith(prefix + "/")}

    def read_part(self, name: str) -> bytes:
        """The bytes of part `name`, checked against the manifest (`CheckpointReader.read_part`)."""
        return read_part(self.path, name)

    def part_tree(self, name: str) -> Any:
        """The tree another task wrote as parts `<name>.safetensors` + `<name>.json` (`state_io.state_to_bytes`)."""
        try:
            return state_from_bytes(self.read_part(f"{name}.safetensors"), self.read_part(f"{name}.json"))
        except (SafetensorError, ValueError) as e:
            raise damaged(self.path, self.path / f"{name}.json", f"not a state tree ({e})") from e

    def start_over(self) -> str:
        """The fix that always works: what a refusal to resume ends with."""
        return (f"start over with --no-resume (CONVEYOR_RESUME=0), or give this job another output folder than "
                f"{self.root.parent} (--output-dir)")


# ---------------------------------------------------------------------------------------------------------------------
# names


def check_part_name(name: str) -> None:
    if not is_plain_part_name(name) or name in RESERVED:
        raise ValueError(
            f"part name {name!r}: use a file name of letters, digits, '.', '_', '-' (or data/<task>.json), "
            f"not one of {sorted(RESERVED)}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# the whole folder


def read_step(step: int, folder: Path, map_location: str, verify: bool) -> Checkpoint:
    """Everything in step folder `folder`, tensors onto `map_location`; `verify` checks sha256s first."""
    manifest = read_manifest(folder)
    parts = {
        name: check_part(folder, name, expected, verify) if verify else part_path(folder, name)
        for name, expected in manifest["parts"].items()
    }
    ckpt = Checkpoint(step=step, path=folder, parts=parts)
    names: Any = [t for t in LEGACY_TREES if f"{t}.json" in parts]
    if "state.json" in parts:
        ckpt.extra, ckpt.time, names = _read_state(folder, names)
    unlisted = [n for n in names if not {f"{n}.json", f"{n}.safetensors"} <= parts.keys()]
    if unlisted:
        raise damaged(folder, folder / "state.json", f"trees {unlisted} are not in the {MANIFEST} manifest")
    ckpt.trees = {name: _read_tree(folder, name, map_location) for name in names}
    for name in parts:
        if "/" in name and name.endswith(".json"):
            ckpt.docs[name[: -len(".json")]] = _read_json(folder, name)
    return ckpt


def read_part(folder: Path, name: str) -> bytes:
    """The bytes of part `name` of step folder `folder`, checked against the manifest and parsed as its name says."""
    check_part_name(name)
    expected = read_manifest(folder)["parts"].get(name)
    if expected is None:
        raise CheckpointError(f"{folder} has no part {name!r}: it was written by a job without it (another "
                              f"strategy or number of tasks?); resume with the same setup or start over")
    path = part_path(folder, name)
    data = _read_bytes(folder, path)
    _check_size_and_hash(folder, path, len(data), hashlib.sha256(data).hexdigest(), expected)
    _check_format(folder, path, data)
    return data


# ---------------------------------------------------------------------------------------------------------------------
# parts


def _read_bytes(folder: Path, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise _missing(folder, path) from e
    except (IsADirectoryError, NotADirectoryError) as e:
        raise damaged(folder, path, "not a file") from e


def _check_format(folder: Path, path: Path, data: bytes) -> None:
    """Parse a part as its name says, so a bad one is named here instead of deep inside the task reading it."""
    if path.suffix == ".json":
        _parse_json(folder, path, data)
    elif path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt"):  # reads and checks the header only
                pass
        except SafetensorError as e:
            raise damaged(folder, path, f"not a readable safetensors file ({e})") from e


# ---------------------------------------------------------------------------------------------------------------------
# JSON parts and state trees


def _read_json(folder: Path, name: str) -> Any:
    path = part_path(folder, name)
    return _parse_json(folder, path, _read_bytes(folder, path))


def is_finite_step(folder: Path) -> bool:
    """Whether the step in `folder` holds finite parameters, as its writer recorded (state.json's `extra`
    "finite"; the Trainer sets it at every checkpoint). Unrecorded or unreadable: True (nothing says otherwise)."""
    try:
        extra, _, _ = _read_state(folder, list(LEGACY_TREES))
    except (OSError, CheckpointError):
        return True
    return extra.get("finite") is not False


def _read_state(folder: Path, legacy: list[str]) -> tuple[dict[str, Any], float | None, list[str]]:
    """state.json's `extra`, `time` and the names of the chief's trees (`legacy` where it lists none)."""
    path = folder / "state.json"
    state = _read_json(folder, "state.json")
    if not isinstance(state, dict):
        raise damaged(folder, path, f"a JSON {type(state).__name__}, not an object")
    try:
        extra = unflatten_state({}, state.get("extra")) or {}
    except ValueError as e:
        raise damaged(folder, path, str(e)) from e
    saved = state.get("time")
    if not isinstance(extra, dict) or not (saved is None or _is_number(saved)):
        raise damaged(folder, path, "extra is not an object or time not a number")
    trees = state.get("trees", legacy)
    plain = isinstance(trees, list) and all(isinstance(t, str) and is_plain_part_name(f"{t}.json") for t in trees)
    if not plain or any("/" in t for t in trees):
        raise damaged(folder, path, "trees is not a list of plain names")
    return extra, saved, trees


def _read_tree(folder: Path, name: str, map_location: str) -> Any:
    path = part_path(folder, f"{name}.safetensors")
    try:
        tensors, _ = load_tensors(path, device=map_location)
    except SafetensorError as e:
        raise damaged(folder, path, f"not a readable safetensors file ({e})") from e
    try:
        return unflatten_state(tensors, _read_json(folder, f"{name}.json"))
    except ValueError as e:
        raise damaged(folder, folder / f"{name}.json", f"does not fit {name}.safetensors ({e})") from e


# ---------------------------------------------------------------------------------------------------------------------
# the manifest

