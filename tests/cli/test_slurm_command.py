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
FAKE_HET_SRUN = """\
#!/bin/bash
# srun's stand-in for a step over a heterogeneous job's components (`srun OPTIONS0 COMMAND0 : OPTIONS1 COMMAND1`):
# component c runs on the c-th count of FAKE_NODES, numbered after the components before it, as Slurm numbers them
counts=($FAKE_NODES); node=0; group=0; args=()
component() {
  local options=()
  while [[ "$1" == -* ]]; do options+=("$1"); shift; done
  for ((i = 0; i < counts[group]; i++)); do
    SLURM_NODEID=$node FAKE_SRUN_OPTIONS="${options[*]}" "$@" || exit $?
    node=$((node + 1))
  done
  group=$((group + 1))
}
for arg in "$@"; do
  if [[ "$arg" == ":" ]]; then component "${args[@]}"; args=(); else args+=("$arg"); fi
done
component "${args[@]}"
"""
FAKE_PYTHON = f"""\
#!{sys.executable}
# the interpreter's stand-in: record the arguments and the job secret file it was given
import json, os, sys
args = sys.argv[1:]
secret = args[args.index("--job-secret-file") + 1]
record = {{"args": args, "mode": oct(os.stat(secret).st_mode & 0o777), "secret": len(open(secret).read()),
          "folder_mode": oct(os.stat(os.path.dirname(secret)).st_mode & 0o777),
          "srun": os.environ.get("FAKE_SRUN_OPTIONS")}}
with open(os.path.join(os.environ["FAKE_OUT"], "node-" + os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump(record, f)
"""


def job(tmp_path: Path, **kwargs) -> SbatchJob:
    settings = dict(script="train.py", data_dir=str(tmp_path / "my data"), output_dir=str(tmp_path / "out"),
                    workdir=str(tmp_path), python=str(tmp_path / "bin" / "python"))
    settings.update(kwargs)
    return SbatchJob(**settings)


def run_script(tmp_path: Path, text: str, nodes: int, components: tuple[int, ...] = (), **env: str) -> list[dict]:
    """Run the sbatch script as Slurm would on the first node, with srun and python replaced (a heterogeneous job's
    srun with ``components``: the nodes of each). The secret file's path (random) is checked here and replaced by
    SECRET in each record's arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", FAKE_HET_SRUN if components else FAKE_SRUN), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "8",
           "FAKE_NODES": " ".join(map(str, components)) if components else str(nodes), "FAKE_OUT": str(tmp_path),
           **env}
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
    (dict(data_partition="cpu"), "--data-partition and --data-cpus-per-node describe the data nodes"),
    (dict(data_cpus_per_node=4), "add --data-nodes D"),
    (dict(data_nodes=1, data_workers=1, data_pipeline="a:b", data_cpus_per_node=0), "--data-cpus-per-node 0"),
    (dict(data_nodes=1, data_workers=1, data_pipeline="a:b", data_partition="cpu;x"), "an #SBATCH value may hold"),
    (dict(data_nodes=1, data_workers=1, data_pipeline="a:b", gpus_per_node=1, script_args=("--sep", ":")),
     "a bare ':'"),
])
def test_bad_data_node_settings_are_refused(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        job(tmp_path, nodes=2, **changes)


def test_data_nodes_in_a_gpu_job_are_a_heterogeneous_component_of_cpu_nodes(tmp_path):
    spec = job(tmp_path, nodes=4, gpus_per_node=2, workers=2, ps=1, ps_nodes=1, strategy="ps-sync", data_nodes=1,
               data_workers=3, data_pipeline="job.input:train", partition="gpu", data_partition="cpu", time="90",
               account="proj", sbatch_args=("--mem=0",))
    assert spec.heterogeneous
    text = sbatch_script(spec)
    training, data = text.split("#SBATCH hetjob\n")
    # component 0: the 3 training nodes (2 of workers, 1 of the ps) with their GPUs; component 1: the data node,
    # whole (no CPU count given), in its own partition, without GPUs
    for line in ("#SBATCH --nodes=3", "#SBATCH --exclusive", "#SBATCH --gpus-per-node=2", "#SBATCH --partition=gpu",
                 "#SBATCH --time=90", "#SBATCH --account=proj", "#SBATCH --mem=0", "#SBATCH --job-name=train"):
        assert line in training.splitlines()
    header = data[:data.index("set -euo")].splitlines()
    assert header == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --time=90",
                      "#SBATCH --partition=cpu", "#SBATCH --account=proj"]
    assert 'train.py : \\\n  --ntasks-per-node=1 --cpus-per-task="$DATA_CPUS" --kill-on-bad-exit=1 "$PYTHON"' in text
    # the data node's step component gets the fewest CPUs any data node has (SLURM_JOB_CPUS_PER_NODE's form)
    records = run_script(tmp_path, text, nodes=4, components=(3, 1), SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1="32(x2),16")
    tasks = [r["args"][3:r["args"].index("--strategy")] for r in records]
    assert tasks == [["-n", "2"], ["-n", "2"], ["-n", "0", "--ps", "1"],
                     ["-n", "0", "--data-workers", "3", "--data-pipeline", "job.input:train"]]
    assert {tuple(r["args"][r["args"].index("--strategy"):]) for r in records} == {
        ("--strategy", "ps-sync", "--data-dir", str(tmp_path / "my data"), "--output-dir", str(tmp_path / "out"),
         "--job-secret-file", "SECRET", "train.py")}
    gpu = "--ntasks-per-node=1 --cpus-per-task=8 --kill-on-bad-exit=1 --gpus-per-node=2"
    assert [r["srun"] for r in records] == [gpu] * 3 + ["--ntasks-per-node=1 --cpus-per-task=16 --kill-on-bad-exit=1"]


def test_a_data_partition_makes_a_cpu_job_heterogeneous_with_the_cpus_given(tmp_path):
    spec = job(tmp_path, nodes=2, cpus_per_node=2, data_nodes=1, data_workers=1, data_pipeline="job.input:train",
               data_cpus_per_node=6)
    text = sbatch_script(spec)
    assert spec.heterogeneous and text.count("#SBATCH --partition") == 0 and "DATA_CPUS" not in text
    assert text.split("#SBATCH hetjob\n")[1].startswith("#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n"
                                                         "#SBATCH --cpus-per-task=6\n")
    records = run_script(tmp_path, text, nodes=2, components=(1, 1))
    assert [r["srun"].split()[1] for r in records] == ["--cpus-per-task=2", "--cpus-per-task=6"]
    # without GPUs, a partition or CPUs of their own, data nodes stay in the one allocation (the test above)
    assert not job(tmp_path, nodes=2, data_nodes=1, data_workers=1, data_pipeline="job.input:train").heterogeneous


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


INPUTS = """\
from conveyor.data import Dataset

