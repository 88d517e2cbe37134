"""Checkpoints that a reader on another machine never sees half-written, in safetensors + JSON.

Layout of `root` (normally `<output_dir>/checkpoints`):

    latest                          text: the name of the newest complete step folder
    step-00001000/                  one complete checkpoint (8+ digit step, so names sort)
        COMPLETE                    manifest: format, version, step, time, every part's size + sha256
        state.json                  step, time, format version, the caller's `extra` (JSON)
        model.safetensors           model.state_dict(); tensor names = state_dict keys
        model.json                  the tree around those tensors (see state_io)
        optimizer.safetensors       optimizer.state_dict() tensors ...
        optimizer.json              ... and its tree (int keys, param_groups)
        rng.safetensors, rng.json   state_io.rng_state() of the chief
        data/<task>.json            each worker's data-iterator state_dict()
        ps-0.safetensors, ...       parts contributed by other tasks (below)
    .tmp-step-00002000-1a2b3c4d/    being written; never read
    .parts-step-00002000/           parts other tasks have contributed to step 2000 so far
    .trash-step-00000500-.../       being deleted by rotation; never read

Why it is safe to read at any moment: a step folder is written under a `.tmp-*` name, every file
and the folder are fsynced, and only then is it renamed to `step-XXXXXXXX` — rename is atomic, so
the name either does not exist or names a finished folder. The `latest` pointer is replaced (temp
file, fsync, rename) only after that. Rotation renames a folder to `.trash-*` before deleting it,
so no reader ever finds a step folder with files missing. A folder counts as a checkpoint only if
its `COMPLETE` manifest parses, names the folder's step and lists parts that exist with the listed
sizes; `load(verify=True)` also checks every sha256, so a file damaged on disk is named instead of
resumed from.

Several writers, one step. The chief owns the step folder; other tasks contribute files to it:

    # on parameter server 0 (and every other task that owns state):
    mgr.save_part(1000, "ps-0.safetensors", safetensors.torch.save(shard_tensors))
    mgr.save_part(1000, "data/worker-1.json", json.dumps(it.state_dict()).encode())
    # on the chief, once it knows which parts to expect:
    mgr.save(1000, model.state_dict(), opt.state_dict(), rng=rng_state(),
             parts=["ps-0.safetensors", "ps-1.safetensors", "data/worker-1.json"], parts_timeout=60)

`save_part` writes atomically into `.parts-step-XXXXXXXX/`; `save` (or `finalize`, when the chief
contributes nothing itself) waits up to `parts_timeout` seconds for the expected parts, moves them
into its temporary folder and lists them in the manifest. The step becomes visible — complete, with
every part — in one rename, or not at all. A part arriving after its step is complete is refused.

Resuming: `mgr.latest_step()` is the step to resume from (None: start fresh); `mgr.load()` returns a
`Checkpoint` with everything above, `ckpt.parts["ps-0.safetensors"]` being the path of a contributed
part. `CheckpointPolicy` decides when to save (every N steps and/or T seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from conveyor.train.state_io import flatten_state, load_tensors, save_tensors, unflatten_state

FORMAT = "conveyor.checkpoint"
VERSION = 1
MANIFEST = "COMPLETE"
LATEST = "latest"

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TREES = ("model", "optimizer", "rng")
_RESERVED = {MANIFEST, "state.json"} | {f"{t}.{ext}" for t in _TREES for ext in ("safetensors", "json")}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or from another format; the message says what to do."""


@dataclass
class Checkpoint:
    """Everything `CheckpointManager.load` read from one step folder."""

    step: int
    path: Path
    model_state: dict[str, Any] | None = None
    optimizer_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    data_states: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    time: float | None = None
    parts: dict[str, Path] = field(default_factory=dict)  # every file the manifest lists, by part name


# ---------------------------------------------------------------------------------------------------------------------
# when to save


