"""CheckpointManager: resume equals the uninterrupted run, atomic visibility, rotation, damage, several writers."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

import conveyor.fileio
import conveyor.stepfolders as ckpt_steps
import conveyor.train.checkpoint.items as ckpt_items
import conveyor.train.checkpoint.policy
import conveyor.train.checkpoint.read as ckpt_files
import conveyor.train.checkpoint.store as ckpt_mod
import conveyor.train.checkpoint.write as ckpt_write
from conveyor.train.checkpoint import CheckpointError, CheckpointManager, CheckpointPolicy
from conveyor.train.state_io import rng_state, set_rng_state

# ---------------------------------------------------------------------------------------------------------------------
# helpers


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95)),
}


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """Each step draws its batch from torch's RNG, so a resume that forgot the RNG state would diverge."""
    for _ in range(steps):
        x = torch.randn(16, 4)
        y = x[:, :2].sum(dim=1, keepdim=True).expand(16, 2)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def tiny_state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), float(value)), "b": torch.full((4,), float(value))}


def save_tiny(mgr: CheckpointManager, step: int, **kw) -> Path:
    return mgr.save(
        step, {"model": tiny_state(step),
               "optimizer": {"state": {0: {"m": torch.full((2,), float(step))}}, "param_groups": []}}, **kw
    )


def assert_no_partial_step_folder(root: Path) -> None:
    mgr = CheckpointManager(root)
    for p in root.iterdir():
        if p.name.startswith("step-"):
            assert mgr._is_complete(p) or not p.exists(), f"{p} is visible but incomplete"


# ---------------------------------------------------------------------------------------------------------------------
# resume


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_resume_matches_uninterrupted_run(tmp_path, opt_name):
    model = make_model(0)
    opt = OPTIMIZERS[opt_name](model.parameters())
    train(model, opt, 3)
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(3, {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state()})
    train(model, opt, 2)  # the uninterrupted run

    fresh = make_model(123)  # different initial weights, different RNG position
    fresh_opt = OPTIMIZERS[opt_name](fresh.parameters())
    ck = CheckpointManager(tmp_path / "ckpt").load()
    assert ck.step == 3
    fresh.load_state_dict(ck.trees["model"])
    fresh_opt.load_state_dict(ck.trees["optimizer"])
    set_rng_state(ck.trees["rng"])
    train(fresh, fresh_opt, 2)

    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_folder_contents_manifest_and_round_trip(tmp_path):
    mgr = CheckpointManager(tmp_path)
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 1)
    path = mgr.save(
        1234,
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state()},
        extra={"epoch": 2, "per_class": {3: 0.5}, "best": float("inf")},
        docs={"data/worker-0": {"pos": 17, "files": ["a", "b"]}, "data/worker-1": {"pos": 3}},
    )
    assert path == tmp_path / "step-00001234"
    assert (tmp_path / "latest").read_text().strip() == "step-00001234"
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert names == sorted(
        ["COMPLETE", "state.json", "model.safetensors", "model.json", "optimizer.safetensors", "optimizer.json"]
        + ["rng.safetensors", "rng.json", "data/worker-0.json", "data/worker-1.json"]
    )
    manifest = json.loads((path / "COMPLETE").read_text())
    assert manifest["step"] == 1234 and set(manifest["parts"]) == set(names) - {"COMPLETE"}
    assert all(len(p["sha256"]) == 64 and p["size"] > 0 for p in manifest["parts"].values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left behind

    ck = mgr.load()
    assert ck.step == 1234 and ck.path == path
    assert ck.extra == {"epoch": 2, "per_class": {3: 0.5}, "best": float("inf")}
    assert ck.group("data") == {"worker-0": {"pos": 17, "files": ["a", "b"]}, "worker-1": {"pos": 3}}
    assert list(ck.trees["optimizer"]["state"]) == list(opt.state_dict()["state"])  # int keys stay ints
    assert ck.trees["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    assert ck.time is not None and ck.parts["model.safetensors"] == path / "model.safetensors"


def test_model_only_save(tmp_path):
    mgr = CheckpointManager(tmp_path, fsync=False)
    mgr.save(0, {"model": tiny_state(0)})
    ck = mgr.load(0)
    assert ck.trees.get("optimizer") is None and ck.trees.get("rng") is None and ck.group("data") == {}
    assert ck.extra == {}
    assert torch.equal(ck.trees["model"]["w"], tiny_state(0)["w"])


def test_resaving_a_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, fsync=False)
    mgr.save(5, {"model": tiny_state(1)})
    mgr.save(5, {"model": tiny_state(2)})
    assert mgr.list_steps() == [5]
    assert mgr.load().trees["model"]["w"][0, 0].item() == 2.0


# ---------------------------------------------------------------------------------------------------------------------
# finding checkpoints


def test_keep_k_rotation_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, fsync=False)
    assert mgr.latest_step() is None and mgr.list_steps() == []
    for step in (10, 20, 30, 40, 50):
        save_tiny(mgr, step)
        assert mgr.latest_step() == step
    assert mgr.list_steps() == [40, 50]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000040", "step-00000050"]

    save_tiny(mgr, 5)  # a rewound run: the newest *written* are kept, so the abandoned higher steps age out
    assert mgr.list_steps() == [5, 50] and mgr.latest_step() == 5
    save_tiny(mgr, 6)
    assert mgr.list_steps() == [5, 6] and mgr.latest_step() == 6

    keep_all = CheckpointManager(tmp_path / "all", keep=None, fsync=False)
    for step in range(4):
        save_tiny(keep_all, step)
    assert keep_all.list_steps() == [0, 1, 2, 3]


