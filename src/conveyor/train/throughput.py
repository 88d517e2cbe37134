"""The step log's throughput figures, torchtitan's way: tokens/s, achieved TFLOPS, MFU and peak memory.

    meter = Throughput(device, peak_tflops=None, tokens_per_sample=None, count_flops=True)
    loss = meter.train(step.train, model, optimizer, loss_fn, inputs, targets, mark)  # the 1st step counted
    tokens, flops = meter.measure(inputs, batch, counted)     # this step's (None: unknown)
    meter.figures(flops, tokens, seconds)                     # {"tokens_per_second", "tflops", "mfu"} known

FLOPs: the first training step (forward, backward and the optimizer step, as the strategy runs it) runs
once under torch's ``FlopCounterMode``: matmuls, convolutions and attention count (2 per multiply-add);
elementwise work, the optimizer and meta-device shape inference do not. A Linear layer costs 2*in*out per
sample forward and as much again for each of its input and weight gradients (the first layer computes no
input gradient). Later steps are scaled by their batch size. Each process counts what it runs: under
allreduce and the parameter servers the whole model's forward and backward, under pipeline its own
stage's, so the figures are per device. Counting leaves the step's result unchanged.

Tokens: a batch whose inputs are an integer tensor of shape (B, T) has B*T tokens; ``tokens_per_sample``
overrides it (any input). Peak: ``peak_tflops``, else on CUDA the bf16 dense peak of a known GPU
(``PEAK_BF16_TFLOPS``); MFU is shown only where a peak is known (on the CPU only when it is given).
Peak memory: CUDA's max_memory_allocated on a GPU, the process's peak RSS (getrusage) elsewhere.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from conveyor.train.evaluation import batch_size

__all__ = ["PEAK_BF16_TFLOPS", "Throughput", "check_options", "count_flops", "device_peak_tflops",
           "peak_memory_bytes", "tokens_per_sample"]

# Dense bf16 tensor-core peaks (TFLOPS) from NVIDIA's data sheets (their headline figures are with 2:4
# sparsity: these are half of them), the values torchtitan's get_peak_flops uses. Matched in this order
# against torch.cuda.get_device_name ("NVIDIA H100 80GB HBM3" is the SXM part).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),   # SXM
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),   # AWS's figure for its A10G
    ("A10", 125.0),
)


def check_options(peak_tflops: Any, tokens_per_sample: Any, count: Any) -> None:
    """Raise ValueError naming the option and what it takes (TrainConfig's validation)."""
    if peak_tflops is not None and (isinstance(peak_tflops, bool) or not isinstance(peak_tflops, (int, float))
                                    or not math.isfinite(peak_tflops) or peak_tflops <= 0):
        raise ValueError(f"peak_tflops must be a positive number (the device's peak, e.g. 989 for an H100 SXM "
                         f"in bf16) or None, got {peak_tflops!r}")
    if tokens_per_sample is not None and (isinstance(tokens_per_sample, bool)
                                          or not isinstance(tokens_per_sample, int) or tokens_per_sample < 1):
        raise ValueError(f"tokens_per_sample must be a positive integer or None, got {tokens_per_sample!r}")
    if not isinstance(count, bool):
        raise ValueError(f"count_flops must be True or False, got {count!r}")


def device_peak_tflops(device: torch.device | str) -> float | None:
    """The bf16 dense peak of a known CUDA GPU (``PEAK_BF16_TFLOPS``); None on the CPU or an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key.lower() in name.lower()), None)


def peak_memory_bytes(device: torch.device | str) -> int:
    """This process's peak memory so far: CUDA's max_memory_allocated on a GPU, else the peak RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows: no getrusage; the current RSS is the best there is
        import psutil

        return int(psutil.Process().memory_info().rss)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def count_flops(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` run once under torch's FlopCounterMode: its result and the FLOPs it dispatched."""
    counter = _flop_counter()
    with counter:
        result = fn(*args)
    return result, int(counter.get_total_flops())


def _flop_counter() -> Any:
    """torch's FlopCounterMode, leaving out work on the meta device: shape inference (a pipeline's schedule
    build and start-up table run the stage on meta tensors at the first step) computes nothing."""
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import FlopCounterMode

    class RealFlopCounter(FlopCounterMode):
        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:  # torch's hook per op
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(out)):
                return out
            return super()._count_flops(func_packet, out, args, kwargs)

    return RealFlopCounter(display=False)


def tokens_per_sample(inputs: Any, override: int | None) -> int | None:
    """Tokens in one sample: ``override``, else T for integer inputs of shape (B, T), else None."""
    if override is not None:
        return override
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and not inputs.is_floating_point() \
            and not inputs.is_complex() and inputs.dtype != torch.bool:
        return int(inputs.shape[1])
    return None


class Throughput:
    """The run's FLOPs per sample (counted on its first step), tokens per sample and peak (module docstring)."""

    def __init__(self, device: torch.device | str, *, peak_tflops: float | None = None,
                 tokens_per_sample: int | None = None, count_flops: bool = True):
        self.device = torch.device(device)
        self.peak_tflops = float(peak_tflops) if peak_tflops is not None else device_peak_tflops(self.device)
        self.tokens_override = tokens_per_sample
        self.counting = count_flops
        self.flops_per_sample: float | None = None
        self.count_seconds: float | None = None  # the counted first step's wall time, counting included
        self.total_tokens: int | None = None  # this run's, on this process (summary.json)
        self.total_flops: float | None = None

    def train(self, step_train: Callable[..., torch.Tensor], model: Any, optimizer: Any, loss_fn: Any,
              inputs: Any, targets: Any, mark: Callable[[str], None]) -> torch.Tensor:
        """``step_train(model, ...)`` once; the first call under the FLOP counter (run exactly once)."""
        if not self.counting:
            return step_train(model, optimizer, loss_fn, inputs, targets, mark)
        self.counting = False
        start = time.perf_counter()
        loss, flops = count_flops(step_train, model, optimizer, loss_fn, inputs, targets, mark)
        self.count_seconds = time.perf_counter() - start
        samples = batch_size(targets)
        if flops > 0 and samples:
            self.flops_per_sample = flops / samples
        return loss

    def measure(self, inputs: Any, targets: Any, counted: int) -> tuple[int | None, float | None]:
        """This step's tokens (of its ``counted`` samples) and this process's FLOPs; None where unknown."""
        per = tokens_per_sample(inputs, self.tokens_override)
        tokens = counted * per if per is not None else None
        flops = None
        if self.flops_per_sample is not None:
            flops = self.flops_per_sample * batch_size(targets)
            self.total_flops = (self.total_flops or 0.0) + flops
        if tokens is not None:
            self.total_tokens = (self.total_tokens or 0) + tokens
        return tokens, flops

    def figures(self, flops: float | None, tokens: float | None, seconds: float) -> dict[str, float]:
        """Per-second figures for ``flops`` per device and ``tokens`` over ``seconds``: only the known ones."""
        seconds = max(seconds, 1e-9)
        out: dict[str, float] = {}
        if tokens is not None:
            out["tokens_per_second"] = tokens / seconds
        if flops is not None:
            out["tflops"] = flops / seconds / 1e12
            if self.peak_tflops:
                out["mfu"] = out["tflops"] / self.peak_tflops
        return out

