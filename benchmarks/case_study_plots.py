"""The CIFAR-10 case study's figures, drawn from its derived values (matplotlib, `conveyor[plots]`).

    plot_input_scaling(derived, contenders, workers, path, title)     # samples/s against workers
    plot_allreduce_scaling(derived, workers, path, title)             # speedup against workers
    plot_gpu_feeding(derived, cores, enough, path, title)             # share of the GPU's own rate against cores

Each returns the path written, or None when matplotlib is missing (the caller says so once).
Missing points (a failed measurement) are left out of the lines, not drawn as zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STYLE = {"old": ("tab:red", "o"), "old_sharded": ("tab:orange", "s"), "new": ("tab:blue", "^")}
LABELS = {"old": "old approach: one file, every worker decodes it all",
          "old_sharded": "old approach, records sharded before the map",
          "new": "new approach: sharded files, parallel interleave + map"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _points(values: Mapping[str, Any], workers: Sequence[int]) -> tuple[list[int], list[float]]:
    pts = [(k, values.get(str(k))) for k in workers]
    pts = [(k, v) for k, v in pts if v is not None and math.isfinite(v)]
    return [k for k, _ in pts], [v for _, v in pts]


def _save(fig, ax, path: Path, title: str) -> Path:
    """Title, grid and legend as both plots have them, then the PNG."""
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_input_scaling(d: dict[str, Any], contenders: Sequence[str], workers: Sequence[int], path: Path,
                       title: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    try:
        for c in contenders:
            xs, ys = _points(d["samples_per_second"][c], workers)
            colour, marker = STYLE.get(c, ("tab:gray", "x"))
            ax.plot(xs, ys, marker=marker, color=colour, label=LABELS.get(c, c))
        xs, ys = _points(d["bounds"]["accelerator"], workers)
        ax.plot(xs, ys, "k--", linewidth=1, label="accelerator bound (K x batch / compute time)")
        ax.axhline(d["bounds"]["all_cores_decoding"], color="gray", linestyle=":", linewidth=1,
                   label="every core of the machine decoding")
        ax.set_xticks(list(workers))
        ax.set_xlabel("workers (processes, one simulated accelerator each)")
        ax.set_ylabel("samples/s, whole job")
        ax.set_ylim(bottom=0)
        return _save(fig, ax, path, title)
    finally:
        plt.close(fig)


def plot_allreduce_scaling(d: dict[str, Any], workers: Sequence[int], path: Path, title: str,
                           reference: Mapping[int, float], reference_label: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    try:
        top = max([*workers, *reference])
        ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal (linear)")
        xs, ys = _points(d["speedup"], workers)
        ax.plot(xs, ys, "o-", color="tab:blue", label="measured: CIFAR example, ResNet, allreduce (CPU cores)")
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2f}x", (x, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
        rx, ry = list(reference), list(reference.values())
        ax.plot(rx, ry, "s", color="tab:gray", markerfacecolor="none", markersize=8, label=reference_label)
        for x, y in zip(rx, ry, strict=True):
            ax.annotate(f"{y:.1f}x", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color="tab:gray")
        ax.set_xticks(sorted({*workers, *reference}))
        ax.set_xlabel("workers")
        ax.set_ylabel(f"speedup over {d['baseline_workers']} worker(s)")
        ax.set_xlim(0.5, top + 0.5)
        ax.set_ylim(0, top + 0.5)
        return _save(fig, ax, path, title)
    finally:
        plt.close(fig)


def plot_gpu_feeding(d: dict[str, Any], cores: Sequence[int], enough: float, path: Path, title: str) -> Path | None:
    """Per workload, each feeder's samples/s as a share of the device-only rate, against the input's cores."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    try:
        for workload, dw in d.items():
            for feeder, style in (("conveyor", "o-"), ("dataloader", "s--")):
                xs, ys = _points(dw[feeder]["of_ceiling"], cores)
                ax.plot(xs, ys, style, label=f"{workload}: {feeder} "
                        f"(ceiling {dw['ceiling_samples_per_second']:.0f} samples/s)")
        ax.axhline(enough, color="gray", linestyle=":", linewidth=1, label=f"{enough:.0%} of the ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(cores), [str(k) for k in cores])
        ax.set_xlabel("CPU cores for the input (and the training loop)")
        ax.set_ylabel("samples/s / the rate with the batch on the device")
        ax.set_ylim(0, 1.1)
        return _save(fig, ax, path, title)
    finally:
        plt.close(fig)