def test_latest_falls_back_to_highest_complete_step(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=None, fsync=False)
    for step in (1, 2, 3):
        save_tiny(mgr, step)
    (tmp_path / "step-00000009").mkdir()  # written by something non-atomic: no COMPLETE
    (tmp_path / "step-00000009" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".tmp-step-00000010-deadbeef").mkdir()
    os.unlink(tmp_path / "latest")
    assert mgr.latest_step() == 3
    (tmp_path / "latest").write_text("step-00000042\n")  # points at nothing
    assert mgr.latest_step() == 3
    (tmp_path / "latest").write_text("garbage")
    assert mgr.latest_step() == 3
    (tmp_path / "latest").write_text("step-00000002")  # the newest sealed step wins over the pointer (issue 19)
    assert mgr.latest_step() == 3
    assert mgr.list_steps() == [1, 2, 3]
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        mgr.load(9)


def test_missing_root_has_no_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path / "nothing-here")
    assert mgr.latest_step() is None and mgr.list_steps() == [] and mgr.cleanup() == []
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        mgr.load()
    assert not (tmp_path / "nothing-here").exists()  # readers create nothing


# ---------------------------------------------------------------------------------------------------------------------
# crashes and damage


def _fail_tensor_write(monkeypatch):
    real = ckpt_write.save_tensors

    def save_tensors(path, *a, **k):
        if Path(path).name == "optimizer.safetensors":
            raise OSError("disk full (simulated)")
        return real(path, *a, **k)

    monkeypatch.setattr(ckpt_write, "save_tensors", save_tensors)


def _fail_manifest(monkeypatch):
    real = ckpt_write.write_file

    def write_file(path, data, **kw):
        if path.name == "COMPLETE":
            real(path, data[: len(data) // 2], **kw)  # a torn write, then the crash
            raise OSError("crash while writing the manifest (simulated)")
        return real(path, data, **kw)

    monkeypatch.setattr(ckpt_write, "write_file", write_file)


def _fail_rename(monkeypatch):
    real = os.rename

    def rename(src, dst, *a, **k):
        if Path(dst).name.startswith("step-"):
            raise OSError("crash before the rename (simulated)")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)


def _fail_latest(monkeypatch):
    real = os.replace

    def replace(src, dst, *a, **k):
        if Path(dst).name == "latest":
            raise OSError("crash before the pointer moved (simulated)")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)


# A crash before the rename keeps the previous checkpoint; after it (the pointer not moved) the step is
# committed: the rename is the commit point, and `latest` does not decide (issue 19).
@pytest.mark.parametrize(("crash", "kept"), [(_fail_tensor_write, 1), (_fail_manifest, 1), (_fail_rename, 1),
                                             (_fail_latest, 2)])
