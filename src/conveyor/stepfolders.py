"""Checkpoint step folders as any process sees them, without torch: names, manifests, and the resume step.

    step = resume_step(root)          # None: no step folder yet (a fresh start)

The one rule for the step a job resumes from, used by the tasks (`CheckpointReader.resume_step`) and
by the launcher (`launch.restarts`), so that both always name the same step: the newest *sealed* step
(by the time its `COMPLETE` manifest was written; ties by step number) whose folder is complete — the
manifest valid and every part there at its size and (`verify`) sha256. A step folder appears by one
atomic rename of a sealed folder, so that rename is the commit point of a save; `latest` is written
after it for people and tools and is never what decides (a crash between the rename and `latest` must
not rewind the job to an older step that the tasks would then have to write over). Write time, not
step number, so that a run resumed from an older step (every newer one damaged) goes on from its own
newest save. Damaged steps are passed over with a warning each; `CheckpointError` when all are.
`conveyor.train.checkpoint.read` reads the files; this module only checks them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from conveyor.errors import ConveyorError

__all__ = ["LATEST", "MANIFEST", "CheckpointError", "check_folder", "resume_step", "sealed_steps"]

log = logging.getLogger("conveyor.train.checkpoint")  # the name its warnings have always had

FORMAT = "conveyor.checkpoint"
VERSION = 1
MANIFEST = "COMPLETE"
LATEST = "latest"
MANIFEST_MAX_BYTES = 16 << 20  # ~100 bytes a part: room for 100k parts, and a bound on what is parsed
PART_NAME_MAX = 255

STEP_RE = re.compile(r"^step-(\d{8,})$")
PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint is missing, incomplete, damaged or from another format; the message says what to do."""


# ---------------------------------------------------------------------------------------------------------------------
# the step to resume from


def sealed_steps(root: Path) -> list[tuple[float, int]]:
    """`(seal time, step)` of every step folder under `root`, newest first, parts unchecked; a folder whose manifest
    does not read comes first (time `inf`): `resume_step` names it as damaged whichever step it resumes from."""
    try:
        steps = step_numbers(p.name for p in Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for step in steps:
        try:
            sealed = read_manifest(Path(root) / step_folder_name(step)).get("time", 0.0)
        except (OSError, CheckpointError):
            sealed = float("inf")  # no readable manifest: tried first, so that it is named as damaged
        out.append((float(sealed), step))
    return sorted(out, reverse=True)


def resume_step(root: str | os.PathLike[str], verify: bool = True, warn: bool = True) -> int | None:
    """The step a job with checkpoints under `root` resumes from (see the module docstring); None: none yet.

    `warn=False` passes over damaged steps silently (a look that decides nothing, such as `latest_step`).
    """
    root = Path(root)
    skipped: list[tuple[Path, str]] = []
    for _, step in sealed_steps(root):
        folder = root / step_folder_name(step)
        try:
            check_folder(folder, verify)
        except (OSError, CheckpointError) as e:
            if folder.exists():  # else rotation removed it meanwhile: not damage
                skipped.append((folder, getattr(e, "reason", str(e))))
            continue
        for bad, why in skipped if warn else ():
            log.warning("checkpoint %s skipped (%s); resuming from step %d (%s) instead", bad, why, step, folder)
        return step
    if not skipped:
        return None
    for bad, why in skipped if warn else ():
        log.warning("checkpoint %s skipped (%s); no other step is usable", bad, why)
    raise CheckpointError(
        f"no usable checkpoint under {root}: all {len(skipped)} step folder(s) are damaged (the warnings "
        f"above say why). To resume from none of them, move them away (or delete them), or start without "
        f"resuming (conveyor run --no-resume, CONVEYOR_RESUME=0)"
    )


# ---------------------------------------------------------------------------------------------------------------------
# names, parts and the manifest


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


def check_folder(folder: Path, verify: bool) -> dict[str, Any]:
    """The manifest of `folder` if it is valid and lists parts present at their sizes and (`verify`) sha256s."""
    manifest = read_manifest(folder)
    for name, expected in manifest["parts"].items():
        check_part(folder, name, expected, verify)
    return manifest


def _missing(folder: Path, path: Path) -> CheckpointError:
    return CheckpointError(f"{path}: listed in the {MANIFEST} manifest but missing; delete {folder}")


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


def _parse_json(folder: Path, path: Path, data: bytes, strict: bool = False) -> Any:
    try:
        return json.loads(data, parse_constant=_refuse_constant) if strict else json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError and too long ints are ValueErrors
        raise damaged(folder, path, f"not valid JSON ({e})") from e


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a number in strict JSON")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
