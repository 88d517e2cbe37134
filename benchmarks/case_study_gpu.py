"""CIFAR-10 case study, part 4: does the input pipeline keep a GPU busy, and how many cores per GPU does it need?

Run through `benchmarks/case_study.py --parts gpu`. It needs a CUDA device: without one the part is skipped
and the report says why, unless `--gpu-device cpu` asks for a smoke run of this code on the CPU (its figures
say nothing about GPUs; `make test` runs it that way).

Two workloads, each a model trained on the device from TFRecords prepared by its CPU-side pipeline:

- `cifar`: the CIFAR example's ResNet-20 (examples/cifar10/train.py) at batch 128 on part 1's CIFAR-shaped PNG
  shards, with the example's own training map (parse, decode the PNG, pad-crop, flip, normalise).
- `chexnet`: the chexnet-like workload of benchmarks/pipeline.py (256x256 JPEGs, random 224 crop, flip,
  normalise; batch 32) feeding a ResNet-50 (bottleneck blocks 3-4-6-3, 1,000 classes, 25.6 M parameters).

On a GPU both train in bfloat16 autocast with channels-last tensors. Feeders, each on k = 1, 2, 4, ... cores
(the measuring process, and every worker process it starts, confined to k cores with sched_setaffinity):

- `conveyor`: `list_files` + parallel `interleave` + `repeat` + `map(num_parallel_calls=AUTOTUNE)` + `batch` +
  `prefetch(AUTOTUNE)`, through `conveyor.data.to_torch(device, pin_memory=True)`, which copies the next batch
  to the GPU on a side stream while this step runs.
- `dataloader`: `torch.utils.data.DataLoader` over the same files and the same map, `num_workers=k`,
  `pin_memory=True`, batches copied with `non_blocking=True` (the usual recipe).
- `device`: one batch made once and kept on the device, at the most cores: the model's own rate, the ceiling
  every feeder is measured against.

Each point is a fresh process (this file run with `--point`, its result one JSON line on stdout): `warmup`
steps, then `steps` timed ones. GPU busy time is the sum over timed steps of the CUDA-event time from the
start of the forward pass to the end of the optimizer step (on the CPU smoke: the wall time of those calls);
GPU idle fraction = 1 - busy / the timed steps' wall time: the share of time the device waited for input or
for the CPU. Cores per GPU = the fewest k at which a feeder reaches `--gpu-enough` (default 95 %) of the
device-only rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # run as a script (each point) or loaded by case_study.py
import harness as h  # noqa: E402
from conveyor.data.records import TFRecordReader  # noqa: E402

WORKLOADS = ("cifar", "chexnet")
FEEDERS = ("conveyor", "dataloader")
CEILING = "device"
LABELS = {"conveyor": "conveyor pipeline + to_torch(pin_memory=True)",
          "dataloader": "torch DataLoader(num_workers=k, pin_memory=True)",
          CEILING: "one batch kept on the device (the model's own rate)"}
RESULT_PREFIX = "CASE_STUDY_GPU_POINT "


def no_device_reason(device: str) -> str | None:
    """Why this part cannot run on `device` (None when it can). Imports torch only to ask."""
    if device == "cpu":
        return None
    import torch
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False): part 4 needs a GPU "
                f"host; --gpu-device cpu runs its code on the CPU as a smoke test")
    return None


# ==================================================================================================
# One point, in a process of its own (this file run with --point).
# ==================================================================================================


def resnet50(num_classes: int = 1000):
    """He et al.'s ResNet-50 for 224x224 inputs, as an nn.Sequential (torchvision is not a dependency)."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = 4 * width
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return (self.body(x) + self.shortcut(x)).relu_()

    layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                             nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))]
    cin = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, 2 if stage and not i else 1))
            cin = 4 * width
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)))
    return nn.Sequential(*layers)


def workload_parts(config: dict[str, Any], amp_dtype: Any) -> tuple[Any, Callable[[bytes], Any], int]:
    """(model, per-record map, batch size) of config["workload"]."""
    if config["workload"] == "cifar":
        import case_study_input as inp
        example = inp.load_example()  # its ResNet sets its own autocast, which must not switch ours off
        return example.ResNet(3, 10, amp_dtype), example.example(training=True), config["batch"]
    import pipeline_workloads
    return resnet50(), pipeline_workloads.chexnet_fn, config["batch"]