def test_crash_at_any_stage_keeps_previous_checkpoint(tmp_path, monkeypatch, crash, kept):
    mgr = CheckpointManager(tmp_path, keep=1)
    save_tiny(mgr, 1)
    crash(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        save_tiny(mgr, 2)
    monkeypatch.undo()

    assert mgr.latest_step() == kept == mgr.resume_step()
    assert mgr.load().trees["model"]["w"][0, 0].item() == float(kept)
    assert_no_partial_step_folder(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-") or p.name.startswith(".latest-")]
    save_tiny(mgr, 3)  # and the next save works
    assert mgr.latest_step() == 3 and mgr.list_steps() == [3]


def test_cleanup_removes_only_stale_leftovers(tmp_path):
    mgr = CheckpointManager(tmp_path, fsync=False)
    save_tiny(mgr, 1)
    old, fresh = tmp_path / ".tmp-step-00000002-0badc0de", tmp_path / ".tmp-step-00000003-c0ffee00"
    for d in (old, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    stale_parts = tmp_path / ".parts-step-00000002"
    stale_parts.mkdir()
    (stale_parts / "ps-0.safetensors").write_bytes(b"x")
    trash = tmp_path / ".trash-step-00000000-12345678"
    trash.mkdir()
    an_hour_ago = time.time() - 3600
    for p in (old, old / "model.safetensors", stale_parts, stale_parts / "ps-0.safetensors"):
        os.utime(p, (an_hour_ago, an_hour_ago))

    removed = mgr.cleanup(older_than=600)
    assert sorted(p.name for p in removed) == sorted([old.name, stale_parts.name, trash.name])
    assert fresh.exists() and mgr.latest_step() == 1


def _leftover(root: Path, name: str, age: float) -> Path:
    """A crashed save's folder with one file, both last touched `age` seconds ago."""
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"partial")
    then = time.time() - age
    for p in (folder / "model.safetensors", folder):
        os.utime(p, (then, then))
    return folder


def test_a_save_removes_old_leftovers_and_spares_live_ones(tmp_path, caplog):
    """Leftovers of crashed saves go at the next save once untouched for LEFTOVER_AGE; a fresh one, one with a
    freshly written file in an old folder, and the staging folder of a later step (other tasks of the running
    job may be filling it) stay."""
    mgr = CheckpointManager(tmp_path, fsync=False)
    age = ckpt_mod.LEFTOVER_AGE
    old_tmp = _leftover(tmp_path, ".tmp-step-00000002-0badc0de", age + 60)
    old_parts = _leftover(tmp_path, ".parts-step-00000001", age + 60)
    fresh_tmp = _leftover(tmp_path, ".tmp-step-00000002-c0ffee00", age - 120)
    busy = _leftover(tmp_path, ".parts-step-00000002", age + 60)  # a file in it written just now: in use
    (busy / "ps-1.safetensors").write_bytes(b"fresh")
    later = _leftover(tmp_path, ".parts-step-00000009", age + 60)
    with caplog.at_level("WARNING", logger="conveyor.train.checkpoint"):
        save_tiny(mgr, 3)
    assert not old_tmp.exists() and not old_parts.exists()
    assert fresh_tmp.exists() and busy.exists() and later.exists()
    said = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
    assert len(said) == 1 and old_tmp.name in said[0] and old_parts.name in said[0] and str(tmp_path) in said[0]
    assert fresh_tmp.name not in said[0]
    assert mgr.latest_step() == 3 and mgr.list_steps() == [3]

    caplog.clear()
    with caplog.at_level("WARNING", logger="conveyor.train.checkpoint"):
        save_tiny(mgr, 4)  # nothing old is left: silent
    assert not [r for r in caplog.records if "leftover" in r.getMessage()]
    assert fresh_tmp.exists() and busy.exists() and later.exists()


def test_cleanup_never_touches_the_folder_being_written(tmp_path, monkeypatch):
    """A save whose own `.tmp-*` folder looks old (a clock step, a slow writer) does not lose it to cleanup."""
    mgr = CheckpointManager(tmp_path, fsync=False)
    seen = {}

    def seal_after_cleanup(step, tmp, files, fsync, real=ckpt_write.seal):
        past = time.time() - 2 * ckpt_mod.LEFTOVER_AGE
        for p in (tmp, *tmp.rglob("*")):
            os.utime(p, (past, past))
        seen["removed"] = mgr.cleanup()
        return real(step, tmp, files, fsync)

    monkeypatch.setattr(ckpt_write, "seal", seal_after_cleanup)
    save_tiny(mgr, 1)
    assert seen["removed"] == [] and mgr.list_steps() == [1]


def test_the_resuming_chief_removes_old_leftovers(tmp_path, caplog):
    from types import SimpleNamespace

    from conveyor.train.resume import resume

    mgr = CheckpointManager(tmp_path, fsync=False)
    save_tiny(mgr, 5)
    old = _leftover(tmp_path, ".tmp-step-00000010-0badc0de", ckpt_mod.LEFTOVER_AGE + 5)
    fresh = _leftover(tmp_path, ".tmp-step-00000010-c0ffee00", 5)
    trash = _leftover(tmp_path, ".trash-step-00000001-12345678", 5)  # renamed for deletion: garbage at any age
    job = SimpleNamespace(resume=True, is_chief=True, world_size=1, broadcast_bytes=lambda data, src: data)
    with caplog.at_level("WARNING", logger="conveyor.train.checkpoint"):
        assert resume(job, mgr, {}).step == 5
    assert not old.exists() and not trash.exists() and fresh.exists()
    assert any(old.name in r.getMessage() and trash.name in r.getMessage() for r in caplog.records)


def test_damaged_file_is_named(tmp_path):
    mgr = CheckpointManager(tmp_path, fsync=False)
    save_tiny(mgr, 1)
    save_tiny(mgr, 2)
    target = tmp_path / "step-00000002" / "optimizer.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the sha256 notices
    target.write_bytes(bytes(data))

    assert mgr.latest_step() == 2
    with pytest.raises(CheckpointError, match=r"step-00000002/optimizer\.safetensors: damaged.*Delete"):
        mgr.load()
    assert mgr.load(1).step == 1
    mgr.load(2, verify=False)  # the caller can insist

    target.write_bytes(bytes(data[:-10]))  # truncated: the step no longer counts as complete
    assert mgr.latest_step() == 1 and mgr.list_steps() == [1]


def test_damaged_manifest_or_tree_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path, fsync=False)
    save_tiny(mgr, 1)
    folder = tmp_path / "step-00000001"
    (folder / "model.json").write_text('{"format": "conveyor.state", "version": 1, "tree": {"w": {"__tensor__": "z"}}}')
    with pytest.raises(CheckpointError, match="model"):
        mgr.load(1, verify=False)
    (folder / "COMPLETE").write_text("{not json")
    assert mgr.latest_step() is None
    with pytest.raises(CheckpointError, match="COMPLETE: not valid JSON"):
        mgr.load(1)


def test_reader_never_sees_an_incomplete_checkpoint(tmp_path):
    writer = CheckpointManager(tmp_path, keep=2, fsync=False)
    reader = CheckpointManager(tmp_path)
    done = threading.Event()
    seen: list[int] = []
    loaded: list[int] = []
    errors: list[BaseException] = []

    def read_loop():
        try:
            while not done.is_set():
                step = reader.latest_step()
                if step is None:
                    continue
                assert not seen or step >= seen[-1], "latest went backwards"
                seen.append(step)
                try:
                    ck = reader.load(step)
                except CheckpointError:
                    assert not reader.step_dir(step).exists(), "a visible checkpoint failed to load"
                    continue
                assert ck.trees["model"]["w"].eq(step).all() and ck.trees["optimizer"]["state"][0]["m"].eq(step).all()
                loaded.append(step)
                assert_no_partial_step_folder(tmp_path)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for step in range(1, 21):
            save_tiny(writer, step)
    finally:
        done.set()
        thread.join(timeout=10)
    assert not errors, errors[0]
    assert loaded and writer.latest_step() == 20 and writer.list_steps() == [19, 20]


# ---------------------------------------------------------------------------------------------------------------------
# several writers


def test_parts_from_other_tasks_join_the_step(tmp_path):
    chief = CheckpointManager(tmp_path, fsync=False)
    ps = CheckpointManager(tmp_path)
    shard = {"embedding.weight": torch.randn(6, 3)}

    def contribute():
        time.sleep(0.05)  # arrives while the chief is already waiting
        ps.save_part(100, "ps-0.safetensors", safetensors_bytes(shard))
        ps.save_part(100, "data/worker-1.json", json.dumps({"pos": 9}).encode())

    t = threading.Thread(target=contribute)
    t.start()
    path = chief.save(
        100,
        {"model": tiny_state(1)},
        docs={"data/worker-0": {"pos": 8}},
        parts=["ps-0.safetensors", "data/worker-1.json"],
        parts_timeout=5,
    )
    t.join()
    manifest = json.loads((path / "COMPLETE").read_text())
    assert {"ps-0.safetensors", "data/worker-1.json", "data/worker-0.json"} <= set(manifest["parts"])
    assert not (tmp_path / ".parts-step-00000100").exists()

    ck = chief.load()
    assert ck.group("data") == {"worker-0": {"pos": 8}, "worker-1": {"pos": 9}}
    from safetensors.torch import load_file

    assert torch.equal(load_file(ck.parts["ps-0.safetensors"])["embedding.weight"], shard["embedding.weight"])

    # A part for a complete step is staged, not refused: a job that resumed from an older step writes this
    # step again in full, and the chief's save replaces the folder (issue 19: a ps job could never finish).
    ps.save_part(100, "ps-1.safetensors", b"late")
    assert (tmp_path / ".parts-step-00000100" / "ps-1.safetensors").read_bytes() == b"late"
    chief.drop_staged_from(101)
    assert (tmp_path / ".parts-step-00000100").exists()
    chief.drop_staged_from(99)  # what a chief resuming from step 99 does: an abandoned attempt's parts go
    assert not (tmp_path / ".parts-step-00000100").exists()

    # What the ps task reads back on resume: checked against the manifest.
    assert ps.read_part(100, "data/worker-1.json") == json.dumps({"pos": 9}).encode()
    with pytest.raises(CheckpointError, match="no part 'ps-1.safetensors'"):
        ps.read_part(100, "ps-1.safetensors")
    target = path / "ps-0.safetensors"
    damaged = bytearray(target.read_bytes())
    damaged[-1] ^= 1
    target.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="damaged"):
        ps.read_part(100, "ps-0.safetensors")


