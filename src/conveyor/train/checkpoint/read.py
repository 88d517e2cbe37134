"""The files of one checkpoint step folder as a reader sees them: names, the manifest, parts, and what is damaged.

A step holds trees (`<name>.safetensors` + `<name>.json`, written by the chief and listed in
state.json), JSON documents (`<group>/<name>.json`, such as `data/worker-0.json`), `extra` (state.json)
and parts other tasks contributed; `Checkpoint` gives them back by name, knowing none of them.
A reader trusts nothing in the folder (`conveyor.train.checkpoint`, "What a reader trusts"): the
manifest is read only up to MANIFEST_MAX_BYTES and must be strict JSON of the right types, part
names must stay inside the step folder, a symlink leading out of it is refused, and every part that
fails its size, sha256 or parse raises `CheckpointError` naming the file, the step and the fix.
`CheckpointManager` decides which folder to read; this module reads and checks one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from conveyor.errors import ConveyorError
from conveyor.train.state_io import load_tensors, state_from_bytes, unflatten_state

FORMAT = "conveyor.checkpoint"
VERSION = 1
MANIFEST = "COMPLETE"
LATEST = "latest"
MANIFEST_MAX_BYTES = 16 << 20  # ~100 bytes a part: room for 100k parts, and a bound on what is parsed
PART_NAME_MAX = 255

STEP_RE = re.compile(r"^step-(\d{8,})$")
PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# The trees of a step folder written before state.json listed them (the Trainer's, before checkpoint items):
# read so that those folders still load; also names no other task may give a part.
LEGACY_TREES = ("model", "optimizer", "rng")
RESERVED = {MANIFEST, "state.json"} | {f"{t}.{ext}" for t in LEGACY_TREES for ext in ("safetensors", "json")}


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint is missing, incomplete, damaged or from another format; the message says what to do."""


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


def check_step(step: int) -> int:
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def step_folder_name(step: int) -> str:
    return f"step-{step:08d}"


def step_numbers(names: Iterable[str]) -> list[int]:
    """The steps of the names that are step folders' (as `step_folder_name` spells them)."""
    out = []
    for m in map(STEP_RE.fullmatch, names):
        if m and m.group(0) == step_folder_name(int(m.group(1))):
            out.append(int(m.group(1)))
    return out


def is_plain_part_name(name: Any) -> bool:
    """A name that stays inside a step folder: no absolute path, '..', NUL or empty component; bounded length."""
    return isinstance(name, str) and len(name) <= PART_NAME_MAX and PART_RE.fullmatch(name) is not None


def check_part_name(name: str) -> None:
    if not is_plain_part_name(name) or name in RESERVED:
        raise ValueError(
            f"part name {name!r}: use a file name of letters, digits, '.', '_', '-' (or data/<task>.json), "
            f"not one of {sorted(RESERVED)}"
        )


def damaged(folder: Path, path: Path, why: str) -> CheckpointError:
    """The error for a file of step folder `folder` that cannot be used, with the fix."""
    m = STEP_RE.fullmatch(folder.name)
    which = f"step {int(m.group(1))}" if m else f"the checkpoint in {folder}"
    error = CheckpointError(
        f"{path}: {why}; {which} cannot be used: move {folder} away (or delete it) to resume from an earlier step"
    )
    error.reason = f"{path}: {why}"  # what resume_step's warning quotes: it names the fix itself
    return error


def part_path(folder: Path, name: str) -> Path:
    """`folder / name`, refused if a symlink takes it outside `folder` (the manifest checked `name` itself)."""
    path = folder / name
    real, inside = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, inside]) != inside:
        raise damaged(folder, path, f"a symlink to {real}, outside the step folder")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# the whole folder


def check_folder(folder: Path, verify: bool) -> dict[str, Any]:
    """The manifest of `folder` if it is valid and lists parts present at their sizes and (`verify`) sha256s."""
    manifest = read_manifest(folder)
    for name, expected in manifest["parts"].items():
        check_part(folder, name, expected, verify)
    return manifest


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


def _missing(folder: Path, path: Path) -> CheckpointError:
    return CheckpointError(f"{path}: listed in the {MANIFEST} manifest but missing; delete {folder}")


