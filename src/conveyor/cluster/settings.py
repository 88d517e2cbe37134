"""The job's settings, declared once: every setting a launcher passes to its tasks, or that nodes must agree on.

    settings = JobSettings(strategy="pipeline", stages=2, microbatches=8)   # checked; .strategy parsed
    env = settings.environ()                      # {"CONVEYOR_STRATEGY": "pipeline", ..., STAGES: "2", ...}
    JobSettings.from_environ(env) == settings     # what a task reads back (conveyor.init: job.settings)
    settings.agreed()                             # what each node publishes at the rendezvous
    add_arguments(groups, "k8s"); given(args, "k8s")      # a command's flags, and the ones given

Each field of :class:`JobSettings` carries a :class:`Setting` (its flag, its variable, whether nodes must
agree on it, its check in :mod:`conveyor.cluster.validate`), from which the commands' flags, the
task's environment, the Kubernetes env list, the sbatch script's `conveyor run` flags and the
rendezvous' agreed settings are generated. Fields without a variable (``chief``, ``tf_flags``,
``max_restarts``) shape the job at the launcher: a task reads their defaults. The launchers' option
classes (``RunOptions``, ``K8sOptions``, ``SbatchJob``) subclass it; variable names live in
:mod:`conveyor.cluster.variables`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from conveyor.cluster import validate
from conveyor.cluster.strategy_name import NAMES as STRATEGY_NAMES
from conveyor.cluster.strategy_name import StrategyName
from conveyor.cluster.variables import (
    CHECKPOINT_SYNC_VAR,
    DATA_DIR_VAR,
    FSDP_BLOCKS_VAR,
    FSDP_RESHARD_VAR,
    OUTPUT_DIR_VAR,
    PIPELINE_MICROBATCHES_VAR,
    PIPELINE_SCHEDULE_VAR,
    PIPELINE_SPLIT_VAR,
    PIPELINE_STAGES_VAR,
    RESTART_COUNT_VAR,
    RESUME_VAR,
    SHARE_GPUS_VAR,
    STRATEGY_VAR,
    TIMEOUT_VAR,
)

__all__ = ["COMMANDS", "JobSettings", "Setting", "add_arguments", "agreed_flags", "given", "owned_variables"]

#: The commands that take settings as flags: `conveyor run`, `conveyor k8s`, `conveyor slurm`.
COMMANDS = ("run", "k8s", "slurm")


@dataclass(frozen=True)
class Setting:
    """One setting's declaration, the metadata of its :class:`JobSettings` field.

    ``flag``: its command-line flag (also what error messages name). ``check(value, where)``: its rule
    (:mod:`conveyor.cluster.validate`), returning the value in its one form. ``env``: the variable that
    carries it to every task (``None``: it stays with the launcher). ``agreed``: every node of a job must
    give it alike. ``kind``: the value's type as a variable's text (int, float, bool, str). ``omit``: a
    value not written to the environment (besides ``None``). ``training_only``: ps tasks do not get it.
    ``inherited``: the caller's variable reaches the tasks when the flag is not given. ``commands``: the
    commands that declare the flag (a folder's flag is each command's own: its default differs).
    ``switch``: a flag without a value (``store_true``; ``"no"``: ``store_false``, e.g. --no-resume).
    """

    flag: str
    check: Callable[[Any, str], Any]
    help: str = ""
    env: str | None = None
    agreed: bool = False
    kind: type = str
    omit: object = None
    training_only: bool = False
    inherited: bool = False
    commands: tuple[str, ...] = COMMANDS
    switch: str = ""
    metavar: str | None = None
    group: str = "job"

    def text(self, value: object) -> str:
        """The value as its variable's text (and as its flag's argument)."""
        if isinstance(value, StrategyName):
            return value.name
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, tuple):
            return ",".join(value)
        return str(value)


def _setting(default: object, **declared: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(**declared)})


_PIPELINE = "pipeline"
_FSDP = "fsdp"
_SPLIT_HELP = ("where each later stage begins: the modules to cut before (named_modules names, in forward order), "
               "instead of a balanced --stages. A model that is not an nn.Sequential (its own forward: blocks in a "
               "ModuleList, residuals) is cut this way only: torch.export traces it at the first batch and the "
               "stages are cut from the graph")


@dataclass(frozen=True, kw_only=True)
class JobSettings:
    """Every launcher-to-task setting of a job, checked once (errors name the flag); see the module docstring.

    ``strategy`` is parsed (a :class:`StrategyName`, or ``None`` for the default of the job's shape);
    ``split`` is a tuple of layer names. Tasks get one from :meth:`from_environ`.
    """

    strategy: StrategyName | str | None = _setting(
        None, flag="--strategy", check=validate.strategy, env=STRATEGY_VAR, agreed=True, metavar="NAME",
        help=f"{', '.join(STRATEGY_NAMES)} (default: allreduce; ps-sync with --ps; local for one process)")
    chief: bool = _setting(
        False, flag="--chief", check=validate.flag, agreed=True, kind=bool, switch="yes",
        help="name the first training task chief:0 instead of worker:0 (it is rank 0 either way)")
    tf_flags: bool = _setting(
        False, flag="--tf-flags", check=validate.flag, agreed=True, kind=bool, switch="yes",
        help="also give every task TensorFlow 1's cluster flags, right after SCRIPT: --ps_hosts=... "
             "--worker_hosts=... --job_name=worker|ps --task_index=I (not with --chief: worker 0 is TF1's chief)")
    max_restarts: int = _setting(
        3, flag="--max-restarts", check=lambda v, w: validate.count(v, w, 0, "job restarts after a task fails"),
        agreed=True, kind=int, metavar="R",
        help="restart the whole job at most R times after a task fails (default 3)")
    data_dir: str | None = _setting(None, flag="--data-dir", check=validate.folder, env=DATA_DIR_VAR, commands=())
    output_dir: str | None = _setting(None, flag="--output-dir", check=validate.folder, env=OUTPUT_DIR_VAR,
                                      commands=())
    share_gpus: bool = _setting(
        False, flag="--share-gpus", check=validate.flag, env=SHARE_GPUS_VAR, agreed=True, kind=bool, omit=False,
        training_only=True, inherited=True, commands=("run", "slurm"), switch="yes", group="placement",
        help="let more training tasks than visible GPUs share them (their collectives then go through gloo, since "
             f"NCCL refuses two ranks on one GPU; {SHARE_GPUS_VAR}=1); without it that is an error")
    restart_count: int = _setting(0, flag="restart count", check=lambda v, w: validate.count(v, w, 0),
                                  env=RESTART_COUNT_VAR, kind=int, commands=())
    resume: bool = _setting(
        True, flag="--no-resume", check=validate.flag, env=RESUME_VAR, agreed=True, kind=bool, switch="no",
        help=f"start from scratch, ignoring checkpoints already in OUTPUT_DIR ({RESUME_VAR}=0); restarts after a "
             "failure still resume from this job's own checkpoints")
    checkpoint_sync: bool = _setting(
        False, flag="--checkpoint-sync", check=validate.flag, env=CHECKPOINT_SYNC_VAR, kind=bool, omit=False,
        training_only=True, inherited=True, switch="yes",
        help="write each checkpoint before training goes on (default: the Trainer copies the state, then hashes, "
             f"writes and fsyncs it in the background; {CHECKPOINT_SYNC_VAR}=1)")
    timeout: float = _setting(
        300.0, flag="--timeout", check=validate.timeout, env=TIMEOUT_VAR, agreed=True, kind=float,
        metavar="SECONDS", help=f"collective and rendezvous timeout, passed as {TIMEOUT_VAR} (default 300, at most "
                                f"{validate.MAX_TIMEOUT:g})")
    stages: int | None = _setting(
        None, flag="--stages", check=validate.optional_count(1, "pipeline stages"), env=PIPELINE_STAGES_VAR,
        agreed=True, kind=int, metavar="S", group=_PIPELINE,
        help="cut the model (an nn.Sequential) into S stages balanced by parameter bytes; -n N with N a multiple of "
             "S runs N/S pipeline replicas")
    microbatches: int | None = _setting(
        None, flag="--microbatches", check=validate.optional_count(1, "microbatches per batch"),
        env=PIPELINE_MICROBATCHES_VAR, agreed=True, kind=int, metavar="M", group=_PIPELINE,
        help="microbatches per batch (default 2*S, or the largest count below it that divides the batch); the "
             "batch size must be a multiple of M")
    schedule: str | None = _setting(None, flag="--schedule", check=validate.text, env=PIPELINE_SCHEDULE_VAR,
                                    agreed=True, metavar="NAME", group=_PIPELINE, help="1f1b (default) or gpipe")
    split: tuple[str, ...] | str | None = _setting(
        None, flag="--split", check=validate.layer_names, env=PIPELINE_SPLIT_VAR, agreed=True, metavar="NAME,NAME",
        group=_PIPELINE, help=_SPLIT_HELP)
    fsdp_blocks: tuple[str, ...] | str | None = _setting(
        None, flag="--fsdp-blocks", check=validate.layer_names, env=FSDP_BLOCKS_VAR, agreed=True, metavar="NAME,NAME",
        group=_FSDP, help="with --strategy fsdp: the modules sharded one by one (named_modules names), then the root "
                          "(default: the children of the model's largest list of same-typed modules)")
    reshard_after_forward: bool = _setting(
        True, flag="--no-reshard-after-forward", check=validate.flag, env=FSDP_RESHARD_VAR, agreed=True, kind=bool,
        omit=True, switch="no", group=_FSDP,
        help="with --strategy fsdp: keep each block's gathered parameters from forward to backward (ZeRO-2-like: "
             "one all-gather less per block, more memory); default: free them after forward (ZeRO-3)")

    def __post_init__(self) -> None:
        for f, setting in _declared():
            object.__setattr__(self, f.name, setting.check(getattr(self, f.name), setting.flag))

    @property
    def settings(self) -> JobSettings:
        """These settings alone (a launcher's options less its own fields)."""
        if type(self) is JobSettings:
            return self
        return JobSettings(**{f.name: getattr(self, f.name) for f, _ in _declared()})

    def given_pipeline_flags(self) -> list[str]:
        """The pipeline flags given (not ``None``), e.g. ``["--stages"]``."""
        return [s.flag for f, s in _declared() if s.group == _PIPELINE and getattr(self, f.name) is not None]

    def check_job(self, workers: int) -> None:
        """The checks that relate settings to each other and to the job's ``workers`` (a launcher's)."""
        validate.tf_flags(self.tf_flags, self.chief)
        validate.pipeline_shape(self.strategy, workers, self.stages, self.given_pipeline_flags(), self.split)
        fsdp_given = [s.flag for f, s in _declared() if s.group == _FSDP and getattr(self, f.name) != f.default]
        validate.fsdp_flags(self.strategy, fsdp_given)
        if self.timeout > validate.MAX_TIMEOUT:  # inf would reach torch as a timedelta it cannot hold
            validate.seconds(self.timeout, "--timeout", zero_ok=False, most=validate.MAX_TIMEOUT,
                             example="e.g. --timeout 300")

    def environ(self, *, training: bool = True) -> dict[str, str]:
        """The variables that carry these settings to a task (a ``training`` one, or a ps task), in field order."""
        env = {}
        for f, setting in _declared():
            value = getattr(self, f.name)
            if setting.env is None or value is None or value is setting.omit or (setting.training_only
                                                                                 and not training):
                continue
            env[setting.env] = setting.text(value)
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobSettings:
        """The settings a task was given, read from its environment; a blank or unset variable is the default.

        ``ValueError`` naming the variable for a value its setting refuses."""
        values: dict[str, Any] = {}
        for f, setting in _declared():
            text = environ.get(setting.env, "").strip() if setting.env else ""
            if not text:
                continue
            if setting.kind is bool:  # only the other value's spelling changes a yes/no setting
                values[f.name] = text != "0" if f.default else text == "1"
                continue
            values[f.name] = setting.check(validate.from_text(setting.kind, text, setting.env), setting.env)
        return JobSettings(**values)

    def agreed(self) -> dict[str, Any]:
        """What a node publishes at the rendezvous for the others to compare: the agreed settings, JSON-able."""
        return {f.name: _public(getattr(self, f.name)) for f, s in _declared() if s.agreed}

    def flags(self, command: str = "run") -> list[tuple[str, ...]]:
        """``command``'s flags that give these settings where they differ from the defaults, each a
        ``(flag, value)`` or a ``(switch,)``: ``[("--strategy", "pipeline"), ("--stages", "2"), ("--chief",)]``."""
        out: list[tuple[str, ...]] = []
        for f, setting in _declared():
            value = getattr(self, f.name)
            if command in setting.commands and value != f.default:
                out.append((setting.flag,) if setting.switch else (setting.flag, setting.text(value)))
        return out

    def replace(self, **changes: Any) -> JobSettings:
        """A copy of these settings alone, with ``changes`` (checked again)."""
        return dataclasses.replace(self.settings, **changes)


def _public(value: object) -> object:
    return value.name if isinstance(value, StrategyName) else list(value) if isinstance(value, tuple) else value


def _declared() -> Iterator[tuple[dataclasses.Field, Setting]]:
    """JobSettings' fields and their declarations (a subclass may override a field's default, not its meaning)."""
    for f in fields(JobSettings):
        yield f, f.metadata["setting"]


def agreed_flags() -> tuple[str, ...]:
    """The settings every node of a job must give alike, by field name."""
    return tuple(f.name for f, s in _declared() if s.agreed)


def owned_variables() -> tuple[str, ...]:
    """The settings' variables a launcher writes itself, so a task never inherits the caller's stale value."""
    return tuple(s.env for _, s in _declared() if s.env and not s.inherited)


def add_arguments(groups: Mapping[str, Any], command: str) -> None:
    """Declare ``command``'s setting flags in ``groups``, argparse groups by :attr:`Setting.group` (job,
    placement, pipeline; ``job`` for a group not given).

    A flag not given is absent from the namespace (:func:`given`), so the defaults live in the fields alone."""
    for f, setting in _declared():
        if command not in setting.commands:
            continue
        group = groups.get(setting.group, groups["job"])
        common = dict(dest=f.name, default=argparse.SUPPRESS, help=setting.help)
        if setting.switch:
            group.add_argument(setting.flag, action="store_true" if setting.switch == "yes" else "store_false",
                               **common)
        else:
            kind = setting.kind if setting.kind in (int, float) else str
            group.add_argument(setting.flag, type=kind, metavar=setting.metavar, **common)


def given(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The settings given on ``command``'s command line, by field name (for the options class)."""
    return {f.name: getattr(args, f.name) for f, s in _declared()
            if command in s.commands and hasattr(args, f.name)}