def test_missing_part_fails_the_save_and_keeps_latest(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, fsync=False)
    save_tiny(mgr, 1)
    mgr.save_part(2, "ps-0.safetensors", b"shard 0")
    with pytest.raises(CheckpointError, match=r"\['ps-1.safetensors'\] did not arrive"):
        mgr.save(2, {"model": tiny_state(2)}, parts=["ps-0.safetensors", "ps-1.safetensors"], parts_timeout=0.05)
    assert mgr.latest_step() == 1 and mgr.list_steps() == [1]
    assert_no_partial_step_folder(tmp_path)

    mgr.save_part(2, "ps-1.safetensors", b"shard 1")
    with monkeypatch.context() as m:  # a commit that fails hands the parts back for the retry
        _fail_rename(m)
        with pytest.raises(OSError, match="simulated"):
            mgr.finalize(2, ["ps-0.safetensors", "ps-1.safetensors"])
    assert sorted(p.name for p in (tmp_path / ".parts-step-00000002").iterdir()) == [
        "ps-0.safetensors",
        "ps-1.safetensors",
    ]
    path = mgr.finalize(2, ["ps-0.safetensors", "ps-1.safetensors"], extra={"who": "parts only"})
    ck = mgr.load()
    assert ck.step == 2 and ck.trees.get("model") is None and ck.extra == {"who": "parts only"}
    assert (path / "ps-1.safetensors").read_bytes() == b"shard 1"


