"""The pipeline strategy's checkpoint item: one part per stage, written by the process that holds the stage.

    items = strategy.checkpoint_items(model, optimizer)      # {"optimizer": StagesItem(strategy, optimizer)}

Replica 0's process of stage i writes part `stage-<i>` (its parameters under whole-model names, and
its optimizer state); the chief writes the header (format, split, part names, replicas) as the tree
`optimizer`, the name it has had on disk since before items. On resume every process reads its own
stage's part, whatever its replica: every replica of a stage holds the same state, so a job with
another number of replicas (the split unchanged) resumes, the chief saying so. A checkpoint of
another split, or not written by this strategy, is refused naming both, why and the fix. With
``--shard-stages`` every process writes its shards of its stage instead (``stage-<i>-shard-<r>``;
``sharded.py``); such a checkpoint resumes only with ``--shard-stages``.
"""

from __future__ import annotations

import sys
from typing import Any

from conveyor.strategies.pipeline.sharded import restore_shard, save_shard, shard_part, sharded_header
from conveyor.strategies.pipeline.split import plan_from_signature
from conveyor.strategies.pipeline.traced import TracedRunner
from conveyor.train.checkpoint.items import Item, StepWrite
from conveyor.train.checkpoint.read import Checkpoint

__all__ = ["CHECKPOINT_FORMAT", "StagesItem"]

CHECKPOINT_FORMAT = "conveyor.pipeline.stages"


class StagesItem(Item):
    """Every stage's model and optimizer state, as parts (module docstring)."""

    def __init__(self, strategy: Any, optimizer: Any):
        self.strategy, self.optimizer = strategy, optimizer

    def save(self, name: str, out: StepWrite) -> None:
        s = self.strategy
        plan = s._plan()
        if s.shard_stages:
            save_shard(s, self.optimizer, out)
        elif s.replica == 0:
            out.part_tree(f"stage-{s.stage}", {"stage": s.stage, "split": plan.signature(),
                                               "model": s.module.model_state_dict(),
                                               "optimizer": self.optimizer.state_dict()})
        if out.is_chief:
            names = [f"stage-{i}" for i in range(plan.num_stages)]
            header = {"format": CHECKPOINT_FORMAT, "split": plan.signature(), "stages": names,
                      "replicas": int(s.replicas)}
            if s.shard_stages:
                header |= sharded_header(s)
                names = [shard_part(i, r) for i in range(plan.num_stages) for r in range(s.replicas)]
            out.tree(name, header)
            out.expect(f"{n}.{ext}" for n in names for ext in ("safetensors", "json"))

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        """Every process reads its stage's part; a checkpoint of another split is refused, naming both."""
        s = self.strategy
        plan, header = s._plan(), ckpt.tree(name)
        if not (isinstance(header, dict) and header.get("format") == CHECKPOINT_FORMAT):
            raise ValueError("it was not written by the pipeline strategy (it holds the whole model): resume it with "
                             "the strategy that wrote it")
        saved = plan_from_signature(header["split"])
        if saved != plan:
            raise ValueError(f"it was written with the split [{saved.short()}] ({saved.num_stages} stages) and this "
                             f"job splits [{plan.short()}] ({plan.num_stages} stages): resume with the split that "
                             f"wrote it ({saved.resume_flags()}). Why: each stage's part holds the parameters and "
                             f"optimizer state of that stage's layers only, and a resume does not move layers "
                             f"between stages; the number of replicas may change, the split may not")
        if s.shard_stages:
            restore_shard(s, self.optimizer, header, ckpt)
            return
        if header.get("shards"):
            raise ValueError(f"it was written with --shard-stages (each stage in {header['shards']} FSDP shards) and "
                             f"this job does not shard its stages: resume with --shard-stages (2 replicas or more per "
                             f"stage), or export the whole model (conveyor checkpoint export) and start from that")
        replicas = header.get("replicas")
        if s.job.is_chief and isinstance(replicas, int) and replicas != s.replicas:
            print(f"resumed step {ckpt.step}, written by {replicas} pipeline replica(s), on {s.replicas}: every "
                  f"replica loads its stage's part (split [{plan.short()}] unchanged)", file=sys.stderr, flush=True)
        state = ckpt.part_tree(f"stage-{s.stage}")
        if isinstance(s.runner, TracedRunner) and not s.runner.ready:
            s._restored = state  # loaded when the first batch has decided what this stage holds
        else:
            s._load_part(state, self.optimizer)
