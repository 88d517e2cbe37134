"""Every code block in README.md runs as written, or the README says why it cannot.

How to add a block to the README (the convention this test enforces):

- ```python and ```sh blocks run in README order, each in a fresh subprocess, all in one temporary
  folder that is their working directory (so `data/`, `output/`, `train.py` land there). Other
  fences (```text, a bare ```) are output or pictures, never run.
- A python block whose first line names a file (`# train.py`) is written to that file instead of
  being run; a later sh block must run it (`conveyor run -n 2 train.py`).
- Every line of an sh block is a `conveyor ...` command (comment lines and `# ...` tails are
  ignored). Each runs with the `conveyor` next to this Python, must exit 0 within BLOCK_TIMEOUT s.
  Keep them fast: small data, few epochs.
- A block that cannot run here (network, two machines, a cluster, `make` recursion) gets a marker
  on the line right before its opening fence, indented like the fence:
      <!-- readme-test: skip — needs two machines -->
  The reason is required. Anything else — a shell command other than `conveyor`, an unmarked
  block that fails — fails this test.
- Files the README's blocks read but do not make (the `conveyor.data` example's images) are made,
  tiny, by `make_tiny_data` below, under the names the blocks use.
- sh blocks that run `--strategy pipeline` jobs (the slowest) run in a test of their own, in a folder
  of their own where `examples/` is the repository's.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK_TIMEOUT = 120
RUN_LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
SHELL_SYNTAX = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1"}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(6 * BLOCK_TIMEOUT)]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<rest>.*?)\s*-->")
_SKIP = re.compile(r"skip\s*[—–:-]+\s*(?P<reason>\S.*)")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence in the README
    language: str  # "python", "sh", or the fence's info string for blocks that are never run
    code: str
    skip: str | None  # the marker's reason


def extract_blocks(text: str) -> list[Block]:
    """Fenced blocks in order, each with the skip marker right before it; a misplaced marker is an error."""
    lines = text.splitlines()
    blocks: list[Block] = []
    marker: tuple[int, str] | None = None  # (line, reason) waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        found = _MARKER.fullmatch(line.strip())  # a whole line: one quoted in prose is not a marker
        if found:
            if marker is not None:
                raise ValueError(f"README line {marker[0]}: readme-test marker not right before a code block")
            skip = _SKIP.fullmatch(found.group("rest"))
            if not skip:
                raise ValueError(f"README line {i + 1}: write the marker as `<!-- readme-test: skip — <reason> -->`")
            marker = (i + 1, skip.group("reason"))
        elif fence:
            indent, mark = fence.group("indent"), fence.group("fence")
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(mark[0])}{{{len(mark)},}}[ \t]*$", lines[j]):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            info = fence.group("info").lower()
            blocks.append(Block(i + 1, RUN_LANGUAGES.get(info, info), "\n".join(body) + "\n",
                                marker[1] if marker else None))
            marker = None
            i = j
        elif line.strip() and marker is not None:
            raise ValueError(f"README line {marker[0]}: readme-test marker not right before a code block")
        i += 1
    if marker is not None:
        raise ValueError(f"README line {marker[0]}: readme-test marker not right before a code block")
    return blocks


def named_file(block: Block) -> str | None:
    """`train.py` for a python block whose first line is `# train.py`."""
    first = block.code.lstrip("\n").split("\n", 1)[0]
    m = re.fullmatch(r"#\s*([\w.-]+\.py)\b.*", first.strip())
    return m.group(1) if m else None


def sh_commands(block: Block) -> list[list[str]]:
    """The argv of every command line of an sh block; anything but a plain `conveyor` command is an error."""
    commands = []
    for n, line in enumerate(block.code.replace("\\\n", " ").splitlines()):
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        where = f"README line {block.line + 1 + n}"
        if argv[0] != "conveyor":
            raise ValueError(f"{where}: `{line.strip()}` is not a conveyor command; this test runs only those — "
                             f"put `<!-- readme-test: skip — <why> -->` before the block if it cannot run here")
        if SHELL_SYNTAX & set(argv):
            raise ValueError(f"{where}: `{line.strip()}` uses shell syntax, which this test does not run; "
                             f"write plain commands or mark the block")
        commands.append(argv)
    return commands


def conveyor_command() -> list[str]:
    exe = Path(sys.executable).with_name("conveyor")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "conveyor.cli.main"]


def make_tiny_data(folder: Path) -> None:
    """What the README's blocks read but do not write: the `conveyor.data` example's image shards."""
    from PIL import Image

    from conveyor.data.convert import convert_image_folder

    rng = np.random.default_rng(0)
    photos = folder / "photos-source"
    for label in ("cat", "dog"):
        (photos / label).mkdir(parents=True)
        for k in range(12):
            pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(photos / label / f"{k}.png")
    convert_image_folder(photos, folder / "data" / "images", shards=2)  # data/images/train-0000k-of-00002


def run(argv: list[str], cwd: Path, what: str) -> None:
    """Run one block or command in its own session; on a timeout, kill the whole group (workers included)."""
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    for key in [k for k in env if k.startswith("CONVEYOR_")]:  # an outer job must not leak into the README's
        del env[key]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} ran past {BLOCK_TIMEOUT} s:\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with {proc.returncode}:\n{out[-4000:]}")


def runs_pipeline(block: Block) -> bool:
    """An sh block that runs `--strategy pipeline` jobs (the module docstring)."""
    if block.language != "sh" or block.skip is not None:
        return False
    return any(argv[i + 1:i + 2] == ["pipeline"] for argv in sh_commands(block)
               for i, arg in enumerate(argv) if arg == "--strategy")


def test_every_readme_block_runs_or_is_marked(tmp_path):
    blocks = extract_blocks(README.read_text(encoding="utf-8"))
    assert sum(b.language in ("python", "sh") for b in blocks) >= 4, "the README's code blocks were not found"
    make_tiny_data(tmp_path)
    written: dict[str, int] = {}  # file → README line of its block
    used: set[str] = set()
    for block in blocks:
        what = f"README line {block.line} ({block.language} block)"
        if block.skip is not None or block.language not in ("python", "sh") or runs_pipeline(block):
            continue
        if block.language == "python":
            name = named_file(block)
            if name:
                (tmp_path / name).write_text(block.code, encoding="utf-8")
                written[name] = block.line
                continue
            script = tmp_path / f"readme-line-{block.line}.py"
            script.write_text(block.code, encoding="utf-8")
            run([sys.executable, script.name], tmp_path, what)
        else:
            for argv in sh_commands(block):
                used.update(argv)
                run(conveyor_command() + argv[1:], tmp_path, f"{what}: `{shlex.join(argv)}`")
    unused = {name: line for name, line in written.items() if name not in used}
    assert not unused, f"README blocks written to files that no later sh block runs: {unused}"


def test_readme_pipeline_blocks_run_as_written(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example reads scikit-learn's bundled digits")
    blocks = [b for b in extract_blocks(README.read_text(encoding="utf-8")) if runs_pipeline(b)]
    assert blocks, "the README's pipeline commands were not found"
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    for block in blocks:
        for argv in sh_commands(block):
            run(conveyor_command() + argv[1:], tmp_path, f"README line {block.line}: `{shlex.join(argv)}`")


# ------------------------------------------------------------- the convention itself can fail a README

SAMPLE = """\
Intro.