def test_invalid_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
    mgr = CheckpointManager(tmp_path, fsync=False)
    with pytest.raises(ValueError, match="step"):
        mgr.save(-1, {"model": tiny_state(0)})
    for bad in ("../escape", "/abs", "COMPLETE", "model.safetensors", "a/b/c", ""):
        with pytest.raises(ValueError, match="part name"):
            mgr.save_part(1, bad, b"")
    with pytest.raises(ValueError, match="task name"):
        mgr.save(1, {"model": tiny_state(0)}, docs={"data/../x": {}})
    with pytest.raises(TypeError, match="extra holds tensors"):
        mgr.save(1, {"model": tiny_state(0)}, extra={"loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="data iterator state must be JSON"):
        mgr.save(1, {"model": tiny_state(0)}, docs={"data/w": {"s": {1, 2}}})
    with pytest.raises(CheckpointError, match="clash"):
        mgr.save_part(1, "data/w.json", b"{}")
        mgr.save(1, {"model": tiny_state(0)}, docs={"data/w": {}}, parts=["data/w.json"])
    assert mgr.list_steps() == [] and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------------------------------------------------------------
# choosing the step to resume from: damaged steps are skipped out loud


def rewrite_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / "COMPLETE").read_text())
    edit(manifest)
    (folder / "COMPLETE").write_text(json.dumps(manifest))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_step_names_each_skipped_step_and_why(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep=None, fsync=False)
    for step in (1, 2, 3, 4):
        save_tiny(mgr, step)
    assert mgr.resume_step() == 4 and not caplog.records
    (tmp_path / "step-00000004" / "COMPLETE").write_bytes(b"\x00garbage\xff")
    flip_last_byte(tmp_path / "step-00000003" / "model.safetensors")  # same size: only the sha256 notices
    (tmp_path / "step-00000002" / "optimizer.json").unlink()

    with caplog.at_level("WARNING", logger="conveyor.train.checkpoint"):
        assert mgr.resume_step() == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert re.search(r"step-00000004.*skipped.*COMPLETE: not valid JSON", lines[0])
    assert re.search(r"step-00000003.*skipped.*model\.safetensors: damaged", lines[1])
    assert re.search(r"step-00000002.*skipped.*optimizer\.json", lines[2])
    assert all(f"resuming from step 1 ({tmp_path / 'step-00000001'}) instead" in line for line in lines)
    assert mgr.load(1).step == 1


