"""Checkpoint-sized data state: the iterator state of a shuffle(10_000) over JPEG TFRecords, saved as
element bytes (today's approach) against saved as provenances (file + record offset, re-read on restore).

    python benchmarks/data_state.py                     # 24,000 64x64 JPEGs in 8 shards, 5 rounds
    python benchmarks/data_state.py --quick             # 1,200 32x32 JPEGs, shuffle(500), 1 round

Pipeline (the issue's): list_files -> shuffle(16) -> interleave(TFRecordDataset, cycle_length=4,
num_parallel_calls=AUTOTUNE) -> shuffle(BUFFER) -> map(parse + JPEG decode) -> batch(32). Each round,
for each contender (`provenance.enabled` False = "elements", True = "provenance"), in interleaved
order: take a few batches, then measure the state's JSON size, `state_dict()` time, and
`load_state_dict()` + first `next()` time on a fresh iterator (whose batch must equal the original's
next one). Also the throughput (records/s) of list_files -> interleave -> shuffle -> batch without
map, which is where tracking provenances costs something.

Writes ``<out>/data_state-<timestamp>.json`` and ``data_state-latest.json`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conveyor.data.provenance as provenance  # noqa: E402
import harness as h  # noqa: E402
from conveyor.data import AUTOTUNE, Dataset, FixedLenFeature, TFRecordDataset, parse_single_example  # noqa: E402
from conveyor.data.convert import convert_arrays  # noqa: E402

CONTENDERS_SPEC = (
    h.Contender("elements", "today: the shuffle buffer saved as element bytes (provenance.enabled = False)"),
    h.Contender("provenance", "the buffer saved as [file, record offset] references, re-read on restore"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)
GOALS = (
    h.Goal("provenance state < 200 KB (JSON bytes) with shuffle(10_000) over JPEG records", "provenance_state_bytes",
           200_000, "<="),
    h.Goal("provenance throughput >= 0.95 x elements (list_files -> interleave -> shuffle -> batch)",
           "throughput_ratio", 0.95),
)
FEATURES = {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64")}
BATCH = 32


def parse(record: bytes) -> tuple[np.ndarray, np.int64]:
    ex = parse_single_example(record, FEATURES)
    return np.asarray(Image.open(io.BytesIO(ex["image"])).convert("RGB")), np.int64(ex["label"])


def write_data(folder: Path, records: int, size: int, shards: int) -> int:
    """JPEG shards of smooth gradients plus noise (about the size of real photos per pixel); total bytes."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    base = (ramp[:, None, None] * rng.uniform(50, 200, (records, 1, 1, 1, 3)).astype(np.float32))[:, 0]
    images = np.clip(base + ramp[None, :, None] * 40 + rng.normal(0, 12, (records, size, size, 3)), 0, 255)
    labels = rng.integers(0, 10, size=records)
    convert_arrays({"image": images.astype(np.uint8), "label": labels}, folder, shards, image_keys=("image",),
                   image_format="jpeg", quality=90, progress=False, source="data_state")
    return sum(p.stat().st_size for p in folder.rglob("*.tfrecord"))


def pipeline(folder: Path, buffer: int, with_map: bool = True) -> Dataset:
    ds = (Dataset.list_files(str(folder / "*.tfrecord"), shuffle=False).shuffle(16, seed=0)
          .interleave(TFRecordDataset, cycle_length=4, num_parallel_calls=AUTOTUNE)
          .shuffle(buffer, seed=0))
    return (ds.map(parse) if with_map else ds).batch(BATCH)


def _same(a: Any, b: Any) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def measure_state(folder: Path, buffer: int, batches: int) -> dict[str, Any]:
    ds = pipeline(folder, buffer)
    it = iter(ds)
    for _ in range(batches):
        next(it)
    t0 = time.perf_counter()
    state = it.state_dict()
    save_s = time.perf_counter() - t0
    text = json.dumps(state)
    expected = next(it)
    it.close()
    fresh = iter(ds)
    t0 = time.perf_counter()
    fresh.load_state_dict(json.loads(text))
    got = next(fresh)
    restore_s = time.perf_counter() - t0
    fresh.close()
    return {"state_bytes": len(text), "state_dict_s": save_s, "restore_first_next_s": restore_s,
            "resumed_batch_equal": _same(expected, got)}


def measure_throughput(folder: Path, buffer: int, records: int) -> float:
    it = iter(pipeline(folder, buffer, with_map=False))
    n = 0
    t0 = time.perf_counter()
    for batch in it:
        n += len(batch)
        if n >= records:
            break
    rate = n / (time.perf_counter() - t0)
    it.close()
    return rate


def run_rounds(folder: Path, settings: dict[str, Any], repeats: int) -> dict[str, Any]:
    def measure(c: str, rnd: int) -> tuple[float, dict[str, Any]]:
        provenance.enabled = c == "provenance"
        try:
            run = measure_state(folder, settings["buffer"], settings["batches"])
            run["records_per_s"] = measure_throughput(folder, settings["buffer"], settings["throughput_records"])
        except Exception as e:  # a failure is data, not a crash
            raise h.ContenderFailed(f"{type(e).__name__}: {e}") from e
        finally:
            provenance.enabled = True
        return run["state_bytes"], run

    return h.interleaved_rounds(CONTENDERS, repeats, measure,
                                describe=lambda v, run: f"{v / 1e3:.1f} KB, save {run['state_dict_s'] * 1e3:.1f} ms, "
                                                        f"restore {run['restore_first_next_s'] * 1e3:.1f} ms, "
                                                        f"{run['records_per_s']:.0f} rec/s")