class RecordShare(IterableDataset):
    """DataLoader's dataset: worker w of n reads files[w::n], or, with more workers than files, every file
    keeping every n-th record (so no worker sits idle); forever."""

    def __init__(self, files: Sequence[str], fn: Callable[[bytes], Any]):
        super().__init__()
        self.files, self.fn = list(files), fn

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        files, keep = (self.files[w::n], (0, 1)) if n <= len(self.files) else (self.files, (w, n))
        index = 0
        while True:
            for f in files:
                with TFRecordReader(f) as reader:
                    for record in reader:
                        if index % keep[1] == keep[0]:
                            yield self.fn(record)
                        index += 1


def feeder(config: dict[str, Any], fn: Callable[[bytes], Any], batch: int, device: Any) -> tuple[Iterator, Callable]:
    """(iterator of (images, labels) on `device`, close)."""
    import torch

    if config["feeder"] == CEILING:
        shape = (batch, 3, config["size"], config["size"])
        images = torch.randn(shape, device=device)  # laid out as the feeders' batches are (NCHW)
        labels = torch.randint(0, 10, (batch,), device=device)
        return iter(lambda: (images, labels), None), lambda: None
    pin = device.type == "cuda"
    if config["feeder"] == "conveyor":
        from conveyor.data import AUTOTUNE, Dataset, TFRecordDataset
        from conveyor.data.torch_adapter import to_torch
        ds = (Dataset.list_files(config["files"], shuffle=False)
              .interleave(lambda f: TFRecordDataset(f), cycle_length=4, num_parallel_calls=AUTOTUNE)
              .repeat().map(fn, num_parallel_calls=AUTOTUNE).batch(batch, drop_remainder=True).prefetch(AUTOTUNE))
        it = to_torch(ds, device=device, pin_memory=pin)
        return it, it.close
    loader = torch.utils.data.DataLoader(RecordShare(config["files"], fn), batch_size=batch,
                                         num_workers=config["cores"], pin_memory=pin, persistent_workers=False)
    raw = iter(loader)
    moved = ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in raw)
    return moved, raw._shutdown_workers  # num_workers >= 1: always the multiprocessing iterator


