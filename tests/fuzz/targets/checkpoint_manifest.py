"""Fuzz target: a checkpoint manifest (the COMPLETE file) as CheckpointManager reads it, in a real step folder.

The bytes replace the manifest of a small valid step (model, optimizer, data state, two ps parts);
then the step is listed, checked, loaded and its parts read, as a resuming job and a ps task would.
Oracle: each call returns, or raises CheckpointError naming what is wrong. Anything else (a
TypeError from a wrongly typed field, a ValueError from a NUL in a part name, reading a file outside
the step folder) is a finding.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import _common

from conveyor.train.checkpoint import MANIFEST, CheckpointError, CheckpointManager

EXPECTED = (CheckpointError,)



_root = Path(_common.private_temp_dir("conveyor-fuzz-checkpoint-"))
_mgr = CheckpointManager(_root / "checkpoints", keep=None, fsync=False)
# Every input skips the step: one warning each would flood the fuzzer's output.
logging.getLogger("conveyor.train.checkpoint").setLevel(logging.ERROR)


def _fixture() -> bytes:
    """Write step 1 and return its manifest with a fixed time, so the seed is the same in every run."""
    import torch
    from safetensors.torch import save as safetensors_bytes

    _mgr.save_part(1, "ps-0.safetensors", safetensors_bytes({"w": torch.ones(3)}))
    _mgr.save_part(1, "ps-0.json", b'{"ps": 0}')
    folder = _mgr.save(1, {"model": {"w": torch.arange(4.0)},
                           "optimizer": {"state": {0: {"m": torch.zeros(4)}}, "param_groups": []}},
                       extra={"epoch": 0}, docs={"data/worker-0": {"pos": 3}},
                       parts=["ps-0.safetensors", "ps-0.json"])
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["time"] = 0.0
    return json.dumps(manifest, sort_keys=True).encode()


_VALID = _fixture()
(_root / "x.json").write_bytes(b"{}")  # beside the checkpoints: no manifest may reach it

SEEDS = [
    _VALID,
    _VALID.replace(b'"data/worker-0.json"', b'"data/../../x.json"'),
    _VALID.replace(b'"ps-0.json"', b'"ps-0\\u0000.json"'),
    b'{"format": "conveyor.checkpoint", "version": 1, "step": 1, "time": 0, "parts": {}}',
]


def target(data: bytes) -> None:
    """Replace the manifest with `data`, then read the step every way a job does."""
    (_mgr.step_dir(1) / MANIFEST).write_bytes(data)
    _mgr.list_steps()
    _mgr.latest_step()
    for call in (
        lambda: _mgr.resume_step(),  # check() with sha256s: what a resuming chief does first
        lambda: _mgr.read_part(1, "ps-0.json"),
        lambda: _mgr.read_part(1, "ps-0.safetensors"),
    ):
        try:
            call()
        except CheckpointError:
            pass
    _mgr.load(1, verify=False)  # no sha256 check: mutated sizes and hashes still reach the parts' parsers