def _read_bytes(folder: Path, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise _missing(folder, path) from e
    except (IsADirectoryError, NotADirectoryError) as e:
        raise damaged(folder, path, "not a file") from e


def check_part(folder: Path, name: str, expected: Mapping[str, Any], verify: bool) -> Path:
    """The path of part `name`, checked to exist at the manifest's size and (`verify`) sha256."""
    path = part_path(folder, name)
    try:
        size, digest = hash_file(path, fsync=False) if verify else (path.stat().st_size, None)
    except FileNotFoundError as e:
        raise _missing(folder, path) from e
    except (IsADirectoryError, NotADirectoryError) as e:
        raise damaged(folder, path, "not a file") from e
    _check_size_and_hash(folder, path, size, digest, expected)
    return path


def _check_size_and_hash(folder: Path, path: Path, size: int, digest: str | None, expected: Mapping[str, Any]):
    if size == expected["size"] and digest in (None, expected["sha256"]):
        return
    got = f"size {size}" + (f", sha256 {digest[:12]}…" if digest else "")
    raise CheckpointError(
        f"{path}: damaged ({got}; the manifest says size {expected['size']}, sha256 {expected['sha256'][:12]}…). "
        f"Delete {folder} to resume from the previous checkpoint, or load(step=...) an earlier one."
    )


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


def hash_file(path: Path, fsync: bool) -> tuple[int, str]:
    """`(size, sha256)` of `path`; `fsync` also makes it durable (the writer's use: one pass over the file)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())  # files written by safetensors' Rust writer are synced here
    return size, h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# JSON parts and state trees


def _parse_json(folder: Path, path: Path, data: bytes, strict: bool = False) -> Any:
    try:
        return json.loads(data, parse_constant=_refuse_constant) if strict else json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError and too long ints are ValueErrors
        raise damaged(folder, path, f"not valid JSON ({e})") from e


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a number in strict JSON")


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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------------------------------
# the manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    """`folder`'s manifest, bounded in size and checked (`_check_manifest`); `CheckpointError` says what is wrong."""
    path = part_path(folder, MANIFEST)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(MANIFEST_MAX_BYTES + 1)
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder}: no {MANIFEST} marker, so it is not a finished checkpoint") from e
    if len(data) > MANIFEST_MAX_BYTES:
        raise damaged(folder, path, f"{max(size, len(data))} bytes, more than a manifest may have "
                                    f"({MANIFEST_MAX_BYTES})")
    return _check_manifest(folder, path, _parse_json(folder, path, data, strict=True))


def _check_manifest(folder: Path, path: Path, manifest: Any) -> dict[str, Any]:
    """`manifest` if it is one for `folder`: right format, version and step, part names inside the folder."""
    parts = manifest.get("parts") if isinstance(manifest, dict) else None
    if not isinstance(parts, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest; delete {folder}")
    if type(manifest.get("version")) is not int or manifest["version"] != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {manifest.get('version')!r}, this conveyor reads {VERSION}; "
            f"resume with the conveyor version that wrote it"
        )
    m, step = STEP_RE.fullmatch(folder.name), manifest.get("step")
    if type(step) is not int or (m is not None and int(m.group(1)) != step):
        raise CheckpointError(f"{path}: the manifest is for step {step!r}, not {folder.name}; delete it")
    if "time" in manifest and not _is_number(manifest["time"]):
        raise damaged(folder, path, f"time {manifest['time']!r} is not a number")
    for name, entry in parts.items():
        _check_manifest_entry(folder, path, name, entry)
    return manifest


def _check_manifest_entry(folder: Path, path: Path, name: Any, entry: Any) -> None:
    if not is_plain_part_name(name):
        shown = name if len(name) <= 80 else name[:80] + "…"
        raise damaged(folder, path, f"part {shown!r} is not a plain name inside {folder.name} (at most "
                                    f"{PART_NAME_MAX} letters, digits, '.', '_', '-', and one '/')")
    if not (isinstance(entry, dict) and _is_size(entry.get("size")) and isinstance(entry.get("sha256"), str)
            and _SHA256_RE.fullmatch(entry["sha256"])):
        raise damaged(folder, path, f"part {name!r} is not listed as {{size: bytes, sha256: 64 hex digits}}")


def _is_size(v: Any) -> bool:
    return type(v) is int and v >= 0
