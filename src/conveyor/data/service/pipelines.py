"""Pipelines of the data service: built by name, compared by fingerprint, split by file.

    ds = load_pipeline("myjob.input:train_pipeline")        # imports myjob.input, calls train_pipeline()
    first_difference(fp_a, fp_b)                            # "op batch: argument batch_size is 32 here, 64 there"
    local = with_split_source(ds, next_split)               # the same pipeline, its files from next_split()

No code travels: every worker imports the same module and calls the function, which returns a
`Dataset`; the dispatcher compares the fingerprints (`Node.fingerprint()`: every op's name and
arguments) and the file lists. ``distributed_epoch`` needs exactly one file list in the pipeline's
recipe (``list_files`` or ``TFRecordDataset([...])``); the rewrite replaces it with a source that asks
for one file at a time, so everything above it (shuffle, interleave, map, batch) runs unchanged.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from conveyor import exiting
from conveyor.data.base import Node
from conveyor.data.pipeline import Dataset
from conveyor.data.service.protocol import DataServiceError, PipelineMismatchError
from conveyor.data.service.splits import SplitNode, file_lists


def load_pipeline(spec: str, flag: str = "--pipeline") -> Dataset:
    """Call ``module:function`` (no arguments) and return the `Dataset` it builds; ``flag`` names it in errors."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineMismatchError(f"{flag} {spec!r}: expected MODULE:FUNCTION, e.g. myjob.input:train_pipeline")
    exiting.user_code()  # a `conveyor` command (launcher, data worker) now holds the user's objects
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PipelineMismatchError(f"{flag} {spec}: cannot import {module_name} ({e}); run the "
                                    f"worker where the module is importable (the current folder, PYTHONPATH, or "
                                    f"pip install the job's package)") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PipelineMismatchError(f"{flag} {spec}: {module_name} ({getattr(module, '__file__', '?')}) has no "
                                    f"function {attr!r}; define it there (no arguments, returning a "
                                    f"conveyor.data.Dataset) or name the one that is")
    ds = fn()
    if not isinstance(ds, Dataset):
        raise PipelineMismatchError(f"{flag} {spec}: {attr}() returned {type(ds).__name__}, not a "
                                    f"conveyor.data.Dataset")
    return ds


def check_pipeline(spec: str, folders: Sequence[str], flag: str = "--data-pipeline") -> None:
    """Build ``spec`` here, importing from ``folders`` first as the data workers will (their working folder and the
    script's), so that a launcher refuses a name that does not resolve, or a function that fails, before anything
    starts. Raises :class:`DataServiceError` naming the fix."""
    saved = list(sys.path)
    sys.path[:0] = list(folders)
    try:
        load_pipeline(spec, flag=flag)
    except DataServiceError:
        raise
    except Exception as e:  # the user's function failed: every data worker would fail the same way
        raise PipelineMismatchError(f"{flag} {spec}: building it here failed ({type(e).__name__}: {e}); every data "
                                    f"worker would fail alike: fix the function or what it reads") from None
    finally:
        sys.path[:] = saved


def fingerprint(ds: Dataset) -> Any:
    """The pipeline's fingerprint as plain JSON data (what travels to the dispatcher)."""
    return json.loads(json.dumps(ds._node.fingerprint(), default=str))


def first_difference(a: Any, b: Any, path: str = "pipeline") -> str:
    """Where two fingerprints (``[name, params, inputs]`` trees) first differ, in words."""
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == 3 and len(b) == 3):
        return f"{path}: {json.dumps(a)[:200]} here, {json.dumps(b)[:200]} there"
    if a[0] != b[0]:
        return f"{path}: op {a[0]!r} here, {b[0]!r} there"
    where = f"{path} > {a[0]}"
    for key in sorted(set(a[1]) | set(b[1])):
        if a[1].get(key) != b[1].get(key):
            return f"op {a[0]} ({where}): argument {key} is {a[1].get(key)!r} here, {b[1].get(key)!r} there"
    if len(a[2]) != len(b[2]):
        return f"{where}: {len(a[2])} inputs here, {len(b[2])} there"
    for i, (x, y) in enumerate(zip(a[2], b[2], strict=True)):
        if x != y:
            return first_difference(x, y, where if len(a[2]) == 1 else f"{where}[{i}]")
    return f"{path}: no difference"


def with_split_source(ds: Dataset, next_split: Callable[[], str | None]) -> Dataset:
    """``ds`` with its file list replaced by the files ``next_split()`` returns until it returns None."""
    lists = file_lists(ds._node)
    if len(lists) != 1:
        raise DataServiceError(f"processing_mode='distributed_epoch' splits the pipeline's file list, and this "
                               f"pipeline has {len(lists)} (it needs exactly one: list_files or TFRecordDataset "
                               f"of a list); use processing_mode='parallel_epochs'")
    target = lists[0]

    def rewrite(node: Node) -> Node:
        if node is target:
            return SplitNode(next_split)
        inputs = tuple(rewrite(n) for n in node.inputs)
        return node if inputs == node.inputs else node.with_inputs(inputs)

    return Dataset(rewrite(ds._node))
