"""The fsdp strategy: ``fully_shard`` on each block, then on the root; the optimizer rebound to the shards.

    strategy = FSDPStrategy(blocks=None, reshard_after_forward=None)   # None: the job's settings
    strategy.setup(job)            # device mesh over all ranks; the gradient-average check (.check)
    model, optimizer = strategy.prepare(model, optimizer)

Blocks: ``--fsdp-blocks a,b`` (``named_modules`` names), else the children of the model's largest
``ModuleList``/``Sequential`` of same-typed modules, else its top-level children with parameters.
Every rank starts from rank 0's parameters and buffers (broadcast before sharding). The optimizer the
script built is kept and its parameter groups point at the sharded parameters (DTensors) afterwards, so
a scheduler built on it still works; it must not have state yet. ``reshard_after_forward`` True frees
each block's gathered parameters after forward (ZeRO-3), False keeps them for backward (ZeRO-2-like).
On CUDA, parameters compute in bf16 and gradients reduce in fp32 (``MixedPrecisionPolicy``).
Communication: :class:`FSDPStep` times FSDP2's own all-gathers and reduce-scatters (``comm_seconds``, and
per step in ``report()``'s ``fsdp`` block) through its ``set_custom_all_gather``/``set_custom_reduce_scatter``.
Checkpoints: :mod:`conveyor.strategies.fsdp.checkpoint`. Why and how: docs/strategies.md, "FSDP".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from conveyor.comm.process_group import collective_guard
from conveyor.strategies.base import Step, Strategy, check_optimizer
from conveyor.strategies.fsdp.check import check_gradients_averaged
from conveyor.strategies.fsdp.checkpoint import ShardsItem
from conveyor.strategies.fsdp.comm import CommClock, time_collectives
from conveyor.strategies.fsdp.shards import rebind_optimizer
from conveyor.train.checkpoint.items import Item

__all__ = ["FSDPStep", "FSDPStrategy", "default_blocks"]


class FSDPStrategy(Strategy):
    """FSDP2 over all ranks (module docstring); arguments left None come from the job's settings."""

    name = "fsdp"

    def __init__(self, blocks: Sequence[str] | None = None, reshard_after_forward: bool | None = None) -> None:
        super().__init__()
        self.blocks: tuple[str, ...] | None = tuple(blocks) if blocks is not None else None
        self.reshard_after_forward = reshard_after_forward
        self.mesh: Any = None
        self.sharded: list[str] = []  # the blocks prepare() sharded, in order ("" last: the root)

    def setup(self, job: Any) -> None:
        super().setup(job)
        given = getattr(job, "settings", None)
        if self.blocks is None and given is not None and given.fsdp_blocks:
            self.blocks = tuple(given.fsdp_blocks)
        if self.reshard_after_forward is None:
            self.reshard_after_forward = True if given is None else bool(given.reshard_after_forward)
        self.mesh = init_device_mesh(job.device.type, (int(job.world_size),))
        check_gradients_averaged(job, self.mesh)
        self.step = FSDPStep(job)

    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
        job = self.job
        check_optimizer(model, optimizer)
        if isinstance(model, FSDPModule):
            raise ValueError("the model is already sharded with fully_shard; pass the plain module to job.prepare()")
        if getattr(optimizer, "state", None):
            raise ValueError("the optimizer has taken steps already (it holds state): build it fresh from the model "
                             "and pass it to job.prepare() before training")
        model = model.to(job.device)
        blocks = self._blocks(model)
        names = {id(p): n for n, p in model.named_parameters()}
        if job.world_size > 1:
            _broadcast_from_rank0(job, model)
        options: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": bool(self.reshard_after_forward)}
        if job.device.type == "cuda":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        modules = dict(model.named_modules())
        for name in blocks:
            fully_shard(modules[name], **options)
        fully_shard(model, **options)
        self.sharded = [*blocks, ""]
        time_collectives([modules[name] for name in blocks] + [model], self.step.clock)
        rebind_optimizer(optimizer, names, model)
        return model, optimizer

    def _blocks(self, model: nn.Module) -> list[str]:
        """The blocks to shard, deepest first (a block inside another is sharded before it, as FSDP2 needs)."""
        if self.blocks is None:
            return default_blocks(model)
        modules = dict(model.named_modules())
        unknown = [b for b in self.blocks if b not in modules or b == ""]
        if unknown:
            children = [n for n, _ in model.named_children()]
            raise ValueError(f"--fsdp-blocks {','.join(self.blocks)}: {', '.join(map(repr, unknown))} is not a module "
                             f"of the model; its children are {', '.join(children) or '(none)'} (give named_modules "
                             f"names, e.g. layers.0,layers.1)")
        return sorted(dict.fromkeys(self.blocks), key=lambda b: -b.count("."))

    def checkpoint_items(self, module: nn.Module, optimizer: Any) -> dict[str, Item]:
        """One part per rank with its shards of the model and optimizer state (:class:`ShardsItem`)."""
        return {"fsdp": ShardsItem(self, module, optimizer)}

    def report(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """``fsdp``: the blocks sharded, the resharding mode, the ranks sharing each parameter, and this rank's
        all-gather and reduce-scatter seconds (totals and per step of ``summary["steps"]``; :class:`CommClock`)."""
        clock: CommClock = self.step.clock
        steps = int(summary.get("steps_this_run") or summary.get("steps") or 0)
        per_step = {f"{k}_per_step": (v / steps if steps else None) for k, v in clock.seconds().items()}
        return {"fsdp": {"blocks": [b for b in self.sharded if b], "reshard_after_forward": self.reshard_after_forward,
                         "shards": int(self.job.world_size), **clock.seconds(), **per_step,
                         "collectives": dict(clock.calls)}}


class FSDPStep(Step):
    """The plain step on the sharded model: FSDP2 gathers parameters and reduce-scatters gradients in its hooks.

    ``comm_seconds`` is the wall time spent in FSDP2's all-gather and reduce-scatter calls so far
    (:class:`CommClock`): on CPU/gloo the collectives themselves, all inside ``forward_backward``; on CUDA only
    their launch (they run on FSDP2's own streams). 0 where torch has no custom-collective hooks (before 2.8).
    """

    shadows = True  # a zero-weight forward/backward gathers and reduce-scatters as a real one (FSDP2 has no Join)

    def __init__(self, job: Any) -> None:
        self._job = job
        self.clock = CommClock()

    def comm_seconds(self) -> float:
        return self.clock.total()

    def check(self, model: nn.Module, train_data: Any) -> None:
        if not isinstance(model, FSDPModule):
            raise ValueError("the model is not sharded for the fsdp strategy (not an FSDPModule), so its parameters "
                             "are not the ones the optimizer updates: pass the model and optimizer that "
                             "`job.prepare(model, optimizer)` returned")


def default_blocks(model: nn.Module) -> list[str]:
    """The model's repeated blocks: the children of its largest ``ModuleList``/``Sequential`` of two or more
    same-typed modules; else its top-level children that hold parameters. ``ValueError`` naming the flag if none."""
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > 1:
            kinds = {type(child) for child in module.children()}
            if len(kinds) == 1 and any(True for _ in module.parameters()) and (best is None or len(module) > best[0]):
                best = (len(module), name, module)
    if best is not None:
        _, name, module = best
        return [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    blocks = [name for name, child in model.named_children() if any(True for _ in child.parameters())]
    if not blocks:
        raise ValueError(f"the model ({type(model).__name__}) has no child module with parameters to shard as a block: "
                         f"name the blocks with --fsdp-blocks NAME,NAME (named_modules names), or use --strategy "
                         f"allreduce for a model this small")
    return blocks


def _broadcast_from_rank0(job: Any, model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers, as the allreduce strategy promises."""
    with torch.no_grad(), collective_guard(job, "FSDP setup (parameter broadcast from rank 0)"):
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