```sh
conveyor data inspect x.tfrecord      # runs
```

<!-- readme-test: skip — needs two machines -->
```sh
rm -rf /
```

  - nested:
    <!-- readme-test: skip — needs the network -->
    ```sh
    pip install conveyor
    ```

```python
# train.py
print("hi")
```

```text
output, never run
```
"""


def test_extract_blocks_reads_markers_and_indented_blocks():
    blocks = extract_blocks(SAMPLE)
    assert [(b.line, b.language, b.skip) for b in blocks] == [
        (3, "sh", None), (8, "sh", "needs two machines"), (14, "sh", "needs the network"),
        (18, "python", None), (23, "text", None)]
    assert blocks[2].code == "pip install conveyor\n"
    assert named_file(blocks[3]) == "train.py"
    assert sh_commands(blocks[0]) == [["conveyor", "data", "inspect", "x.tfrecord"]]


@pytest.mark.parametrize("text, error", [
    ("```sh\nrm -rf data\n```\n", "not a conveyor command"),
    ("```sh\nconveyor run train.py > log\n```\n", "shell syntax"),
    ("<!-- readme-test: skip -->\n```sh\nrm x\n```\n", "write the marker"),
    ("<!-- readme-test: skip — why -->\n\nText between.\n\n```sh\nrm x\n```\n", "not right before"),
    ("Text.\n<!-- readme-test: skip — why -->\n", "not right before"),
    ("Quoted: `<!-- readme-test: skip — why -->`.\n```sh\nrm x\n```\n", "not a conveyor command"),
])
def test_unrunnable_unmarked_or_misplaced_is_an_error(text, error):
    with pytest.raises(ValueError, match=error):
        for block in extract_blocks(text):
            if block.language == "sh" and block.skip is None:
                sh_commands(block)
