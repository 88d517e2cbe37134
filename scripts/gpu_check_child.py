"""The processes scripts/gpu_check.py starts: the install probe and the strategy runs it compares.

    python scripts/gpu_check_child.py probe SITE              # one JSON line: what is installed, torch, CUDA
    python scripts/gpu_check_child.py reference OUT.json      # one process, the whole batch, a plain loop
    conveyor run -n 2 --ps 1 --strategy ps-sync --share-gpus scripts/gpu_check_child.py task OUT_DIR

`task` trains the same small model on the same data as `reference`, each worker on its share of every
batch, under whatever strategy `conveyor run` gave it, and writes OUT_DIR/rank<R>.json: the final
parameters, the job's device and backend, and the devices the parameters and the batches were on at every
step (so a silent fall back to the CPU shows). With world size 1 on CUDA it first opens a one-rank NCCL
group and all-reduces a CUDA tensor through it: conveyor itself needs no collective for one rank, and one
GPU cannot hold two NCCL ranks, so this is as much of NCCL as one GPU can show.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

STEPS = 10
BATCH = 16  # the whole batch; each of W workers takes BATCH // W of it
FEATURES = 32


def probe(site: str) -> dict:
    """What the interpreter now imports: conveyor (from SITE?), its requirements, torch and the GPU."""
    import importlib.metadata as md

    import torch

    import conveyor
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it: present wherever pip is
        from pip._vendor.packaging.requirements import Requirement
    unmet = []
    for text in md.requires("conveyor") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{req.name} (missing)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req.name} {version} (wants {req.specifier})")
    cuda = torch.cuda.is_available()
    return {"conveyor_version": md.version("conveyor"), "conveyor_file": conveyor.__file__,
            "from_site": str(Path(conveyor.__file__).resolve()).startswith(str(Path(site).resolve())),
            "unmet": unmet, "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": cuda,
            "device_name": torch.cuda.get_device_name(0) if cuda else None,
            "bf16": bool(cuda and torch.cuda.is_bf16_supported()), "python": sys.version.split()[0]}


def make_model():
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))


def make_data():
    import torch
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * BATCH, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def flat(model) -> list[float]:
    import torch
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters()]).tolist()


def train(model, optimizer, device, rank: int, world: int) -> dict:
    """STEPS steps on this rank's share of each batch; the devices seen on the way."""
    from torch import nn
    x, y = make_data()
    share = BATCH // world
    seen = {"param_devices": set(), "batch_devices": set()}
    for k in range(STEPS):
        lo = k * BATCH + rank * share
        xb, yb = x[lo:lo + share].to(device), y[lo:lo + share].to(device)
        seen["param_devices"].update(str(p.device) for p in model.parameters())
        seen["batch_devices"].update({str(xb.device), str(yb.device)})
        optimizer.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
    return {k: sorted(v) for k, v in seen.items()}


def reference(out: str) -> None:
    import torch
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = make_model().to(device)
    seen = train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), device, 0, 1)
    Path(out).write_text(json.dumps({"device": str(device), "params": flat(model), **seen}))


def one_rank_group(device) -> str:
    """Open a one-rank group (NCCL on CUDA, else gloo), all-reduce through it, close it; its backend."""
    import torch
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        if t.device != device or t.sum().item() != 4:
            raise RuntimeError(f"a one-rank all_reduce over {backend} gave {t} on {t.device}")
        return dist.get_backend()
    finally:
        dist.destroy_process_group()


def task(out_dir: str) -> None:
    import torch

    import conveyor
    job = conveyor.init()  # a ps task serves here and exits when the workers are done
    group = one_rank_group(job.device) if job.world_size == 1 else None
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)
    seen = train(model, optimizer, job.device, job.rank, job.world_size)
    job.barrier()  # every worker's last step is applied: the parameters are final
    result = {"rank": job.rank, "world_size": job.world_size, "strategy": job.strategy.name,
              "device": str(job.device), "backend": job.backend, "one_rank_group": group, "params": flat(model),
              "conveyor_file": conveyor.__file__, **seen}
    Path(out_dir, f"rank{job.rank}.json").write_text(json.dumps(result))
    job.shutdown()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("probe", "reference", "task"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if argv[0] == "probe":
        print(json.dumps(probe(argv[1])))
    elif argv[0] == "reference":
        reference(argv[1])
    else:
        task(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
