"""JobSettings: one declaration per setting; flags → options → a task's environment → the task's settings, and
every check's error naming where the value came from and the fix."""

from __future__ import annotations

import math

import pytest

from conveyor.cli.main import build_parser
from conveyor.cluster import validate
from conveyor.cluster.settings import JobSettings, agreed_flags, given, owned_variables
from conveyor.cluster.strategy_name import StrategyName
from conveyor.cluster.variables import NAMES
from conveyor.launch import RunOptions, local_plan
from conveyor.launch.sbatch import SbatchJob, sbatch_script

SECRET = bytes(range(32))


def run_options(*argv: str) -> RunOptions:
    """`conveyor run ARGV train.py` parsed as the command parses it."""
    args = build_parser().parse_args(["run", *argv, "train.py"])
    return RunOptions(script=args.script, workers=args.workers, ps=args.ps, data_dir="/data", output_dir="/out",
                      **given(args, "run"))


def test_flags_reach_the_task_and_read_back_as_the_same_settings():
    options = run_options("-n", "4", "--strategy", " Pipeline ", "--stages", "2", "--microbatches", "8",
                          "--schedule", "gpipe", "--split", "blocks.2, head", "--timeout", "60", "--no-resume",
                          "--share-gpus", "--max-restarts", "5")
    assert options.strategy == StrategyName("pipeline") and options.split == ("blocks.2", "head")
    plan = local_plan(options, [7001, 7002, 7003, 7004], master_port=7000, secret=SECRET, environ={})
    for task in plan.tasks:
        read = JobSettings.from_environ(task.env)
        launcher_only = dict(chief=False, tf_flags=False, max_restarts=3)  # shape the job; no task reads them
        assert read == options.settings.replace(**launcher_only)
        assert (read.stages, read.microbatches, read.schedule, read.split) == (2, 8, "gpipe", ("blocks.2", "head"))
        assert (read.timeout, read.resume, read.share_gpus, read.restart_count) == (60.0, False, True, 0)
        assert (read.data_dir, read.output_dir) == ("/data", "/out")


def test_the_resolved_strategy_travels_and_defaults_read_back_as_defaults():
    plan = local_plan(run_options("-n", "2"), [7001, 7002], master_port=7000, secret=SECRET, environ={})
    read = JobSettings.from_environ(plan.tasks[0].env)
    assert read.strategy == StrategyName("allreduce") and str(read.strategy) == "allreduce"
    assert read.replace(strategy=None, data_dir=None, output_dir=None) == JobSettings()
    assert JobSettings.from_environ({}) == JobSettings()


def test_yes_no_variables_change_only_when_spelt_as_the_other_value():
    # as before: CONVEYOR_RESUME is on unless "0", CONVEYOR_SHARE_GPUS off unless "1"
    assert JobSettings.from_environ({"CONVEYOR_RESUME": "no", "CONVEYOR_SHARE_GPUS": "yes"}) == JobSettings()
    read = JobSettings.from_environ({"CONVEYOR_RESUME": "0", "CONVEYOR_SHARE_GPUS": "1"})
    assert (read.resume, read.share_gpus) == (False, True)


def test_the_declarations_generate_the_agreed_flags_the_owned_variables_and_each_commands_flags():
    assert set(agreed_flags()) == {"strategy", "chief", "max_restarts", "tf_flags", "share_gpus", "resume",
                                   "timeout", "stages", "microbatches", "schedule", "split", "fsdp_blocks",
                                   "reshard_after_forward", "shard_stages"}
    assert set(owned_variables()) <= set(NAMES) and "CONVEYOR_SHARE_GPUS" not in owned_variables()
    parser = build_parser()
    for command, absent in (("run", set()), ("k8s", {"share_gpus"}), ("slurm", set())):
        head = [command, *(["--name", "n", "--image", "i", "--output-claim", "o"] if command == "k8s" else [])]
        assert given(parser.parse_args([*head, "t.py"]), command) == {}, "a flag not given leaves the default"
        for name in set(agreed_flags()) - absent:  # every agreed setting is a flag of every command
            setting = JobSettings.__dataclass_fields__[name].metadata["setting"]
            argv = [setting.flag] if setting.switch else [setting.flag, "2"]
            assert name in given(parser.parse_args([*head, *argv, "t.py"]), command), (command, setting.flag)


