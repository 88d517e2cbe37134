"""Which GPU a training task trains on: one process per GPU, chosen by local rank, and checked.

    choose_gpu(local_rank=1, local_world_size=2, visible=4, share=False)   # 1
    choose_gpu(local_rank=3, local_world_size=4, visible=2, share=False)   # GpuPlacementError: 4 tasks, 2 GPUs
    choose_gpu(local_rank=3, local_world_size=4, visible=2, share=True)    # 1 (with local rank 1)
    device = task_device(job_local_rank, local_world_size, share, environ)  # torch.device, made current

:func:`choose_gpu` is the whole rule, pure: task ``local_rank`` of this machine's ``local_world_size``
training tasks takes visible GPU ``local_rank mod visible`` (``CUDA_VISIBLE_DEVICES`` decides what is
visible: torch counts only those). More tasks than GPUs would put two on one GPU, which is refused
unless sharing was asked for (``conveyor run --share-gpus``, ``CONVEYOR_SHARE_GPUS=1``,
``conveyor.init(share_gpus=True)``): two processes on one GPU split its memory and its time, and NCCL
refuses two ranks of one communicator on one GPU, so a job that allows sharing runs its collectives
through gloo. A task that a scheduler gave GPUs of its own (Slurm's ``--gpus-per-task``: each task
sees only its own) is not sharing even where it sees fewer GPUs than it has local peers; it takes
its first one. No GPU visible: the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.cluster.settings import JobSettings
from conveyor.cluster.variables import SHARE_GPUS_VAR, TASK_TYPE_VAR
from conveyor.errors import ConveyorError

__all__ = ["GpuPlacementError", "choose_gpu", "share_gpus_from", "task_device"]

#: Set by Slurm's srun when each task was given its own GPUs (``--gpus-per-task``).
SLURM_GPUS_PER_TASK = "SLURM_GPUS_PER_TASK"


class GpuPlacementError(ConveyorError, ValueError):
    """More training tasks on a machine than GPUs they can see, and sharing was not asked for."""

    usage_error = True  # a restart meets it again: `conveyor run` does not retry it


def choose_gpu(local_rank: int, local_world_size: int, visible: int, share: bool, *,
               own_gpus: bool = False, visible_names: str | None = None) -> int | None:
    """The visible GPU index of task ``local_rank`` of ``local_world_size`` on this machine, or None (CPU).

    ``own_gpus``: a scheduler already gave this task GPUs of its own. ``visible_names`` (the value of
    ``CUDA_VISIBLE_DEVICES``, if set) only makes the error message more precise.
    """
    if not 0 <= local_rank < max(local_world_size, 1):
        raise ValueError(f"LOCAL_RANK={local_rank} is outside 0..{local_world_size - 1} (LOCAL_WORLD_SIZE="
                         f"{local_world_size}); the launcher's variables disagree")
    if visible <= 0:
        return None
    if own_gpus:
        return 0
    if local_world_size > visible and not share:
        shown = f" (CUDA_VISIBLE_DEVICES={visible_names})" if visible_names is not None else ""
        raise GpuPlacementError(
            f"{local_world_size} training tasks on this machine but {visible} visible GPU(s){shown}: local rank "
            f"{local_rank} would share GPU {local_rank % visible} with another task. Start at most {visible} "
            f"training task(s) per machine (conveyor run -n {visible}; torchrun --nproc-per-node {visible}), make "
            f"more GPUs visible, or allow sharing with conveyor run --share-gpus ({SHARE_GPUS_VAR}=1, or "
            f"conveyor.init(share_gpus=True)); shared GPUs all-reduce through gloo, since NCCL refuses two ranks "
            f"on one GPU")
    return local_rank % visible


def share_gpus_from(share: bool | None, environ: Mapping[str, str]) -> bool:
    """The argument when given, else whether the sharing variable is ``1``."""
    if share is not None:
        return bool(share)
    return JobSettings.from_environ({SHARE_GPUS_VAR: environ.get(SHARE_GPUS_VAR, "")}).share_gpus  # its one reader


def task_device(local_rank: int, local_world_size: int, share: bool, environ: Mapping[str, str]):
    """This task's ``torch.device`` by :func:`choose_gpu`; a GPU is made the current CUDA device."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Under `srun ... conveyor run`, the variable describes the launcher's srun task: the node's GPUs, which
    # the launcher's tasks share out by local rank. Only a process srun started itself has GPUs of its own.
    own_gpus = bool(environ.get(SLURM_GPUS_PER_TASK)) and TASK_TYPE_VAR not in environ
    index = choose_gpu(local_rank, local_world_size, visible, share, own_gpus=own_gpus,
                       visible_names=environ.get("CUDA_VISIBLE_DEVICES"))
    if index is None:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
