"""`conveyor slurm`: the sbatch script it writes, run here with stand-ins for srun and the interpreter."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.cli.main import main
from conveyor.launch.sbatch import SbatchJob, node_layout, sbatch_script

FAKE_SRUN = """\
#!/bin/bash
# srun's stand-in: skip its options, run the command once per node with that node's SLURM_NODEID
while [[ "$1" == -* ]]; do shift; done
for ((node = 0; node < FAKE_NODES; node++)); do SLURM_NODEID=$node "$@" || exit $?; done
"""
FAKE_PYTHON = f"""\
#!{sys.executable}
# the interpreter's stand-in: record the arguments and the job secret file it was given
import json, os, sys
args = sys.argv[1:]
secret = args[args.index("--job-secret-file") + 1]
record = {{"args": args, "mode": oct(os.stat(secret).st_mode & 0o777), "secret": len(open(secret).read()),
          "folder_mode": oct(os.stat(os.path.dirname(secret)).st_mode & 0o777)}}
with open(os.path.join(os.environ["FAKE_OUT"], "node-" + os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump(record, f)
"""


def job(tmp_path: Path, **kwargs) -> SbatchJob:
    settings = dict(script="train.py", data_dir=str(tmp_path / "my data"), output_dir=str(tmp_path / "out"),
                    workdir=str(tmp_path), python=str(tmp_path / "bin" / "python"))
    settings.update(kwargs)
    return SbatchJob(**settings)


def run_script(tmp_path: Path, text: str, nodes: int) -> list[dict]:
    """Run the sbatch script as Slurm would on the first node, with srun and python replaced. The secret file's
    path (random) is checked here and replaced by SECRET in each record's arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", FAKE_SRUN), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "8",
           "FAKE_NODES": str(nodes), "FAKE_OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = [json.loads((tmp_path / f"node-{i}.json").read_text()) for i in range(nodes)]
    for record in records:
        at = record["args"].index("--job-secret-file") + 1
        secret = Path(record["args"][at])
        assert secret.name == "secret" and secret.parent.parent == tmp_path
        assert re.fullmatch(r"\.conveyor-job-77\.[A-Za-z0-9]{8}", secret.parent.name)
        assert not secret.parent.exists()  # removed, with its folder, when the script ended
        record["args"][at] = "SECRET"
    return records


def test_the_same_tasks_on_every_node_is_one_plain_srun_line(tmp_path):
    text = sbatch_script(job(tmp_path, nodes=4, workers=2, time="1:00:00", partition="gpu", account="proj",
                             strategy="allreduce", script_args=("--epochs", "5 or 6"), sbatch_args=("--mem=0",)))
    for line in ("#SBATCH --job-name=train", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
                 "#SBATCH --time=1:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --mem=0",
                 'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 "$PYTHON" '
                 '-m conveyor run -n 2 \\'):
        assert line in text.splitlines()
    assert "case" not in text
    records = run_script(tmp_path, text, nodes=4)
    expected = ["-m", "conveyor", "run", "-n", "2", "--strategy", "allreduce", "--data-dir", str(tmp_path / "my data"),
                "--output-dir", str(tmp_path / "out"), "--job-secret-file", "SECRET", "train.py",
                "--epochs", "5 or 6"]
    assert [r["args"] for r in records] == [expected] * 4
    assert {r["mode"] for r in records} == {"0o600"} and {r["secret"] for r in records} == {64}  # 32 bytes in hex
    assert {r["folder_mode"] for r in records} == {"0o700"}  # a folder of the job's own


def test_a_file_planted_at_a_predictable_secret_name_is_never_written_into(tmp_path):
    """Another user with write access to the shared folder creates the file the secret would go to (and keeps
    it open): the script must create its own, exclusively, and leave the planted one as it was."""
    planted = tmp_path / ".conveyor-job-77.secret"
    planted.write_text("")
    planted.chmod(0o666)
    records = run_script(tmp_path, sbatch_script(job(tmp_path)), nodes=1)
    assert records[0]["secret"] == 64 and planted.read_text() == ""


def test_ps_tasks_go_on_the_first_nodes_and_each_node_picks_its_own_line(tmp_path):
    spec = job(tmp_path, nodes=3, workers=1, ps=2, strategy="ps-sync", cpus_per_node=6)
    assert node_layout(spec) == [(1, 1), (1, 1), (1, 0)]
    text = sbatch_script(spec)
    assert "#SBATCH --cpus-per-task=6" in text and "--exclusive" not in text
    assert "nodes 0-1: 1 worker + 1 ps; node 2: 1 worker" in text
    records = run_script(tmp_path, text, nodes=3)
    tasks = [r["args"][3:r["args"].index("--strategy")] for r in records]
    assert tasks == [["-n", "1", "--ps", "1"], ["-n", "1", "--ps", "1"], ["-n", "1"]]
    assert {tuple(r["args"][r["args"].index("--strategy"):]) for r in records} == {
        ("--strategy", "ps-sync", "--data-dir", str(tmp_path / "my data"), "--output-dir", str(tmp_path / "out"),
         "--job-secret-file", "SECRET", "train.py")}


def test_ps_nodes_of_their_own_are_the_last_ones_and_run_no_worker(tmp_path):
    spec = job(tmp_path, nodes=4, workers=2, ps=3, ps_nodes=2, strategy="ps-async")
    assert node_layout(spec) == [(2, 0), (2, 0), (0, 2), (0, 1)]
    assert "nodes 0-1: 2 workers; node 2: 2 ps; node 3: 1 ps" in sbatch_script(spec)
    records = run_script(tmp_path, sbatch_script(spec), nodes=4)
    tasks = [r["args"][3:r["args"].index("--strategy")] for r in records]
    assert tasks == [["-n", "2"], ["-n", "2"], ["-n", "0", "--ps", "2"], ["-n", "0", "--ps", "1"]]


def test_data_nodes_are_the_last_ones_and_run_data_workers_only(tmp_path):
    spec = job(tmp_path, nodes=4, workers=2, ps=1, ps_nodes=1, strategy="ps-sync", data_nodes=2, data_workers=3,
               data_pipeline="job.input:train")
    assert node_layout(spec) == [(2, 0), (0, 1), (0, 0), (0, 0)]
    text = sbatch_script(spec)
    assert "node 0: 2 workers; node 1: 1 ps; nodes 2-3: 3 data workers" in text
    records = run_script(tmp_path, text, nodes=4)
    tasks = [r["args"][3:r["args"].index("--strategy")] for r in records]
    data = ["-n", "0", "--data-workers", "3", "--data-pipeline", "job.input:train"]
    assert tasks == [["-n", "2"], ["-n", "0", "--ps", "1"], data, data]


@pytest.mark.parametrize(("changes", "message"), [
    (dict(data_nodes=1), "--data-nodes D, --data-workers K and --data-pipeline MODULE:FUNCTION go together"),
    (dict(data_nodes=2, data_workers=1, data_pipeline="a:b"), "leave at least one node for the workers"),
    (dict(data_nodes=1, data_workers=1, data_pipeline="a b:c"), "expected MODULE:FUNCTION"),
    (dict(data_nodes=1, data_workers=1, data_pipeline="a:b", gpus_per_node=1), "the same GPUs"),
])
def test_bad_data_node_settings_are_refused(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        job(tmp_path, nodes=2, **changes)


def test_gpus_set_the_workers_per_node(tmp_path, capsys):
    assert main(["slurm", "--nodes", "2", "--gpus-per-node", "4", "--python", sys.executable, "train.py"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --gpus-per-node=4" in text and "--gpus-per-node=4 \"$PYTHON\" -m conveyor run -n 4 \\" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpus-per-node", "2", "-n", "3"], "two training processes would share a GPU"),
    (["--nodes", "0"], "--nodes 0: expected a whole number >= 1"),
    (["--time", "an hour"], "--time 'an hour': expected Slurm's form"),
    (["--partition", "gpu; rm -rf /"], "an #SBATCH value may hold"),
    (["--strategy", "ring"], "--strategy"),
    (["--nodes", "2", "--ps", "2", "--ps-nodes", "2"], "node 0 runs rank 0, the chief"),
    (["--nodes", "3", "--ps", "1", "--ps-nodes", "2"], "each node of parameter servers runs one at least"),
])
def test_bad_settings_are_refused_naming_the_flag(argv, message, capsys):
    assert main(["slurm", *argv, "train.py"]) == 2
    assert message in capsys.readouterr().err


def test_the_script_is_written_to_a_file(tmp_path, capsys):
    path = tmp_path / "job.sbatch"
    assert main(["slurm", "--nodes", "2", "-o", str(path), "train.py"]) == 0
    assert capsys.readouterr().out == (f"wrote {path}: the sbatch script of conveyor job train (train.py on 2 nodes); "
                                       f"submit it with `sbatch {path}` (squeue --me shows it)\n")
    assert path.read_text().startswith("#!/bin/bash\n") and stat.S_IMODE(path.stat().st_mode) == 0o755
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_submit_hands_the_script_to_sbatch_and_prints_the_job_id(tmp_path, monkeypatch, capsys):
    sbatch = tmp_path / "sbatch"
    sbatch.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "$@" > {tmp_path}/argv
        cat > {tmp_path}/stdin
        echo "1234;cluster"
        """))
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert main(["slurm", "--nodes", "2", "--submit", "train.py"]) == 0
    assert capsys.readouterr().out == "1234\n"
    assert (tmp_path / "argv").read_text() == "--parsable\n"
    assert "#SBATCH --nodes=2" in (tmp_path / "stdin").read_text()


def test_submit_without_sbatch_says_where_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["slurm", "--submit", "train.py"]) == 1
    assert "sbatch is not on PATH" in capsys.readouterr().err