def test_agreed_settings_are_json_values():
    options = run_options("-n", "2", "--strategy", "pipeline", "--split", "a,b")
    assert options.agreed() == {"strategy": "pipeline", "chief": False, "tf_flags": False, "max_restarts": 3,
                                "share_gpus": False, "resume": True, "timeout": 300.0, "stages": None,
                                "microbatches": None, "schedule": None, "split": ["a", "b"], "fsdp_blocks": None,
                                "reshard_after_forward": True, "shard_stages": False}


def test_fsdp_flags_reach_the_task_and_need_the_fsdp_strategy():
    options = run_options("-n", "2", "--strategy", "fsdp", "--fsdp-blocks", "layers.0, layers.1",
                          "--no-reshard-after-forward")
    plan = local_plan(options, [7001, 7002], master_port=7000, secret=SECRET, environ={})
    env = plan.tasks[0].env
    assert (env["CONVEYOR_FSDP_BLOCKS"], env["CONVEYOR_FSDP_RESHARD"]) == ("layers.0,layers.1", "0")
    read = JobSettings.from_environ(env)
    assert (read.strategy, read.fsdp_blocks, read.reshard_after_forward) == (
        StrategyName("fsdp"), ("layers.0", "layers.1"), False)
    default = local_plan(run_options("-n", "2", "--strategy", "fsdp"), [7001, 7002], master_port=7000,
                         secret=SECRET, environ={}).tasks[0].env
    assert "CONVEYOR_FSDP_RESHARD" not in default and JobSettings.from_environ(default).reshard_after_forward
    for argv in (["--fsdp-blocks", "a"], ["--no-reshard-after-forward"]):
        with pytest.raises(ValueError, match=f"{argv[0]} belong.* to sharded data parallelism: add --strategy fsdp"):
            local_plan(run_options("-n", "2", *argv), [7001, 7002], master_port=7000, secret=SECRET, environ={})


def test_shard_stages_reaches_the_task_and_needs_the_pipeline_strategy_with_two_replicas():
    options = run_options("-n", "4", "--strategy", "pipeline", "--stages", "2", "--shard-stages")
    env = local_plan(options, [7001, 7002, 7003, 7004], master_port=7000, secret=SECRET, environ={}).tasks[0].env
    assert env["CONVEYOR_PIPELINE_SHARD_STAGES"] == "1" and JobSettings.from_environ(env).shard_stages
    with pytest.raises(ValueError, match="--shard-stages belong.* to pipeline parallelism: add --strategy pipeline"):
        local_plan(run_options("-n", "2", "--shard-stages"), [7001, 7002], master_port=7000, secret=SECRET, environ={})
    with pytest.raises(ValueError, match="each stage has 1 replica, so there is nothing to shard it across"):
        local_plan(run_options("-n", "2", "--strategy", "pipeline", "--stages", "2", "--shard-stages"), [7001, 7002],
                   master_port=7000, secret=SECRET, environ={})


def test_sbatch_passes_the_settings_on_as_conveyor_run_flags():
    job = SbatchJob(script="train.py", data_dir="/d", output_dir="/o", workdir="/w", python="/p", workers=2,
                    strategy="pipeline", stages=2, split="x", resume=False, chief=True)
    text = sbatch_script(job)
    assert "--strategy pipeline \\\n  --chief \\\n  --no-resume \\\n  --stages 2 \\\n  --split x \\\n" in text
    assert job.flags("run") == [("--strategy", "pipeline"), ("--chief",), ("--no-resume",), ("--stages", "2"),
                                ("--split", "x")]
    with pytest.raises(ValueError, match="-n 3 --stages 2: each pipeline replica runs all 2 stages"):
        SbatchJob(script="t.py", data_dir="/d", output_dir="/o", workdir="/w", python="/p", workers=3,
                  strategy="pipeline", stages=2)


@pytest.mark.parametrize(("environ", "message"), [
    ({"CONVEYOR_STRATEGY": "sgd"}, "CONVEYOR_STRATEGY: unknown strategy 'sgd'; expected one of"),
    ({"CONVEYOR_TIMEOUT": "soon"}, "CONVEYOR_TIMEOUT='soon' is not a number of seconds"),
    ({"CONVEYOR_TIMEOUT": "inf"}, "CONVEYOR_TIMEOUT inf: expected a finite number of seconds > 0"),
    ({"CONVEYOR_RESTART_COUNT": "-1"}, "CONVEYOR_RESTART_COUNT='-1' is not a whole number >= 0"),
    ({"CONVEYOR_PIPELINE_STAGES": "0"}, "CONVEYOR_PIPELINE_STAGES 0: expected a whole number >= 1"),
    ({"CONVEYOR_PIPELINE_SPLIT": "a,,b"}, "CONVEYOR_PIPELINE_SPLIT 'a,,b': expected comma-separated layer names"),
])
def test_a_task_refuses_a_bad_variable_naming_it(environ, message):
    with pytest.raises(ValueError, match=message):
        JobSettings.from_environ(environ)