def train():
    return Dataset.range(8).batch(2)

def broken():
    raise OSError("no files under /data/train")
"""
DATA_JOB = ["--nodes", "2", "--gpus-per-node", "1", "--data-nodes", "1", "--data-workers", "2"]


@pytest.mark.parametrize(("argv", "needles"), [
    (["--nodes", "2", "--data-nodes", "0"], ["--data-nodes 0: expected a whole number >= 1", "drop it"]),
    (["--nodes", "2", "--data-nodes", "-1"], ["--data-nodes -1: expected a whole number >= 1"]),
    (DATA_JOB, ["--data-nodes D, --data-workers K and --data-pipeline MODULE:FUNCTION go together"]),
    ([*DATA_JOB, "--data-pipeline", "slurm_no_such_inputs:train"],
     ["--data-pipeline slurm_no_such_inputs:train: cannot import slurm_no_such_inputs", "PYTHONPATH",
      "conveyor slurm builds it here before writing the job"]),
    ([*DATA_JOB, "--data-pipeline", "slurm_test_inputs:validation"],
     ["has no function 'validation'", "define it there"]),
    ([*DATA_JOB, "--data-pipeline", "slurm_test_inputs:broken"],
     ["building it here failed (OSError: no files under /data/train)", "every data worker would fail alike"]),
])
def test_data_nodes_whose_pipeline_does_not_build_are_refused_before_sbatch(tmp_path, monkeypatch, capsys, argv,
                                                                            needles):
    (tmp_path / "slurm_test_inputs.py").write_text(INPUTS)
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text(f"#!/bin/bash\ntouch {tmp_path}/submitted\necho 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sbatch.parent}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", *argv, "--submit", "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err
    assert not (tmp_path / "submitted").exists()


def test_data_nodes_with_a_pipeline_that_builds_here_are_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "slurm_good_inputs.py").write_text(INPUTS)
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", *DATA_JOB, "--data-pipeline", "slurm_good_inputs:train", "--data-partition", "cpu",
                 "--data-cpus-per-node", "8", "--python", sys.executable, "train.py"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH hetjob\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=8\n" in text
    assert "#SBATCH --partition=cpu" in text and "--data-workers 2 --data-pipeline slurm_good_inputs:train" in text
