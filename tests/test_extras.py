"""A core install without the optional extras: runs finish, skip what needs them, and say so once."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conveyor import extras
from conveyor.data import Dataset
from conveyor.train.plots import plot_step_breakdown, plot_timeline
from conveyor.train.profiler import StepProfiler
from conveyor.train.sinks import TensorBoardSink
from conveyor.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_notices(monkeypatch):
    monkeypatch.setattr(extras, "_NOTIFIED", set())  # every test starts with nothing announced yet


def block(monkeypatch, *modules: str) -> None:
    """Make `import module` fail as if it were not installed (None in sys.modules halts the import)."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def notices(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("conveyor: skipped")]


def test_optional_import_returns_the_module_when_present(fresh_notices, capsys):
    assert extras.optional_import("json", skipped="nothing", extra="none") is json
    assert capsys.readouterr().err == ""


def test_optional_import_says_once_what_is_skipped_and_which_extra_brings_it(fresh_notices, monkeypatch, capsys):
    block(monkeypatch, "matplotlib")
    for _ in range(3):
        assert extras.optional_import("matplotlib", skipped="the plots (plots/*.png)", extra="plots") is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert "the plots (plots/*.png)" in lines[0] and "matplotlib is not installed" in lines[0]
    assert "pip install 'conveyor[plots]'" in lines[0]


def test_plots_without_matplotlib_are_skipped(fresh_notices, monkeypatch, capsys, tmp_path):
    block(monkeypatch, "matplotlib", "matplotlib.pyplot")
    prof = StepProfiler()
    prof.start()
    for _ in range(3):
        prof.begin_step()
        prof.mark("input_wait")
        prof.mark("forward_backward")
        prof.mark("optimizer")
        prof.end_step(len(prof.steps) + 1, samples=4)
    assert plot_timeline(prof.trace(), tmp_path / "timeline.png") is None
    assert plot_step_breakdown(prof.steps, tmp_path / "breakdown.png") is None
    assert list(tmp_path.iterdir()) == []
    assert len(notices(capsys.readouterr().err)) == 1  # two plots, one notice


def test_tensorboard_sink_without_tensorboard_writes_nothing(fresh_notices, monkeypatch, capsys, tmp_path):
    block(monkeypatch, "tensorboard", "torch.utils.tensorboard")
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write({"event": "train", "step": 1, "loss": 0.5})
    sink.close()
    assert not (tmp_path / "tb").exists()
    [line] = notices(capsys.readouterr().err)
    assert "tensorboard is not installed" in line and "pip install 'conveyor[tensorboard]'" in line


def test_a_training_run_without_plots_and_tensorboard_finishes(fresh_notices, monkeypatch, capsys, tmp_path):
    block(monkeypatch, "matplotlib", "matplotlib.pyplot", "tensorboard", "torch.utils.tensorboard")
    for var in ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CONVEYOR_STRATEGY",
                "CONVEYOR_TASK_TYPE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CONVEYOR_OUTPUT_DIR", str(tmp_path))
    import conveyor

    job = conveyor.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, opt = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    summary = Trainer(job, model, opt, nn.functional.cross_entropy, Dataset.from_tensor_slices((x, y)).batch(8),
                      epochs=2, log_every_steps=2, progress=False).fit()
    job.shutdown()

    assert summary["steps"] == 8
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 8
    assert (tmp_path / "metrics.jsonl").read_text()  # the numbers TensorBoard would have shown
    assert summary["outputs"]["plots"] == [] and not (tmp_path / "plots").exists()
    assert not list(tmp_path.glob("tensorboard/events.out.tfevents.*"))
    lines = notices(capsys.readouterr().err)
    assert len(lines) == 2, lines  # one per missing extra, each once
    assert any("conveyor[plots]" in line for line in lines)
    assert any("conveyor[tensorboard]" in line for line in lines)


def test_the_digits_example_names_the_extra_for_its_data(monkeypatch, tmp_path):
    block(monkeypatch, "sklearn", "sklearn.datasets")
    spec = importlib.util.spec_from_file_location("conveyor_example_digits_noextra",
                                                  ROOT / "examples" / "digits" / "train.py")
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    with pytest.raises(SystemExit, match=r"pip install 'conveyor\[examples\]'"):
        digits.write_tfrecords(str(tmp_path / "digits"))
    assert not (tmp_path / "digits").exists()