@pytest.mark.parametrize(("check", "message"), [
    (lambda: validate.count(-1, "--ps", 0, "parameter servers"), r"--ps -1: expected a whole number >= 0 \(param"),
    (lambda: validate.count(True, "--ps", 0), "--ps True: expected a whole number >= 0$"),
    (lambda: validate.optional_count(1, "microbatches")(0, "--microbatches"), "--microbatches 0: expected a whole"),
    (lambda: validate.seconds(-1, "--linger", zero_ok=True, most=3600, example="e.g. --linger 30"),
     "--linger -1: expected a finite number of seconds >= 0 and at most 3600, e.g. --linger 30"),
    (lambda: validate.seconds(math.nan, "--linger", zero_ok=True, most=3600), "--linger nan"),
    (lambda: validate.timeout(0, "--timeout"), "--timeout 0: expected a finite number of seconds > 0, e.g. --timeout"),
    (lambda: validate.timeout(math.inf, "conveyor.init(timeout=...)"), r"init\(timeout=...\) inf: .* e.g. 300"),
    (lambda: validate.strategy("ring", "--strategy"), "unknown --strategy 'ring'; expected one of local, allreduce"),
    (lambda: validate.strategy("ps-ssp", "--strategy"), "ps-ssp needs its staleness bound K"),
    (lambda: validate.flag("yes", "--chief"), "--chief 'yes': expected True or False"),
    (lambda: validate.text(" ", "--schedule"), "--schedule ' ': expected a name, e.g. --schedule 1f1b"),
    (lambda: validate.folder("", "--data-dir"), "--data-dir '': expected a folder path"),
    (lambda: validate.layer_names([1], "--split"), r"--split \[1\]: expected layer names, e.g. --split blocks.2"),
    (lambda: validate.layer_names("a,", "--split"), "--split 'a,': expected comma-separated layer names"),
    (lambda: validate.from_text(int, "2.5", "CONVEYOR_RESTART_COUNT"), "'2.5' is not a whole number >= 0"),
    (lambda: validate.from_text(float, "x", "CONVEYOR_TIMEOUT"), "CONVEYOR_TIMEOUT='x' is not a number of seconds"),
    (lambda: validate.pipeline_shape(None, 2, 2, ["--stages"], None),
     r"--stages belong\(s\) to pipeline parallelism: add --strategy pipeline, or drop it"),
    (lambda: validate.pipeline_shape(StrategyName("pipeline"), 2, None, [], None),
     "--strategy pipeline needs the split: --stages S"),
    (lambda: validate.pipeline_shape(StrategyName("pipeline"), 3, 2, ["--stages"], None),
     "-n 3 --stages 2: each pipeline replica runs all 2 stages, so -n must be a multiple of 2"),
    (lambda: validate.tf_flags(True, True), "--tf-flags gives TensorFlow 1's .* drop --chief"),
])
def test_every_check_names_the_value_and_the_fix(check, message):
    with pytest.raises(ValueError, match=message):
        check()


def test_checks_return_the_value_in_its_one_form():
    assert validate.strategy(" PS-SSP:4 ", "--strategy") == StrategyName("ps", "ssp", 4)
    assert validate.layer_names(["a ", " b"], "--split") == validate.layer_names("a,b", "--split") == ("a", "b")
    assert validate.timeout(5, "--timeout") == 5.0 and isinstance(validate.timeout(5, "--timeout"), float)
    assert validate.text(" gpipe ", "--schedule") == "gpipe"
    assert JobSettings(timeout=86400).timeout == 86400.0
    with pytest.raises(ValueError, match="--timeout 86401.0: expected a finite number of seconds > 0 and at most"):
        run_options("--timeout", "86401")  # a launcher caps the timeout at a day; a task takes what it is given
    assert JobSettings(timeout=86401).timeout == 86401.0