def test_resume_step_refuses_when_every_step_is_damaged(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=None, fsync=False)
    assert mgr.resume_step() is None  # nothing there: a fresh start
    for step in (1, 2):
        save_tiny(mgr, step)
        (tmp_path / f"step-{step:08d}" / "COMPLETE").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path))}.*2 step.*damaged.*move.*--no-resume"):
        mgr.resume_step()


def test_manifest_part_names_stay_inside_the_step(tmp_path, caplog):
    root = tmp_path / "out" / "checkpoints"
    mgr = CheckpointManager(root, fsync=False)
    mgr.save_part(1, "ps-0.json", b"{}")
    folder = save_tiny(mgr, 1, parts=["ps-0.json"])
    secret = b'{"format": "stolen"}'
    (tmp_path / "x.json").write_bytes(secret)
    entry = {"size": len(secret), "sha256": hashlib.sha256(secret).hexdigest()}
    for bad in ("data/../../../../x.json", str(tmp_path / "x.json"), "data/x\x00.json", "a" * 300 + ".json",
                "data/./x.json", "data//x.json", ""):
        rewrite_manifest(folder, lambda m, bad=bad: m["parts"].update({bad: entry}))
        for read in (lambda: mgr.load(1), lambda: mgr.read_part(1, "ps-0.json"), lambda: mgr.check(1)):
            with pytest.raises(CheckpointError, match=r"step-00000001/COMPLETE: part .*not a plain name inside"):
                read()
        caplog.clear()
        with pytest.raises(CheckpointError, match="all 1 step folder"):
            mgr.resume_step()
        assert "not a plain name inside" in caplog.records[0].getMessage()
        assert mgr.list_steps() == []  # and not a crash (a NUL made stat() raise ValueError)
        rewrite_manifest(folder, lambda m, bad=bad: m["parts"].pop(bad))
    assert mgr.load(1).step == 1


