"""Checkpoint step folders that a reader on another machine never sees half-written: write, find, rotate, read.

`CheckpointManager` stores named state trees, JSON documents, `extra` and other tasks' parts without
knowing what they are (`conveyor.train.checkpoint` has the promises and an example); `write`, `read`
and `policy` fill, read back and schedule one step folder.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from conveyor import fault
from conveyor.fileio import atomic_write, sync_dir
from conveyor.stepfolders import resume_step
from conveyor.train.checkpoint import write
from conveyor.train.checkpoint.read import (
    LATEST,
    MANIFEST,
    STEP_RE,
    Checkpoint,
    CheckpointError,
    check_folder,
    check_part_name,
    check_step,
    is_finite_step,
    read_part,
    read_step,
    step_folder_name,
    step_numbers,
)
from conveyor.train.checkpoint.staging import HostBuffers, StagedTree, stage_tree

__all__ = ["LEFTOVER_AGE", "CheckpointManager", "CheckpointReader", "StagedStep"]

log = logging.getLogger("conveyor.train.checkpoint")

#: Seconds a crashed save's `.tmp-*` / `.parts-*` leftovers must be untouched before they are deleted: far longer
#: than one save takes, so that no live writer (another task of this job, possibly on another machine) loses them.
LEFTOVER_AGE = 30 * 60


@dataclass(frozen=True)
class StagedStep:
    """A save staged by `CheckpointManager.stage`: copies of everything the chief writes, checked, not yet written."""

    step: int
    tree_names: list[str]
    trees: dict[str, StagedTree]
    docs: dict[str, bytes]
    extra: Any  # `write.extra_meta(extra)`
    parts: list[str]
    parts_timeout: float


class CheckpointReader:
    """Finds and reads the complete checkpoints under `root`; never writes (`CheckpointManager` adds that).

    Kept apart from the writing side so each stays small; every method here is also one of
    `CheckpointManager`'s, which is what callers normally hold.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / step_folder_name(check_step(step))

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
        for step in step_numbers(names):
            manifest = self._complete_manifest(self.step_dir(step))
            if manifest is not None:
                out[step] = float(manifest.get("time") or 0.0)
        return out

    def latest_step(self) -> int | None:
        """The newest complete step by the time it was sealed (`conveyor.stepfolders`), unverified; None: none."""
        try:
            return resume_step(self.root, verify=False, warn=False)
        except CheckpointError:
            return None

    def resume_step(self, verify: bool = True) -> int | None:
        """The step a job resumes from: `conveyor.stepfolders.resume_step`, the rule the launcher applies too.

        Usable: `check(step, verify)` passes (manifest valid, every part there, sha256s match). Each
        step passed over is logged as a warning saying why and which step is used instead: a damaged
        checkpoint never silently rewinds a job. Returns None when there is no step folder at all (a
        fresh start); raises `CheckpointError` when there are step folders but none is usable, since
        silently starting a long job over is worse than asking.
        """
        return resume_step(self.root, verify=verify)

    def check(self, step: int, verify: bool = True) -> dict[str, Any]:
        """Check that step `step` can be read and return its manifest; `CheckpointError` says what is wrong.

        The manifest must be valid and every part it lists present inside the step folder at its
        size and (with `verify`) its sha256.
        """
        return check_folder(self.step_dir(step), verify)

    def _latest_pointer(self) -> int | None:
        try:
            text = (self.root / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        m = STEP_RE.fullmatch(text)
        return int(m.group(1)) if m else None

    def _is_complete(self, folder: Path) -> bool:
        return self._complete_manifest(folder) is not None

    def _complete_manifest(self, folder: Path) -> dict[str, Any] | None:
        """The manifest if `folder` is a complete checkpoint (manifest valid, every part present at its size)."""
        try:
            return check_folder(folder, verify=False)
        except (OSError, CheckpointError):
            return None

    # -- reading -----------------------------------------------------------------------------------------------

    def load(self, step: int | None = None, map_location: str = "cpu", verify: bool = True) -> Checkpoint:
        """Read step `step` (default: `latest_step()`), tensors onto `map_location`.

        `verify` checks every part's size and sha256 against the manifest first, so a damaged file
        raises `CheckpointError` naming it instead of resuming from garbage. With the default step,
        a checkpoint that rotation deletes while it is being read is retried with the new latest.
        """
        if step is not None:
            return self._load(check_step(step), map_location, verify)
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
            return read_step(step, folder, map_location, verify)
        except Exception as e:
            if not folder.exists():
                raise CheckpointError(f"{folder} disappeared while being read (deleted by rotation?)") from e
            if isinstance(e, FileNotFoundError):
                raise CheckpointError(
                    f"{e.filename}: listed in the {MANIFEST} manifest but missing; delete {folder}"
                ) from e
            raise

    def read_part(self, step: int, name: str) -> bytes:
        """The bytes of part `name` of complete step `step`, checked against its manifest (size and sha256).

        What a task that contributed a part (a parameter server's shard) reads back on resume.
        """
        return read_part(self.step_dir(step), name)


class CheckpointManager(CheckpointReader):
    """Writes, rotates, finds and reads checkpoints under `root` (see the module docstring).

    `keep`: how many complete steps to keep (the most recently written; None keeps all). The one
    just written and the one `latest` names are never deleted. `fsync=False` skips the fsyncs —
    still atomic for readers, but not durable across a power loss; for tests and scratch runs.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int | None = 3, fsync: bool = True):
        if keep is not None and (isinstance(keep, bool) or int(keep) != keep or keep < 1):
            raise ValueError(f"keep must be a positive integer or None (keep every checkpoint), got {keep!r}")
        super().__init__(root)
        self.keep = None if keep is None else int(keep)
        self.fsync = bool(fsync)
        self._writing: set[str] = set()  # names of the `.tmp-*` folders this manager is filling now

    # -- names -----------------------------------------------------------------------------------------------

    def _parts_dir(self, step: int) -> Path:
        return self.root / f".parts-{step_folder_name(step)}"

    # -- writing -----------------------------------------------------------------------------------------------

    def save(self, step: int, trees: Mapping[str, Any] | None = None, **options: Any) -> Path:
        """Write step `step` and return its folder; on any error nothing becomes visible. `trees` and the
        keywords (`docs`, `extra`, `parts`, `parts_timeout`) are `stage`'s: `save` is `stage` then
        `write_staged`, with nothing copied (the write follows at once). Saving a step that exists replaces it."""
        return self.write_staged(self.stage(step, trees, copy=False, **options))

    def stage(
        self,
        step: int,
        trees: Mapping[str, Any] | None = None,
        *,
        docs: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        parts: Iterable[str] = (),
        parts_timeout: float = 0.0,
        copy: bool = True,
        buffers: HostBuffers | None = None,
    ) -> StagedStep:
        """The first half of `save`: everything checked and copied, nothing written; the caller may change the
        state as soon as it returns, and `write_staged` (in another thread, say) writes it.

        `trees` maps a name to a state tree (a `state_dict()`: tensors, numbers, strings, lists, dicts),
        each written as `<name>.safetensors` + `<name>.json` and read back as `Checkpoint.trees[name]`;
        `docs` maps `<group>/<name>` ("data/worker-0") to JSON, read back as `Checkpoint.docs`; `extra`
        is JSON-able run information stored in state.json. `parts` names files other tasks contribute
        with `save_part`, awaited for `parts_timeout` seconds. The trees' tensors are copied to the host
        (into `buffers`, `staging.HostBuffers`, where given; `copy=False` keeps them as they are) and the
        documents serialized.
        """
        step = check_step(step)
        trees = dict(trees or {})
        names, doc_files = write.tree_names(trees), write.doc_files(docs)
        parts = list(dict.fromkeys(parts))
        for name in parts:
            check_part_name(name)
        if buffers is not None:
            buffers.start()
        staged = {name: stage_tree(name, tree, copy, buffers) for name, tree in trees.items()}
        if buffers is not None:
            buffers.done()
        return StagedStep(step, names, staged, write.doc_bytes(doc_files), write.extra_meta(extra), parts,
                          float(parts_timeout))

    def write_staged(self, staged: StagedStep) -> Path:
        """The second half of `save`: write, seal, publish and rotate what `stage` copied; returns the folder."""
        own = partial(write.write_own, trees=staged.trees, docs=staged.docs, fsync=self.fsync)
        return self._build(staged.step, own, staged.parts, staged.parts_timeout, staged.extra, staged.tree_names)

    def save_part(self, step: int, name: str, data: bytes) -> Path:
        """Contribute one file to step `step` from another task (a parameter-server shard, an iterator state).

        Written atomically (temp file, fsync, rename) into `.parts-step-XXXXXXXX/<name>`, where the
        chief's `save(..., parts=[name])` or `finalize` picks it up. Names are file names, or
        `<group>/<name>.json` for JSON documents (those come back in `Checkpoint.docs`).
        """
        step = check_step(step)
        check_part_name(name)
        # A part for a step that is complete already is staged all the same: a job resumed from an older
        # step (or started over) writes that step again, in full, and the chief's save replaces the folder.
        path = atomic_write(self._parts_dir(step) / name, data, fsync=self.fsync)
        fault.point("part-written", step)
        return path

    def finalize(
        self,
        step: int,
        expected_parts: Iterable[str],
        extra: Mapping[str, Any] | None = None,
        timeout: float = 0.0,
    ) -> Path:
        """Make step `step` from contributed parts alone (waiting up to `timeout` s for them) and return it."""
        parts = list(dict.fromkeys(expected_parts))
        for name in parts:
            check_part_name(name)
        return self._build(check_step(step), lambda tmp: [], parts, timeout, write.extra_meta(extra), [])

    def _build(
        self, step: int, write_own: Callable[[Path], list[str]], parts: list[str], timeout: float, meta: Any,
        trees: list[str],
    ) -> Path:
        """Fill a `.tmp-*` folder (own files, state.json, the parts), seal it, rename it into place, rotate.
        `parts` are checked names; `meta` is `write.extra_meta(extra)`."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{step_folder_name(step)}-{secrets.token_hex(4)}"
        tmp.mkdir()
        staging, collected = self._parts_dir(step), []
        self._writing.add(tmp.name)
        try:
            files = list(write_own(tmp))
            clash = sorted(set(files) & set(parts))
            if clash:
                raise CheckpointError(f"step {step}: parts {clash} clash with files the chief writes; rename them")
            files.append(write.write_state(tmp, step, meta, trees, self.fsync))
            collected = write.collect_parts(step, staging, tmp, parts, timeout)
            fault.point("after-parts", step)
            write.seal(step, tmp, files + collected, self.fsync)
            fault.point("after-seal", step)
            final = self._publish(step, tmp)
        except BaseException:
            write.return_parts(staging, tmp, collected)  # other tasks' work survives for a retry
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self._writing.discard(tmp.name)
        shutil.rmtree(staging, ignore_errors=True)  # stragglers for a finished step
        self._rotate(step)
        # Later steps' staging folders may be filling now (other tasks of this job): spared whatever their age.
        self.remove_leftovers(spare_from=step + 1)
        return final

    def _publish(self, step: int, tmp: Path) -> Path:
        """Rename the sealed `tmp` to its step folder (an older save of the step moved aside first), then `latest`.

        The rename is the commit point (`conveyor.stepfolders`): a crash after it leaves step `step` the
        one to resume from whether or not `latest` moved; a crash between moving an older save aside and
        the rename leaves neither, and the job resumes from the step before and writes this one again.
        """
        final = self.step_dir(step)
        trash = self.root / f".trash-{final.name}-{secrets.token_hex(4)}"
        try:
            os.rename(final, trash)  # re-saving a step: the old folder must go before the new can take its name
        except FileNotFoundError:
            trash = None
        fault.point("before-rename", step)
        os.rename(tmp, final)
        if self.fsync:
            sync_dir(self.root)
        fault.point("after-rename", step)
        atomic_write(self.root / LATEST, (final.name + "\n").encode(), fsync=self.fsync)
        fault.point("after-latest", step)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return final

    def drop_staged_from(self, step: int | None) -> None:
        """Delete the parts staged for step `step` and later (None: every one): an abandoned attempt's, which a
        resumed job must not mix into its own saves (step `step` itself is complete: its leftovers are stale).
        The chief calls it before any task trains."""
        for folder in self.root.glob(".parts-step-*"):
            m = STEP_RE.fullmatch(folder.name[len(".parts-"):])
            if m and (step is None or int(m.group(1)) >= step):
                shutil.rmtree(folder, ignore_errors=True)

    # -- rotation and leftovers --------------------------------------------------------------------------------

    def _rotate(self, just_written: int) -> None:
        if self.keep is None:
            return
        written = self._complete_steps()  # step -> time its manifest was written
        # Newest by write time, not by step number: after a run is rewound (resumed from an older
        # step), the abandoned run's higher steps are the ones that age out.
        by_age = sorted(written, key=lambda s: (written[s], s))
        protected = set(by_age[-self.keep :]) | {just_written}
        # The newest step with finite parameters stays, however many non-finite ones come after it: a run that
        # diverged (NaN) keeps one checkpoint to go back to (docs/training.md, "Non-finite losses").
        finite = next((s for s in reversed(by_age) if is_finite_step(self.step_dir(s))), None)
        if finite is not None:
            protected.add(finite)
        pointed = self._latest_pointer()
        if pointed is not None:
            protected.add(pointed)
        for s in by_age:
            if s not in protected:
                self._remove(self.step_dir(s))
                fault.point("during-rotation", just_written)

    def _remove(self, folder: Path) -> None:
        """Rename away first (atomic), then delete: a reader never sees a step folder losing files."""
        trash = self.root / f".trash-{folder.name}-{secrets.token_hex(4)}"
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def cleanup(self, older_than: float = LEFTOVER_AGE, spare_from: int | None = None) -> list[Path]:
        """Delete what crashed writers left behind and return it: `.tmp-*` folders and files and `.parts-*`
        folders untouched for `older_than` seconds (the folder's mtime and its newest file's), and every
        `.trash-*` folder. Never a `.tmp-*` this manager is filling, nor (`spare_from`) the staging folder of
        step `spare_from` or a later one: other tasks of the running job may be contributing to it.

        The age limit protects a writer that is still busy (possibly on another machine): keep it well above
        the time one checkpoint takes to write. A `.trash-*` folder is removed at any age: only a rename by
        rotation or a re-save makes one, and nothing reads it after that rename.
        """
        removed = []
        if not self.root.is_dir():
            return removed
        now = time.time()
        for p in self.root.iterdir():
            if p.name in self._writing or _staged_from(p.name, spare_from):
                continue
            # ".latest-*": the pointer's temporary file as conveyor before fileio.atomic_write named it
            stale = p.name.startswith((".tmp-", ".parts-", ".latest-")) and now - _newest_mtime(p) >= older_than
            if stale or p.name.startswith(".trash-"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
        return removed

    def remove_leftovers(self, spare_from: int | None = None) -> list[Path]:
        """`cleanup()` at the default age, saying what it removed (a warning: each is a save that crashed). The
        chief calls it when it starts (before any task trains) and after every save."""
        removed = self.cleanup(spare_from=spare_from)
        if removed:
            log.warning("removed %d leftover(s) of interrupted checkpoint saves under %s (untouched for %.0f min "
                        "or more, or already renamed for deletion): %s", len(removed), self.root,
                        LEFTOVER_AGE / 60, ", ".join(sorted(p.name for p in removed)))
        return removed


def _staged_from(name: str, step: int | None) -> bool:
    """Whether `name` is the staging folder (`.parts-step-N`) of step `step` or a later one."""
    m = STEP_RE.fullmatch(name[len(".parts-"):]) if name.startswith(".parts-") else None
    return m is not None and step is not None and int(m.group(1)) >= step


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
