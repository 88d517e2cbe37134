"""PyTorch glue: tensors out of a conveyor pipeline, copied to the accelerator one batch ahead.

The only module of `conveyor.data` that imports torch; the rest of the data layer runs without it.

    from conveyor.data.torch_adapter import to_torch
    it = to_torch(ds, device="cuda", pin_memory=True)     # ds: a conveyor Dataset, batched
    for images, labels in it:                             # torch tensors, already on the GPU
        ...
    state = it.state_dict()                               # resumable, like iter(ds)

`to_torch(ds)` is the recommended way in (no DataLoader needed); `as_torch_dataset(ds)` is an
`IterableDataset` for DataLoader-based code, which cannot resume. `to_tensors` converts without copying
numpy arrays and keeps the element's structure. When to use which, and the conversion rules:
`docs/data.md`, "PyTorch input".
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data

from conveyor.data.elements import from_json, to_json
from conveyor.data.errors import StateMismatchError
from conveyor.data.pipeline import Dataset

__all__ = ["TorchIterator", "as_torch_dataset", "to_tensors", "to_torch"]

STATE_FORMAT = "conveyor.data.torch_adapter"
STATE_VERSION = 1
_ITERATOR_FORMAT = "conveyor.data.iterator"


# ------------------------------------------------------------------------------ conversion


def to_tensors(x: Any) -> Any:
    """Convert an element to torch tensors, keeping its structure (see the module docstring)."""
    if isinstance(x, np.ndarray):
        if x.dtype == object or x.dtype.kind in "SU":
            return x.tolist()
        return _from_numpy(x)
    if isinstance(x, (bytes, str)) or x is None:  # also np.bytes_ / np.str_
        return x
    if isinstance(x, np.generic):
        return _from_numpy(np.asarray(x))
    if isinstance(x, bool):
        return torch.tensor(x, dtype=torch.bool)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    if isinstance(x, float):
        return torch.tensor(x, dtype=torch.float64)
    if isinstance(x, tuple):
        return tuple(to_tensors(v) for v in x)
    if isinstance(x, list):
        return [to_tensors(v) for v in x]
    if isinstance(x, dict):
        return {k: to_tensors(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"cannot convert an element of type {type(x).__name__} to torch tensors")


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    # torch.from_numpy shares memory. It refuses negative strides (a flipped view) and foreign byte
    # order, and would share a read-only buffer that a tensor could then write into: copy those.
    if not arr.flags.writeable or any(s < 0 for s in arr.strides):
        arr = np.array(arr)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(arr)
    except TypeError as e:
        raise TypeError(f"cannot convert a numpy array of dtype {arr.dtype} to a torch tensor: {e}") from None


def _map_tensors(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_map_tensors(fn, v) for v in x)
    if isinstance(x, list):
        return [_map_tensors(fn, v) for v in x]
    if isinstance(x, dict):
        return {k: _map_tensors(fn, v) for k, v in x.items()}
    return x


# ------------------------------------------------------------------------------ to_torch


@dataclass
class _Staged:
    """A batch whose copy to the device has been started: the numpy element (for the state),
    the device tensors, and the event that marks the end of the copy (CUDA only)."""

    raw: Any
    tensors: Any
    event: Any = None


class TorchIterator:
    """What `to_torch` returns: an iterator of tensor elements with `state_dict`/`stats`/`close`.

    On an accelerator it holds one batch ahead. That batch has left the pipeline but not reached
    the caller, so `state_dict()` carries it (as its numpy element) next to the pipeline's state,
    and a restored iterator hands it out first: resuming loses and repeats nothing. (Taking the
    pipeline's state before every look-ahead would also be exact, but costs a full state — shuffle
    and prefetch buffers included — per batch; carrying one batch costs only at checkpoint time.)
    """

    def __init__(self, source: Iterator, device: str | torch.device | None = None,
                 pin_memory: bool = False, non_blocking: bool = True):
        self._source = source
        self._device = None if device is None else torch.device(device)
        self._non_blocking = bool(non_blocking)
        self._pin = bool(pin_memory)
        if self._pin and not torch.cuda.is_available():
            warnings.warn("to_torch(pin_memory=True) but CUDA is not available; batches are not pinned",
                          stacklevel=3)
            self._pin = False
        self._lookahead = self._device is not None and self._device.type != "cpu"
        self._stream = None
        if self._lookahead and self._device.type == "cuda":
            self._stream = torch.cuda.Stream(self._device)
        self._pending: deque = deque()  # restored elements, handed out before the source's
        self._ahead: _Staged | None = None
        self._error: BaseException | None = None  # raised by the look-ahead, re-raised in turn
        self._source_done = False
        self._elements = 0

    def __iter__(self) -> TorchIterator:
        return self

    def __next__(self) -> Any:
        if not self._lookahead:
            out = self._convert(self._next_raw())
            self._elements += 1
            return out
        if self._ahead is None:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._ahead = self._stage(self._next_raw())
        current, self._ahead = self._ahead, None
        try:
            self._ahead = self._stage(self._next_raw())  # batch N+1 copies while N is in use
        except StopIteration:
            pass
        except Exception as e:  # hand out batch N first; the failure belongs to N+1
            self._error = e
        self._elements += 1
        return self._finish(current)

    def _next_raw(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        if self._source_done:
            raise StopIteration
        try:
            return next(self._source)
        except StopIteration:
            self._source_done = True
            raise

    def _convert(self, raw: Any) -> Any:
        out = to_tensors(raw)
        if self._pin:
            out = _map_tensors(lambda t: t.pin_memory(), out)
        return out

    def _stage(self, raw: Any) -> _Staged:
        tensors = self._convert(raw)
        device, nb = self._device, self._non_blocking
        if self._stream is None:
            return _Staged(raw, _map_tensors(lambda t: t.to(device, non_blocking=nb), tensors))
        with torch.cuda.stream(self._stream):
            moved = _map_tensors(lambda t: t.to(device, non_blocking=nb), tensors)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Staged(raw, moved, event)

    def _finish(self, staged: _Staged) -> Any:
        if staged.event is None:
            return staged.tensors
        current = torch.cuda.current_stream(self._device)
        current.wait_event(staged.event)  # this batch's copy only, not the one started after it
        # The tensors were allocated on the side stream: tell the allocator they are used on this one.
        _map_tensors(lambda t: t.record_stream(current), staged.tensors)
        return staged.tensors

    # ---- state

    def state_dict(self) -> dict[str, Any]:
        """The pipeline's state plus the elements taken from it but not yet handed out (JSON-able)."""
        if not hasattr(self._source, "state_dict"):
            raise TypeError(
                f"to_torch over a {type(self._source).__name__} cannot save its position; pass a conveyor "
                f"Dataset or the iterator iter(dataset) returns"
            )
        held = ([self._ahead.raw] if self._ahead is not None else []) + list(self._pending)
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "iterator": self._source.state_dict(),
                "pending": [to_json(x) for x in held]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` output (or from a plain `iter(ds).state_dict()`)."""
        if not isinstance(state, dict):
            raise StateMismatchError("not a to_torch iterator state (expected a dict)")
        if state.get("format") == _ITERATOR_FORMAT:
            inner, pending = state, []
        elif state.get("format") == STATE_FORMAT:
            if state.get("version") != STATE_VERSION:
                raise StateMismatchError(
                    f"to_torch state has version {state.get('version')}, this conveyor reads version "
                    f"{STATE_VERSION}; resume with the conveyor release that saved it"
                )
            inner, pending = state["iterator"], [from_json(x) for x in state["pending"]]
        else:
            raise StateMismatchError("not a to_torch iterator state (missing format marker)")
        if not hasattr(self._source, "load_state_dict"):
            raise TypeError(f"to_torch over a {type(self._source).__name__} cannot be restored")
        self._source.load_state_dict(inner)
        self._ahead = None
        self._error = None
        self._pending = deque(pending)
        self._source_done = False

    # ---- statistics and lifetime

    def stats(self) -> dict[str, Any]:
        """The pipeline's statistics (`DatasetIterator.stats()`), plus this adapter's counters."""
        out = dict(self._source.stats()) if hasattr(self._source, "stats") else {}
        out["to_torch"] = {"elements": self._elements, "device": str(self._device or "cpu"),
                           "lookahead": self._lookahead, "pinned": self._pin}
        return out

    def close(self) -> None:
        self._ahead = None
        self._pending.clear()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> TorchIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def to_torch(ds_or_iter: Dataset | Iterable, device: str | torch.device | None = None,
             pin_memory: bool = False, non_blocking: bool = True) -> TorchIterator:
    """Iterate a conveyor Dataset (or an iterator over elements) as torch tensors.

    `device=None` or "cpu": elements are converted (no copies for numpy arrays) and nothing runs
    ahead. Another device: each batch is copied with `.to(device, non_blocking=...)` one batch
    ahead; on CUDA the copy runs on a side stream, so it overlaps the model's work, and the
    tensors are handed to the caller's stream with `record_stream`. `pin_memory=True` pins each
    batch first (needed for a truly asynchronous host-to-GPU copy; ignored, with a warning,
    without CUDA). The result has `state_dict()`/`load_state_dict()` (when the source is a
    `Dataset` or its iterator), `stats()` and `close()`.
    """
    return TorchIterator(iter(ds_or_iter), device, pin_memory, non_blocking)


# ------------------------------------------------------------------------------ as_torch_dataset


class ConveyorIterableDataset(torch.utils.data.IterableDataset):
    """A conveyor pipeline as a torch `IterableDataset` (see `as_torch_dataset`)."""

    def __init__(self, ds: Dataset | Callable[[int, int], Dataset]):
        super().__init__()
        if isinstance(ds, Dataset):
            self._dataset: Dataset | None = ds
            self._factory = None
            # Every DataLoader worker runs the whole pipeline and keeps its share of the elements,
            # which only partitions the stream if all workers see the *same* stream: fix the root
            # seed (which unseeded random ops derive from) here, before the workers copy the dataset.
            self._root_seed = ds.root_seed
        elif callable(ds):
            self._dataset, self._factory, self._root_seed = None, ds, None
        else:
            raise TypeError(
                f"as_torch_dataset takes a conveyor Dataset or a function (worker_id, num_workers) -> "
                f"Dataset, got {type(ds).__name__}"
            )
        self._epochs = 0  # counted in each worker's copy: with persistent workers, one per epoch

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self._factory is not None:
            ds = self._factory(worker, workers)
            if not isinstance(ds, Dataset):
                raise TypeError(f"as_torch_dataset's function returned {type(ds).__name__}, not a Dataset")
            it = iter(ds)
        elif info is None:
            it = iter(self._dataset)
        else:
            ds = self._dataset.shard(workers, worker) if workers > 1 else self._dataset
            # All workers of one DataLoader share `info.seed - info.id` (DataLoader's base seed, new
            # each epoch unless workers persist, when the epoch counter moves instead): use it as the
            # iteration number, so reshuffling ops reshuffle every epoch, identically in every worker.
            it = ds.iterator(self._root_seed, (info.seed - info.id + self._epochs) % 2**31)
            self._epochs += 1
        try:
            for x in it:
                yield to_tensors(x)
        finally:
            it.close()


def as_torch_dataset(ds: Dataset | Callable[[int, int], Dataset]) -> ConveyorIterableDataset:
    """Wrap a conveyor pipeline as a `torch.utils.data.IterableDataset` whose elements are tensors.

        loader = DataLoader(as_torch_dataset(ds.batch(64)), batch_size=None, num_workers=2)

    Sharding across DataLoader workers is, in general, the user's job, done with `Dataset.shard`
    on the *file names* so that each worker reads only its files. Pass a function to do that:
    `as_torch_dataset(lambda worker, n: make_pipeline(files.shard(n, worker)))` is called once per
    worker (with `(0, 1)` when there are no workers) and must return that worker's Dataset.

    Given a Dataset, with `num_workers > 0` the elements are sharded automatically by worker id
    (`torch.utils.data.get_worker_info()`): worker i of n yields elements i, i+n, i+2n, ... of the
    stream, so nothing is duplicated or lost — correct, but every worker runs the whole pipeline
    (reads, parses and maps every record) to keep 1/n of it; fine for cheap pipelines, wasteful
    for heavy ones. Unseeded random ops get one seed shared by all workers, and reshuffle each
    epoch from DataLoader's base seed (so `torch.manual_seed` makes the order reproducible).

    Batch in the pipeline and pass `batch_size=None` to the DataLoader, or let the DataLoader
    collate single elements. For resumable iteration use `to_torch` instead.
    """
    return ConveyorIterableDataset(ds)