def test_symlinks_out_of_the_step_are_refused(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints", fsync=False)
    folder = mgr.save(1, {"model": tiny_state(1)}, docs={"data/worker-0": {"pos": 1}})
    outside = tmp_path / "elsewhere"
    (folder / "data").rename(outside)
    (folder / "data").symlink_to(outside)  # same bytes, so the sha256 matches
    with pytest.raises(CheckpointError, match=r"step-00000001.*data/worker-0\.json.*outside"):
        mgr.load(1)
    (folder / "data").unlink()
    (folder / "data").mkdir()
    (folder / "data" / "worker-0.json").symlink_to(folder / "model.json")  # inside: harmless, but not what was hashed
    with pytest.raises(CheckpointError, match="worker-0.json: damaged"):
        mgr.load(1)


def test_manifest_size_is_bounded_before_parsing(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, fsync=False)
    folder = save_tiny(mgr, 1)
    monkeypatch.setattr(ckpt_steps, "MANIFEST_MAX_BYTES", 100)  # moved there from read.py
    with pytest.raises(CheckpointError, match=r"COMPLETE: \d+ bytes, more than a manifest.*100"):
        mgr.load(1)
    monkeypatch.undo()
    assert mgr.load(1).step == 1
    (folder / "COMPLETE").write_text("[" * 100_000)  # nesting deep enough to exhaust the parser's stack
    with pytest.raises(CheckpointError, match="COMPLETE"):
        mgr.load(1)


@pytest.mark.parametrize("edit", [
    lambda m: m["parts"]["model.json"].update(size="12"),
    lambda m: m["parts"]["model.json"].update(sha256=5),
    lambda m: m["parts"]["model.json"].update(size=-1),
    lambda m: m["parts"].update({"model.json": []}),
    lambda m: m.update(time="yesterday"),
    lambda m: m.update(step=True),
])
def test_manifest_with_wrong_types_is_refused(tmp_path, edit):
    mgr = CheckpointManager(tmp_path, fsync=False)
    folder = save_tiny(mgr, 1)
    rewrite_manifest(folder, edit)
    assert mgr.list_steps() == [] and mgr.latest_step() is None
    with pytest.raises(CheckpointError, match=r"step-00000001/COMPLETE"):
        mgr.load(1)


@pytest.mark.parametrize("name, text", [
    ("state.json", "[1, 2]"),
    ("state.json", '{"extra": {"__dict__": 5}, "time": 1}'),
    ("state.json", '{"extra": {}, "time": 1, "trees": [5]}'),
    ("state.json", '{"extra": {}, "time": 1, "trees": ["model", "nothing"]}'),
    ("model.json", '{"format": "conveyor.state", "version": 1, "tree": {"w": {"__npscalar__": "nope", "value": 1}}}'),
    ("model.json", '{"format": "conveyor.state", "version": 1, "tree": {"w": {"__tensor__": ["w"]}}}'),
    ("data/worker-0.json", "{not json"),
])
def test_json_parts_of_the_wrong_shape_name_the_file_and_step(tmp_path, name, text):
    mgr = CheckpointManager(tmp_path, fsync=False)
    folder = mgr.save(1, {"model": tiny_state(1)}, docs={"data/worker-0": {"pos": 1}})
    (folder / name).write_text(text)
    with pytest.raises(CheckpointError, match=rf"step-00000001/{re.escape(name)}.*step 1"):
        mgr.load(1, verify=False)


def test_a_bad_ps_shard_names_the_file_and_step(tmp_path):
    mgr = CheckpointManager(tmp_path, fsync=False)
    mgr.save_part(7, "ps-0.safetensors", struct.pack("<Q", 1 << 40) + b"{}")  # a header "too large"
    mgr.save_part(7, "ps-0.json", b"{not json")
    mgr.save_part(7, "ps-1.safetensors", safetensors_bytes({"w": torch.ones(2)}))
    mgr.finalize(7, ["ps-0.safetensors", "ps-0.json", "ps-1.safetensors"])
    for name in ("ps-0.safetensors", "ps-0.json"):
        with pytest.raises(CheckpointError, match=rf"step-00000007/{re.escape(name)}: .*step 7.*(move|delete)"):
            mgr.read_part(7, name)
    assert mgr.read_part(7, "ps-1.safetensors") == safetensors_bytes({"w": torch.ones(2)})


# ---------------------------------------------------------------------------------------------------------------------
# file modes: every file conveyor writes into the output folder follows the umask


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_files_follow_the_umask(tmp_path, umask):
    from conveyor.train.profiler import StepProfiler
    from conveyor.train.summary import write_json_atomic

    old = os.umask(umask)
    try:
        mgr = CheckpointManager(tmp_path / "checkpoints", fsync=False)
        mgr.save_part(1, "ps-0.safetensors", safetensors_bytes({"w": torch.ones(2)}))
        mgr.save(1, {"model": tiny_state(1), "optimizer": {"state": {}, "param_groups": []}, "rng": rng_state()},
                 docs={"data/worker-0": {"pos": 1}}, parts=["ps-0.safetensors"])
        write_json_atomic(tmp_path / "summary.json", {"steps": 1})
        StepProfiler().write_trace(tmp_path / "trace.json")
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "optimizer.safetensors", "rng.safetensors",
                                       "ps-0.safetensors", "COMPLETE", "latest", "summary.json", "trace.json"}
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))