class CheckpointPolicy:
    """Save every `every_steps` steps and/or every `every_seconds` seconds, whichever comes first.

    Step-based saves land on multiples of `every_steps` (step-00001000, step-00002000, ...) so folder
    names line up across restarts. The seconds clock starts at the first `should_save` call and
    restarts at every save. `should_save` records a save when it returns True: call it once per
    step, after the optimizer step, with `step` = the number of steps done.
    """

    def __init__(self, every_steps: int | None = None, every_seconds: float | None = None):
        if every_steps is not None and (
            isinstance(every_steps, bool) or every_steps != int(every_steps) or every_steps < 1
        ):
            raise ValueError(f"every_steps must be a positive integer or None, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be positive or None, got {every_seconds!r}")
        self.every_steps = None if every_steps is None else int(every_steps)
        self.every_seconds = None if every_seconds is None else float(every_seconds)
        self._last_step: int | None = None
        self._last_time: float | None = None

    def should_save(self, step: int, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self._last_time is None:
            self._last_time = now
        if step == self._last_step:
            return False
        due = bool(self.every_steps and step > 0 and step % self.every_steps == 0)
        due = due or (self.every_seconds is not None and now - self._last_time >= self.every_seconds)
        if due:
            self._last_step, self._last_time = step, now
        return due


# ---------------------------------------------------------------------------------------------------------------------
# the manager


class CheckpointManager:
    """Writes, rotates, finds and reads checkpoints under `root` (see the module docstring).

    `keep`: how many complete steps to keep (the most recently written; None keeps all). The one
    just written and the one `latest` names are never deleted. `fsync=False` skips the fsyncs —
    still atomic for readers, but not durable across a power loss; for tests and scratch runs.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int | None = 3, fsync: bool = True):
        if keep is not None and (isinstance(keep, bool) or int(keep) != keep or keep < 1):
            raise ValueError(f"keep must be a positive integer or None (keep every checkpoint), got {keep!r}")
        self.root = Path(root)
        self.keep = None if keep is None else int(keep)
        self.fsync = bool(fsync)

    # -- names -----------------------------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{_check_step(step):08d}"

    def _parts_dir(self, step: int) -> Path:
        return self.root / f".parts-step-{step:08d}"

    # -- writing -----------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model_state: Mapping[str, Any],
        optimizer_state: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        data_states: Mapping[str, Any] | None = None,
        rng: Mapping[str, Any] | None = None,
        *,
        parts: Iterable[str] = (),
        parts_timeout: float = 0.0,
    ) -> Path:
        """Write step `step` and return its folder; on any error nothing becomes visible.

        `extra` is JSON-able run information (epoch, best loss, config) stored in state.json;
        `data_states` maps a task name ("worker-0") to its data iterator's `state_dict()`; `rng` is
        `state_io.rng_state()` (None: not saved). `parts` names files other tasks contribute with
        `save_part`, awaited for `parts_timeout` seconds. Saving a step that already exists
        replaces it.
        """
        step = _check_step(step)
        tasks = {}
        for task, st in (data_states or {}).items():
            name = f"data/{task}.json"
            if not _PART_RE.match(name):
                raise ValueError(f"data state task name {task!r}: use letters, digits, '.', '_' and '-' only")
            tasks[name] = st

        def write_own(tmp: Path) -> list[str]:
            files = self._write_tree(tmp, "model", model_state)
            if optimizer_state is not None:
                files += self._write_tree(tmp, "optimizer", optimizer_state)
            if rng is not None:
                files += self._write_tree(tmp, "rng", rng)
            for name, st in tasks.items():
                try:
                    data = json.dumps(st, sort_keys=True).encode()
                except (TypeError, ValueError) as e:
                    raise TypeError(f"data state for {name}: a data iterator state must be JSON ({e})") from e
                files.append(self._write_bytes(tmp, name, data))
            return files

        return self._build(step, write_own, parts, parts_timeout, extra)

    def save_part(self, step: int, name: str, data: bytes) -> Path:
        """Contribute one file to step `step` from another task (a parameter-server shard, an iterator state).

        Written atomically (temp file, fsync, rename) into `.parts-step-XXXXXXXX/<name>`, where the
        chief's `save(..., parts=[name])` or `finalize` picks it up. Names are file names, or
        `data/<task>.json` for data-iterator states (those come back in `Checkpoint.data_states`).
        """
        step = _check_step(step)
        _check_part_name(name)
        if self._is_complete(self.step_dir(step)):
            raise CheckpointError(
                f"step {step} is already complete in {self.step_dir(step)}; part {name!r} arrived too late. "
                f"Write parts before the chief saves the step (or add {name!r} to its expected parts)."
            )
        return self._replace_file(self._parts_dir(step) / name, data)

    def finalize(
        self,
        step: int,
        expected_parts: Iterable[str],
        extra: Mapping[str, Any] | None = None,
        timeout: float = 0.0,
    ) -> Path:
        """Make step `step` from contributed parts alone (waiting up to `timeout` s for them) and return it."""
        return self._build(_check_step(step), lambda tmp: [], expected_parts, timeout, extra)

    def _build(
        self, step: int, write_own, parts: Iterable[str], timeout: float, extra: Mapping[str, Any] | None
    ) -> Path:
        parts = list(dict.fromkeys(parts))
        for name in parts:
            _check_part_name(name)
        try:
            extra_meta = flatten_state(dict(extra or {}))
        except TypeError as e:
            raise TypeError(f"extra: {e}") from e
        if extra_meta[0]:
            raise TypeError(
                f"extra holds tensors {sorted(extra_meta[0])}; store numbers (.item()) or lists (.tolist())"
            )

        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step:08d}-{secrets.token_hex(4)}"
        tmp.mkdir()
        collected: list[str] = []
        try:
            files = list(write_own(tmp))
            clash = sorted(set(files) & set(parts))
            if clash:
                raise CheckpointError(f"step {step}: parts {clash} clash with files the chief writes; rename them")
            state = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(), "extra": extra_meta[1]}
            files.append(self._write_bytes(tmp, "state.json", _json_bytes(state)))
            collected = self._collect_parts(step, tmp, parts, timeout)
            final = self._commit(step, tmp, files + collected)
        except BaseException:
            self._return_parts(step, tmp, collected)  # other tasks' work survives for a retry
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(self._parts_dir(step), ignore_errors=True)  # stragglers for a finished step
        self._rotate(step)
        return final

    def _collect_parts(self, step: int, tmp: Path, names: list[str], timeout: float) -> list[str]:
        if not names:
            return []
        staging = self._parts_dir(step)
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
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, tmp / name)
        return names

    def _return_parts(self, step: int, tmp: Path, names: list[str]) -> None:
        for name in names:
            try:
                (self._parts_dir(step) / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / name, self._parts_dir(step) / name)
            except OSError:
                pass  # tmp already renamed into place, or gone: nothing to give back

    def _commit(self, step: int, tmp: Path, files: list[str]) -> Path:
        parts = {}
        for name in sorted(files):
            size, digest = _hash_file(tmp / name, fsync=self.fsync)
            parts[name] = {"size": size, "sha256": digest}
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "time": time.time(), "parts": parts}
        self._write_file(tmp / MANIFEST, _json_bytes(manifest))
        for sub in sorted({tmp} | {(tmp / n).parent for n in files}, key=lambda p: len(p.parts), reverse=True):
            self._sync_dir(sub)  # deepest first: data/ before the step folder that holds it

        final = self.step_dir(step)
        if final.exists():  # re-saving a step: the old folder must go before the new can take its name
            self._remove(final)
        os.rename(tmp, final)
        self._sync_dir(self.root)
        self._write_latest(final.name)
        return final

    def _replace_file(self, target: Path, data: bytes) -> Path:
        """Write `target` atomically: a temp file beside it, fsynced, renamed over it, folder synced."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{target.name}-{secrets.token_hex(4)}")
        try:
            self._write_file(tmp, bytes(data))
            os.replace(tmp, target)
        except BaseException:
            _unlink(tmp)
            raise
        self._sync_dir(target.parent)
        return target

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".latest-{secrets.token_hex(4)}"
        try:
            self._write_file(tmp, (name + "\n").encode())
            os.replace(tmp, self.root / LATEST)
        except BaseException:
            _unlink(tmp)
            raise
        self._sync_dir(self.root)

    def _rotate(self, just_written: int) -> None:
        if self.keep is None:
            return
        written = self._complete_steps()  # step -> time its manifest was written
        # Newest by write time, not by step number: after a run is rewound (resumed from an older
        # step), the abandoned run's higher steps are the ones that age out.
        by_age = sorted(written, key=lambda s: (written[s], s))
        protected = set(by_age[-self.keep :]) | {just_written}
        pointed = self._latest_pointer()
        if pointed is not None:
            protected.add(pointed)
        for s in by_age:
            if s not in protected:
                self._remove(self.step_dir(s))

    def _remove(self, folder: Path) -> None:
        """Rename away first (atomic), then delete: a reader never sees a step folder losing files."""
        trash = self.root / f".trash-{folder.name}-{secrets.token_hex(4)}"
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def cleanup(self, older_than: float = 30 * 60) -> list[Path]:
        """Delete what crashed writers left behind: `.tmp-*` folders and files and `.parts-*` folders
        untouched for `older_than` seconds, and every `.trash-*` folder. Returns what was removed.

        The age limit protects a writer that is still busy (possibly on another machine): keep it
        well above the time one checkpoint takes to write.
        """
        removed = []
        if not self.root.is_dir():
            return removed
        now = time.time()
        for p in self.root.iterdir():
            stale = p.name.startswith((".tmp-", ".parts-", ".latest-")) and now - _newest_mtime(p) >= older_than
            if stale or p.name.startswith(".trash-"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    _unlink(p)
                removed.append(p)
        return removed

    def _write_tree(self, folder: Path, name: str, tree: Mapping[str, Any]) -> list[str]:
        try:
            tensors, meta = flatten_state(tree)
        except TypeError as e:
            raise TypeError(f"{name} state: {e}") from e
        save_tensors(folder / f"{name}.safetensors", tensors, {"format": FORMAT})
        self._write_file(folder / f"{name}.json", _json_bytes(meta))
        return [f"{name}.safetensors", f"{name}.json"]

    def _write_bytes(self, folder: Path, name: str, data: bytes) -> str:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        self._write_file(folder / name, data)
        return name

    def _write_file(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _sync_dir(self, folder: Path) -> None:
        """fsync a directory so the names created or renamed in it survive a crash (POSIX only)."""
        if not self.fsync or os.name == "nt":
            return
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- finding -----------------------------------------------------------------------------------------------

    def list_steps(self) -> list[int]:
        """Steps with a complete folder, ascending. In-progress, damaged-manifest and deleted ones are skipped."""
        return sorted(self._complete_steps())

    def _complete_steps(self) -> dict[int, float]:
        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return {}
        out = {}
        for m in map(_STEP_RE.match, names):
            manifest = self._complete_manifest(self.root / m.group(0)) if m else None
            if manifest is not None:
                out[int(m.group(1))] = float(manifest.get("time") or 0.0)
        return out

    def latest_step(self) -> int | None:
        """The step to resume from: what `latest` names if that folder is complete, else the highest complete step."""
        pointed = self._latest_pointer()
        if pointed is not None and self._is_complete(self.step_dir(pointed)):
            return pointed
        steps = self.list_steps()
        return steps[-1] if steps else None

    def _latest_pointer(self) -> int | None:
        try:
            text = (self.root / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        m = _STEP_RE.match(text)
        return int(m.group(1)) if m else None

    def _is_complete(self, folder: Path) -> bool:
        return self._complete_manifest(folder) is not None

    def _complete_manifest(self, folder: Path) -> dict[str, Any] | None:
        """The manifest if `folder` is a complete checkpoint (manifest valid, every part present at its size)."""
        try:
            manifest = _read_manifest(folder)
            if all((folder / n).stat().st_size == p["size"] for n, p in manifest["parts"].items()):
                return manifest
        except (OSError, CheckpointError):
            pass
        return None

    # -- reading -----------------------------------------------------------------------------------------------

    def load(self, step: int | None = None, map_location: str = "cpu", verify: bool = True) -> Checkpoint:
        """Read step `step` (default: `latest_step()`), tensors onto `map_location`.

        `verify` checks every part's size and sha256 against the manifest first, so a damaged file
        raises `CheckpointError` naming it instead of resuming from garbage. With the default step,
        a checkpoint that rotation deletes while it is being read is retried with the new latest.
        """
        if step is not None:
            return self._load(_check_step(step), map_location, verify)
        for _ in range(5):
            latest = self.latest_step()
            if latest is None:
                raise CheckpointError(f"no complete checkpoint under {self.root}; start fresh or point at another root")
            try:
                return self._load(latest, map_location, verify)
            except CheckpointError:
                if self.step_dir(latest).exists():
                    raise
        raise CheckpointError(f"checkpoints under {self.root} kept disappearing while being read; is keep too small?")

    def _load(self, step: int, map_location: str, verify: bool) -> Checkpoint:
        folder = self.step_dir(step)
        try:
            return self._read(step, folder, map_location, verify)
        except Exception as e:
            if not folder.exists():
                raise CheckpointError(f"{folder} disappeared while being read (deleted by rotation?)") from e
            if isinstance(e, FileNotFoundError):
                raise CheckpointError(
                    f"{e.filename}: listed in the {MANIFEST} manifest but missing; delete {folder}"
                ) from e
            raise

    def _read(self, step: int, folder: Path, map_location: str, verify: bool) -> Checkpoint:
        manifest = _read_manifest(folder)
        parts = manifest["parts"]
        if verify:
            for name, expected in parts.items():
                size, digest = _hash_file(folder / name, fsync=False)
                if size != expected["size"] or digest != expected["sha256"]:
                    raise CheckpointError(
                        f"{folder / name}: damaged (size {size}, sha256 {digest[:12]}…; the manifest says size "
                        f"{expected['size']}, sha256 {expected['sha256'][:12]}…). Delete {folder} to resume from the "
                        f"previous checkpoint, or load(step=...) an earlier one."
                    )
        ckpt = Checkpoint(step=step, path=folder, parts={n: folder / n for n in parts})
        if "state.json" in parts:
            state = _read_json(folder / "state.json")
            try:
                ckpt.extra = unflatten_state({}, state.get("extra")) or {}
            except ValueError as e:
                raise CheckpointError(f"{folder / 'state.json'}: {e}") from e
            ckpt.time = state.get("time")
        trees = {name: self._read_tree(folder, name, map_location) for name in _TREES if f"{name}.json" in parts}
        ckpt.model_state, ckpt.optimizer_state, ckpt.rng = trees.get("model"), trees.get("optimizer"), trees.get("rng")
        for name in parts:
            if name.startswith("data/") and name.endswith(".json"):
                ckpt.data_states[name[len("data/") : -len(".json")]] = _read_json(folder / name)
        return ckpt

    def read_part(self, step: int, name: str) -> bytes:
        """The bytes of part `name` of complete step `step`, checked against its manifest (size and sha256).

        What a task that contributed a part (a parameter server's shard) reads back on resume.
        """
        _check_part_name(name)
        folder = self.step_dir(step)
        expected = _read_manifest(folder)["parts"].get(name)
        if expected is None:
            raise CheckpointError(f"{folder} has no part {name!r}: it was written by a job without it (another "
                                  f"strategy or number of tasks?); resume with the same setup or start over")
        data = (folder / name).read_bytes()
        if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointError(f"{folder / name}: damaged (size or sha256 differ from the manifest); delete "
                                  f"{folder} to resume from the previous checkpoint")
        return data

    def _read_tree(self, folder: Path, name: str, map_location: str) -> Any:
        path = folder / f"{name}.safetensors"
        try:
            tensors, _ = load_tensors(path, device=map_location)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}); delete {folder}") from e
        try:
            return unflatten_state(tensors, _read_json(folder / f"{name}.json"))
        except ValueError as e:
            raise CheckpointError(f"{folder / name}.json / .safetensors: {e}") from e


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _check_step(step: int) -> int:
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def _check_part_name(name: str) -> None:
    if not isinstance(name, str) or not _PART_RE.match(name) or name in _RESERVED:
        raise ValueError(
            f"part name {name!r}: use a file name of letters, digits, '.', '_', '-' (or data/<task>.json), "
            f"not one of {sorted(_RESERVED)}"
        )


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the checkpoint is damaged, delete its folder") from e


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder}: no {MANIFEST} marker, so it is not a finished checkpoint") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); delete {folder}") from e
    m = _STEP_RE.match(folder.name)
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT
        and isinstance(manifest.get("parts"), dict)
        and all(isinstance(p, dict) and "size" in p and "sha256" in p for p in manifest["parts"].values())
    )
    if not ok:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest; delete {folder}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {manifest.get('version')!r}, this conveyor reads {VERSION}; "
            f"resume with the conveyor version that wrote it"
        )
    if m is not None and int(m.group(1)) != manifest.get("step"):
        raise CheckpointError(f"{path}: the manifest is for step {manifest.get('step')}, not {folder.name}; delete it")
    return manifest


def _hash_file(path: Path, fsync: bool) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())  # files written by safetensors' Rust writer are synced here
    return size, h.hexdigest()


def _newest_mtime(path: Path) -> float:
    """A writer busy with one big file does not touch its folder's mtime, so look at the files too."""
    try:
        newest = path.stat().st_mtime
        if path.is_dir():
            for p in path.rglob("*"):
                newest = max(newest, p.stat().st_mtime)
        return newest
    except FileNotFoundError:
        return time.time()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
