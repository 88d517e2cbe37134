"""TensorFlow's own tf.data service as the contender of ``benchmarks/data_service.py`` (rows ``tf-kK``).

    python benchmarks/data_service_tf.py dispatcher --port P              # on the dispatcher's host
    python benchmarks/data_service_tf.py worker --dispatcher H:P --host IP --port Q
    python benchmarks/data_service_tf.py trainer JSON                     # the trainer's config, as conveyor's

Only when ``tensorflow`` imports in the benchmark's environment (``pip install tensorflow-cpu``; not a
conveyor dependency): ``skip_reason()`` says why not otherwise, and nothing here imports TensorFlow at load.
Same hosts, cores and links as conveyor's rows: the dispatcher (``DispatchServer``) unpinned on the dispatcher
host, workers (``WorkerServer``) pinned with ``taskset`` to worker I's core, the trainer pinned to its core
consuming ``dataset.apply(distribute(processing_mode="parallel_epochs", ...))`` (conveyor's rows use
``parallel_epochs`` over a repeated file list too) as fast as it can. The pipeline is the TF-op equivalent
of ``pipeline_workloads.chexnet_fn`` over the same TFRecord files: parse the Example, decode the 256² JPEG
(``INTEGER_ACCURATE``, PIL's ISLOW DCT), random 224 crop, random flip, /255, ImageNet mean/std, CHW float32,
batches of the same size. A Python function (``numpy_function``) cannot run on a tf.data service worker, so
TF runs its C++ kernels where conveyor runs PIL + numpy. Figures: images and bytes (images + labels) the
trainer took in the window after the warm-up, as conveyor's trainer counts them. Each role stops itself after
``--lifetime`` seconds (the benchmark kills the hosts' processes before that).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

TF_SKIP = "tensorflow is not importable here (pip install tensorflow-cpu in the benchmark's environment)"
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}  # quiet, and never look for a GPU
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
CROP = 224
LIFETIME_S = 3600.0


def skip_reason() -> str | None:
    """Why the tf.data service rows are skipped here, or None when tensorflow can be imported."""
    return None if importlib.util.find_spec("tensorflow") is not None else TF_SKIP


def chexnet_dataset(tf, files: Sequence[str], batch: int):
    """The chexnet-like pipeline in TF ops: what ``data_service.pipeline()`` does with conveyor."""
    features = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    mean, std = tf.constant(MEAN, tf.float32), tf.constant(STD, tf.float32)

    def chexnet(record):
        ex = tf.io.parse_single_example(record, features)
        img = tf.io.decode_jpeg(ex["image"], channels=3, dct_method="INTEGER_ACCURATE")
        img = tf.image.random_flip_left_right(tf.image.random_crop(img, (CROP, CROP, 3)))
        img = (tf.cast(img, tf.float32) / 255.0 - mean) / std
        return tf.transpose(img, (2, 0, 1)), ex["label"]

    return (tf.data.TFRecordDataset(list(files)).repeat().map(chexnet, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch).prefetch(tf.data.AUTOTUNE))


def _import_tf():
    os.environ.update(TF_ENV)
    import tensorflow as tf

    return tf


def _serve_until(server, lifetime: float) -> None:
    """Keep the process (and the server's threads) alive for ``lifetime`` seconds, then stop it."""
    deadline = time.monotonic() + lifetime
    while time.monotonic() < deadline:
        time.sleep(1.0)
    server.stop()


def dispatcher_role(port: int, lifetime: float) -> None:
    tf = _import_tf()
    service = tf.data.experimental.service
    server = service.DispatchServer(service.DispatcherConfig(port=port))
    print(f"tf.data dispatcher listening on port {port} ({server.target})", flush=True)
    _serve_until(server, lifetime)


def worker_role(dispatcher: str, host: str, port: int, lifetime: float) -> None:
    tf = _import_tf()
    service = tf.data.experimental.service
    # worker_address is what the dispatcher hands the trainer: this host's namespace address, not localhost.
    server = service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher, worker_address=f"{host}:{port}",
                                                       port=port))
    print(f"tf.data worker serving on {host}:{port}", flush=True)
    _serve_until(server, lifetime)


def consume(batches: Iterable[tuple[Any, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """Take (images, labels) numpy batches for ``warmup`` + ``seconds`` (sleeping ``sleep`` s after each, when
    given); the images and bytes (images + labels) of the window after the warm-up: both trainers' figures."""
    images = nbytes = 0
    t0 = time.perf_counter()
    start = t0 + config["warmup"]
    end = start + config["seconds"]
    first = None
    for images_batch, labels in batches:
        now = time.perf_counter()
        if first is None:
            first = now - t0
        if now >= start:
            images += len(images_batch)
            nbytes += images_batch.nbytes + labels.nbytes
        if now >= end:
            break
        if config.get("sleep"):
            time.sleep(config["sleep"])
    window = time.perf_counter() - start
    return {"images": images, "bytes": nbytes, "window_s": window, "first_element_s": first,
            "images_per_s": images / window, "bytes_per_s": nbytes / window}


def trainer_role(config: dict[str, Any]) -> None:
    """Consume for warmup + seconds from the service; print one JSON line as conveyor's trainer does."""
    tf = _import_tf()
    files = os.environ["DSBENCH_FILES"].split(os.pathsep)
    ds = chexnet_dataset(tf, files, int(os.environ["DSBENCH_BATCH"]))
    ds = ds.apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=f"grpc://{config['service']}",
        compression=None if config["compression"] == "none" else config["compression"]))
    # numpy arrays in the trainer's memory, as conveyor's trainer gets them
    figures = consume(((images.numpy(), labels.numpy()) for images, labels in ds), config)
    print(json.dumps({**figures, "compression": config["compression"], "tensorflow": tf.__version__}), flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    d = sub.add_parser("dispatcher")
    d.add_argument("--port", type=int, required=True)
    w = sub.add_parser("worker")
    w.add_argument("--dispatcher", required=True, help="HOST:PORT of the dispatcher")
    w.add_argument("--host", required=True, help="this host's address, the one the trainer reaches")
    w.add_argument("--port", type=int, required=True)
    for role in (d, w):
        role.add_argument("--lifetime", type=float, default=LIFETIME_S, help="seconds before the role stops itself")
    t = sub.add_parser("trainer")
    t.add_argument("config", help="JSON: service (HOST:PORT), warmup, seconds, compression")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "dispatcher":
        dispatcher_role(args.port, args.lifetime)
    elif args.role == "worker":
        worker_role(args.dispatcher, args.host, args.port, args.lifetime)
    else:
        trainer_role(json.loads(args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