# ---------------------------------------------------------------------------------------------------------------------
# policy


def test_policy_every_steps_and_seconds():
    p = CheckpointPolicy(every_steps=3)
    assert [s for s in range(10) if p.should_save(s, now=0.0)] == [3, 6, 9]
    assert not p.should_save(9, now=0.0)  # one save per step

    p = CheckpointPolicy(every_seconds=10)
    assert [s for s, now in enumerate([0, 4, 9.9, 10, 15, 19.9, 20.5]) if p.should_save(s, now=now)] == [3, 6]

    p = CheckpointPolicy(every_steps=100, every_seconds=5)
    assert p.should_save(1, now=0) is False and p.should_save(2, now=6) is True and p.should_save(100, now=7) is True
    assert p.should_save(101, now=8) is False

    assert not any(CheckpointPolicy().should_save(s, now=s * 1e6) for s in range(5))
    with pytest.raises(ValueError):
        CheckpointPolicy(every_steps=0)
    with pytest.raises(ValueError):
        CheckpointPolicy(every_seconds=-1)


def test_no_pickle_in_the_checkpoint_code():
    for module in (ckpt_mod, ckpt_files, ckpt_steps, ckpt_write, ckpt_items, conveyor.train.checkpoint.policy,
                   conveyor.fileio,
                   __import__("conveyor.train.state_io", fromlist=["x"])):
        source = Path(module.__file__).read_text()
        assert not re.search(r"import pickle|cloudpickle|(?<![\w.])torch\.(save|load)\(", source), module.__name__


def test_a_step_sealed_before_latest_moved_is_resumed_and_can_be_written_again(tmp_path):
    """Issue 19's crash window: step 30 sealed and renamed, the task killed before `latest` moved."""
    chief, ps = CheckpointManager(tmp_path, keep=None, fsync=False), CheckpointManager(tmp_path, fsync=False)
    for step in (20, 30):
        ps.save_part(step, "ps-0.json", json.dumps({"step": step}).encode())
        save_tiny(chief, step, parts=["ps-0.json"])
    (tmp_path / "latest").write_text("step-00000020\n")
    assert chief.resume_step() == 30 == chief.latest_step()  # the rename committed it; `latest` does not decide
    assert chief.load().step == 30
    # A job that goes over step 30 again (started over, or resumed from 20 with 30 damaged) writes it again
    # in full: the ps part is staged, and the chief's save replaces the old folder.
    ps.save_part(30, "ps-0.json", b'{"step": "again"}')
    save_tiny(chief, 30, parts=["ps-0.json"])
    assert chief.read_part(30, "ps-0.json") == b'{"step": "again"}'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".trash-", ".tmp-", ".parts-"))]
    assert (tmp_path / "latest").read_text().strip() == "step-00000030"


def test_rotation_keeps_the_newest_step_with_finite_parameters(tmp_path):
    """Issue 22, defect 2: a run that went NaN keeps one checkpoint to go back to, whatever `keep` says."""
    mgr = CheckpointManager(tmp_path, keep=2, fsync=False)
    mgr.save(1, {"model": {"w": torch.ones(2)}}, extra={"finite": True})
    mgr.save(2, {"model": {"w": torch.ones(2)}}, extra={"finite": True})
    for step in (3, 4, 5):
        mgr.save(step, {"model": {"w": torch.full((2,), float("nan"))}}, extra={"finite": False})
    assert mgr.list_steps() == [2, 4, 5]
    mgr.save(6, {"model": {"w": torch.ones(2)}}, extra={"finite": True})
    assert mgr.list_steps() == [5, 6]  # a newer finite step: the old one may go