KEYS = ("state_bytes", "state_dict_s", "restore_first_next_s", "records_per_s")


def derive(res: dict[str, Any]) -> dict[str, Any]:
    runs = {c: [r for r in res["runs"][c] if r and "error" not in r] for c in CONTENDERS}
    med = {k: {c: h.median(r[k] for r in runs[c]) for c in CONTENDERS} for k in KEYS}
    return {
        "median": med,
        "provenance_state_bytes": med["state_bytes"]["provenance"],
        "state_size_ratio": h.ratio(med["state_bytes"]["elements"], med["state_bytes"]["provenance"]),
        "throughput_ratio": h.ratio(med["records_per_s"]["provenance"], med["records_per_s"]["elements"]),
        "throughput_paired": h.paired([r["records_per_s"] for r in runs["provenance"]],
                                      [r["records_per_s"] for r in runs["elements"]]),
        "resumed_exactly": all(r["resumed_batch_equal"] for c in CONTENDERS for r in runs[c]) and all(runs.values()),
    }


def format_table(d: dict[str, Any], settings: dict[str, Any], repeats: int) -> str:
    m = d["median"]
    head = (f"{settings['records']} {settings['image_size']}x{settings['image_size']} JPEG records "
            f"({settings['data_bytes'] / 1e6:.1f} MB) in {settings['shards']} shards, shuffle({settings['buffer']}), "
            f"state after {settings['batches']} batches of {BATCH}; medians of {repeats} round(s)")
    rows = [("contender", "state KB", "state_dict() ms", "load + first next() ms", "records/s (no map)")]
    for c in CONTENDERS:
        rows.append((c, h.fmt(m["state_bytes"][c], ".1f", 1e-3), h.fmt(m["state_dict_s"][c], ".1f", 1e3),
                     h.fmt(m["restore_first_next_s"][c], ".1f", 1e3), h.fmt(m["records_per_s"][c], ".0f")))
    return "\n".join([head, "", h.format_rows(rows), "",
                      f"state size elements / provenance: {h.fmt(d['state_size_ratio'], '.1f')}x",
                      f"throughput provenance / elements: {h.fmt(d['throughput_ratio'], '.3f')} (paired per round: "
                      f"{h.fmt_all(d['throughput_paired'], '.3f')})",
                      f"resumed batch equals the uninterrupted one: {d['resumed_exactly']}"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__, "1,200 32x32 JPEGs in 4 shards, shuffle(500), 1 round")
    p.add_argument("--records", type=int, default=None, help="JPEG records (default 24000; --quick 1200)")
    p.add_argument("--image-size", type=int, default=None, help="image side in pixels (default 64; --quick 32)")
    p.add_argument("--shards", type=int, default=None, help="TFRecord shards (default 8; --quick 4)")
    p.add_argument("--buffer", type=int, default=None, help="shuffle buffer (default 10000; --quick 500)")
    p.add_argument("--batches", type=int, default=3, help="batches taken before the state is saved (default 3)")
    p.add_argument("--throughput-records", type=int, default=None,
                   help="records timed for throughput (default 20000; --quick 1000)")
    return h.settle(p, p.parse_args(argv), {"records": (24_000, 1_200), "image_size": (64, 32), "shards": (8, 4),
                                            "buffer": (10_000, 500), "repeats": (5, 1),
                                            "throughput_records": (20_000, 1_000)},
                    positive=("records", "image_size", "shards", "buffer", "batches", "repeats",
                              "throughput_records"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    machine = h.machine_start(("numpy", "Pillow"))
    with tempfile.TemporaryDirectory(prefix="conveyor-data-state-") as tmp:
        folder = Path(tmp)
        data_bytes = write_data(folder, args.records, args.image_size, args.shards)
        settings = {"records": args.records, "image_size": args.image_size, "shards": args.shards,
                    "buffer": args.buffer, "batches": args.batches, "throughput_records": args.throughput_records,
                    "data_bytes": data_bytes}
        print(f"{args.records} JPEG records ({data_bytes / 1e6:.1f} MB), shuffle({args.buffer}), "
              f"{args.repeats} round(s), {machine['cores']} cores")
        res = run_rounds(folder, settings, args.repeats)
    d = derive(res)
    gs = h.evaluate_goals(GOALS, d)
    report = {"benchmark": "data_state", "command": h.command_line("data_state", argv),
              "machine": h.machine_end(machine),
              "config": {**settings, "repeats": args.repeats, "quick": args.quick, "batch": BATCH,
                         "order": res["order"], "contenders": {c.name: c.label for c in CONTENDERS_SPEC}}}
    h.publish_run("data_state", report, res, d, gs, format_table(d, settings, args.repeats), started,
                  h.format_goals(gs), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