class StepTimer:
    """Busy time of the device over a run of steps: CUDA events around each step on the GPU (the time the GPU
    spent from the step's first kernel to its last), perf_counter around the (synchronous) step on the CPU."""

    def __init__(self, device: Any):
        import torch
        self.cuda = device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []
        self.cpu_seconds = 0.0
        self._torch = torch

    def around(self, step: Callable[..., None], *args: Any) -> None:
        if self.cuda:
            begin, end = (self._torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            step(*args)
            end.record()
            self.events.append((begin, end))
        else:
            t0 = time.perf_counter()
            step(*args)
            self.cpu_seconds += time.perf_counter() - t0

    def busy_seconds(self) -> float:
        if self.cuda:
            self._torch.cuda.synchronize()
            return sum(b.elapsed_time(e) for b, e in self.events) / 1000
        return self.cpu_seconds


def run_point(config: dict[str, Any]) -> dict[str, Any]:
    """Train config["steps"] timed steps after config["warmup"]; samples/s, GPU idle, input wait."""
    cores = list(range(config["cores"]))
    os.sched_setaffinity(0, cores)  # before torch sizes its thread pools; worker processes inherit it
    import torch
    torch.set_num_threads(config["cores"])
    device = torch.device(config["device"])
    torch.manual_seed(0)
    amp = device.type == "cuda" and torch.cuda.is_bf16_supported()
    model, fn, batch = workload_parts(config, torch.bfloat16 if amp else None)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train_step(images, labels) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    batches, close = feeder(config, fn, batch, device)
    try:
        for _ in range(config["warmup"]):
            train_step(*next(batches))
        if device.type == "cuda":
            torch.cuda.synchronize()
        timer, waited = StepTimer(device), 0.0
        started = time.perf_counter()
        for _ in range(config["steps"]):
            t0 = time.perf_counter()
            images, labels = next(batches)
            waited += time.perf_counter() - t0
            if tuple(images.shape) != (batch, 3, config["size"], config["size"]):
                raise RuntimeError(f"a batch of shape {tuple(images.shape)}")
            timer.around(train_step, images, labels.long())
        busy = timer.busy_seconds()  # synchronizes: every step has ended
        wall = time.perf_counter() - started
    finally:
        close()
    return {"samples_per_second": config["steps"] * batch / wall, "wall_seconds": wall, "busy_seconds": busy,
            "device_idle_fraction": max(0.0, 1 - busy / wall), "input_wait_fraction": waited / wall,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "amp": amp}


# ==================================================================================================
# Driver side.
# ==================================================================================================


def point(workload: str, feeder_name: str, cores: int) -> str:
    return f"{workload}/{feeder_name}@{cores}"


def points(workloads: Sequence[str], cores: Sequence[int]) -> list[str]:
    """Every feeder at every core count, the two feeders of one k back to back; the ceiling once, at most cores."""
    names = []
    for w in workloads:
        names.append(point(w, CEILING, max(cores)))
        names += [point(w, f, k) for k in cores for f in FEEDERS]
    return names


def measure_point(name: str, settings: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Run one point in a fresh process; (samples/s, its result). ContenderFailed naming the point on failure."""
    workload, rest = name.split("/")
    feeder_name, cores = rest.split("@")
    config = {**settings["workloads"][workload], "workload": workload, "feeder": feeder_name, "cores": int(cores),
              "device": settings["device"], "warmup": settings["warmup"], "steps": settings["steps"]}
    code, output = h.run_launcher([sys.executable, str(HERE), "--point", json.dumps(config)], settings["timeout"],
                                  threads=int(cores))
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if code != 0 or not lines:
        why = "timed out" if code is None else f"exit status {code}"
        raise h.ContenderFailed(f"{name}: {why}: {output.strip()[-1200:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    return result["samples_per_second"], result


def prepare(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each workload's files (made, or found cached, under args.data) and its shape."""
    import case_study_input as inp
    import pipeline_workloads
    made: dict[str, dict[str, Any]] = {}
    if "cifar" in args.gpu_workloads:
        data = inp.prepare_data(args.data, args.train_images, args.shards)
        files = sorted(str(p) for p in Path(data["pattern"]).parent.glob("train-*.tfrecord"))
        made["cifar"] = {"files": files, "batch": 128 if not args.quick else 32, "size": 32,
                         "model": "ResNet-20 (examples/cifar10/train.py)", "records": data["params"]["train_images"]}
    if "chexnet" in args.gpu_workloads:
        wl = (pipeline_workloads.QUICK_WORKLOADS if args.quick else pipeline_workloads.WORKLOADS)["chexnet"]
        files, _ = pipeline_workloads.generate_workload(wl, args.data)
        made["chexnet"] = {"files": files, "batch": 4 if args.quick else wl.batch_size, "size": wl.crop,
                           "model": "ResNet-50 (1,000 classes)", "records": wl.num_images}
    return made


def derive(res: dict[str, Any], workloads: Sequence[str], cores: Sequence[int], enough: float) -> dict[str, Any]:
    s, runs = res["samples"], res["runs"]
    d: dict[str, Any] = {}
    for w in workloads:
        ceiling = h.median(s[point(w, CEILING, max(cores))])
        per: dict[str, Any] = {}
        for f in FEEDERS:
            rate = {str(k): h.median(s[point(w, f, k)]) for k in cores}
            idle = {str(k): h.median([r and r["device_idle_fraction"] for r in runs[point(w, f, k)]]) for k in cores}
            share = {k: h.ratio(v, ceiling) for k, v in rate.items()}
            fed = [k for k in cores if share[str(k)] >= enough]
            per[f] = {"samples_per_second": rate, "device_idle_fraction": idle, "of_ceiling": share,
                      "cores_needed": min(fed) if fed else None}
        per["conveyor_vs_dataloader"] = {str(k): h.median(h.paired(s[point(w, "conveyor", k)],
                                                                   s[point(w, "dataloader", k)])) for k in cores}
        d[w] = {"ceiling_samples_per_second": ceiling,
                "ceiling_idle_fraction": h.median([r and r["device_idle_fraction"]
                                                   for r in runs[point(w, CEILING, max(cores))]]), **per}
    return d


def format_table(d: dict[str, Any], settings: dict[str, Any], cores: Sequence[int], enough: float) -> str:
    lines = [f"GPU feeding ({settings['device_name']}): {settings['steps']} timed steps after {settings['warmup']}; "
             f"samples/s medians over rounds; device idle = 1 - GPU busy time / wall time; "
             f"'of ceiling' = / the rate with one batch kept on the device"]
    for w, dw in d.items():
        wl = settings["workloads"][w]
        lines.append(f"\n{w}: {wl['model']}, batch {wl['batch']}, {wl['size']}x{wl['size']} inputs; ceiling "
                     f"{h.fmt(dw['ceiling_samples_per_second'], '.0f')} samples/s (idle "
                     f"{h.fmt(dw['ceiling_idle_fraction'], '.0%')})")
        rows = [("cores", "conveyor/s", "of ceiling", "idle", "DataLoader/s", "of ceiling", "idle", "conveyor/DL")]
        for k in map(str, cores):
            c, dl = dw["conveyor"], dw["dataloader"]
            rows.append((k, h.fmt(c["samples_per_second"][k], ".0f"), h.fmt(c["of_ceiling"][k], ".0%"),
                         h.fmt(c["device_idle_fraction"][k], ".0%"), h.fmt(dl["samples_per_second"][k], ".0f"),
                         h.fmt(dl["of_ceiling"][k], ".0%"), h.fmt(dl["device_idle_fraction"][k], ".0%"),
                         h.fmt(dw["conveyor_vs_dataloader"][k], ".2f")))
        lines.append(h.format_rows(rows))
        need = {f: dw[f]["cores_needed"] for f in FEEDERS}
        lines.append(f"cores per GPU to reach {enough:.0%} of the ceiling: " + ", ".join(
            f"{f} {n if n is not None else f'more than {max(cores)}'}" for f, n in need.items()))
    return "\n".join(lines)


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    """Part 4 as case_study.py runs it: skipped with the reason without a device, else rounds of every point."""
    import case_study_plots as plots
    reason = no_device_reason(args.gpu_device)
    if reason:
        print(f"part 4 skipped: {reason}")
        return {"skipped": reason, "errors": [], "table": f"GPU feeding: skipped ({reason})", "plot": None}
    import torch
    device_name = torch.cuda.get_device_name(0) if args.gpu_device == "cuda" else "cpu (smoke run)"
    settings = {"device": args.gpu_device, "device_name": device_name, "warmup": args.gpu_warmup,
                "steps": args.gpu_steps, "timeout": args.timeout, "workloads": prepare(args)}
    names = points(args.gpu_workloads, args.gpu_cores)

    def describe(rate: float, run: dict[str, Any]) -> str:
        return (f"{rate:.0f} samples/s, device idle {run['device_idle_fraction']:.0%}, "
                f"input wait {run['input_wait_fraction']:.0%}")

    res = h.interleaved_rounds(names, args.repeats, lambda name, rnd: measure_point(name, settings),
                               describe=describe)
    d = derive(res, args.gpu_workloads, args.gpu_cores, args.gpu_enough)
    plot = plots.plot_gpu_feeding(d, args.gpu_cores, args.gpu_enough, args.out / "gpu_feeding.png",
                                  f"Feeding {device_name}: each input pipeline against the model's own rate")
    return {"config": {k: v for k, v in settings.items() if k != "workloads"} | {
                "workloads": {w: {k: v for k, v in c.items() if k != "files"} | {"files": len(c["files"])}
                              for w, c in settings["workloads"].items()},
                "cores": list(args.gpu_cores), "enough": args.gpu_enough, "feeders": LABELS},
            "samples": res["samples"], "runs": res["runs"], "order": res["order"], "errors": res["errors"],
            "derived": d, "table": format_table(d, settings, args.gpu_cores, args.gpu_enough),
            "plot": plot and str(plot)}


def add_arguments(p: argparse.ArgumentParser, default_cores: str, counts: Callable[[str], tuple[int, ...]]) -> None:
    g = p.add_argument_group("part 4, GPU feeding (needs CUDA)")
    g.add_argument("--gpu-device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; the part is skipped without it) or cpu: a smoke run of the code")
    g.add_argument("--gpu-workloads", type=h.contender_names(WORKLOADS), default=WORKLOADS,
                   help=f"subset of {','.join(WORKLOADS)} (default both)")
    g.add_argument("--gpu-cores", type=counts, default=None,
                   help=f"cores given to the input, e.g. 1,2,4,8,16 (default {default_cores}; --quick 1)")
    g.add_argument("--gpu-steps", type=int, default=None, help="timed steps per point (default 60; --quick 3)")
    g.add_argument("--gpu-warmup", type=int, default=None, help="untimed steps first (default 10; --quick 1)")
    g.add_argument("--gpu-enough", type=float, default=0.95,
                   help="share of the device-only rate that counts as keeping the GPU fed (default 0.95)")


def main(argv: Sequence[str]) -> int:
    """`--point JSON`: run one point, print its result (the driver runs this in a fresh process)."""
    if len(argv) != 2 or argv[0] != "--point":
        print(f"usage: {HERE.name} --point JSON (run by benchmarks/case_study.py --parts gpu)", file=sys.stderr)
        return 2
    result = run_point(json.loads(argv[1]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if all(math.isfinite(v) for v in result.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
