"""The optimizer on the parameter servers: torch's own, run over each server's pieces.

    spec = OptimizerSpec.from_optimizer(optimizer, model.named_parameters())   # worker, in job.prepare
    wire = spec.to_json()                                                      # -> every ps task
    opt = ServerOptimizer(OptimizerSpec.from_json(wire), {p: values for p, values in my_pieces})
    opt.apply({key: mean_of_gradients([g_worker0, g_worker1]) for key, ...})  # one synchronous step
    opt.update_hyperparameters(group_hyperparameters(optimizer))               # after a worker-side LR scheduler

Promises: the update is torch's own single-tensor implementation, bitwise the same as a single-process
run on a CPU worker however the parameters are cut into pieces; only elementwise optimizers on an
allow-list are accepted (subclasses refused too); :func:`mean_of_gradients` sums in rank order and
divides once, so a run is reproducible. Why this is exact: docs/ps.md, "Pieces and the
optimizer on the servers".
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.strategies.ps.sharding import Piece, parse_piece_key, piece_key

__all__ = ["SUPPORTED", "GroupSpec", "OptimizerSpec", "ServerOptimizer", "group_hyperparameters",
           "mean_of_gradients"]

#: Optimizers the servers can run, all elementwise (why: docs/ps.md, "Pieces and the optimizer
#: on the servers"). Their state is
#: per element (moments, buffers) plus a per-parameter step count.
SUPPORTED: tuple[str, ...] = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop")

# Group keys that choose *how* torch computes the update, not *what* it computes; the server sets
# its own (torch's single-tensor one, matching a CPU worker's default) and they are not part of the spec.
_IMPLEMENTATION = {"foreach": False, "fused": None, "capturable": False, "differentiable": False}
# Hyperparameters whose change mid-run would need state that does not exist (amsgrad's running
# maximum, centered RMSprop's gradient average): refused by update_hyperparameters.
_STRUCTURAL = ("amsgrad", "centered")

_SPEC_FORMAT = "conveyor.ps.optimizer"
_STATE_FORMAT = "conveyor.ps.server_optimizer"
_VERSION = 1


@dataclass(frozen=True)
class GroupSpec:
    """One param group: the names of its parameters, in the optimizer's order, and its hyperparameters."""

    params: tuple[str, ...]
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """What the servers need to rebuild the worker's optimizer: class name and settings. JSON-able.

    ``defaults`` are the constructor's hyperparameters (``optimizer.defaults``): torch reads some of
    them from there rather than from the groups (Adagrad's ``initial_accumulator_value``), so the
    servers construct the optimizer with them, exactly as the worker did.
    """

    name: str
    groups: tuple[GroupSpec, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer,
                       param_names: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> OptimizerSpec:
        """Describe ``optimizer`` (a fresh one) with its parameters named by ``param_names``.

        ``param_names`` is ``model.named_parameters()`` or a ``{name: tensor}`` dict; tensors are matched
        by identity. Refused: classes outside :data:`SUPPORTED` (and their subclasses), an optimizer that
        has already stepped, tensors that ``param_names`` does not name, and tensor-valued hyperparameters.
        """
        name = _check_class(optimizer)
        if _has_stepped(optimizer):
            raise ValueError(f"the {name} optimizer passed to job.prepare() has already taken steps: its state "
                             f"(momentum buffers, Adam moments) lives in this process, but with parameter servers "
                             f"the servers own the state and would start from zero, silently changing the run. "
                             f"Pass a freshly built optimizer; to resume, restore from a conveyor checkpoint, "
                             f"which carries the servers' optimizer state")
        items = param_names.items() if isinstance(param_names, Mapping) else param_names
        names = {id(t): n for n, t in items}
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            unnamed = sum(1 for p in group["params"] if id(p) not in names)
            if unnamed:
                raise ValueError(f"param group {index} of the optimizer holds {unnamed} tensor(s) that are not "
                                 f"parameters of the model: build the optimizer from this model, e.g. "
                                 f"torch.optim.{name}(model.parameters(), ...)")
            groups.append(GroupSpec(tuple(names[id(p)] for p in group["params"]),
                                    _hyperparameters_of(optimizer, group, index)))
        defaults = _hyperparameters_of(optimizer, optimizer.defaults, "defaults")
        return cls(name, tuple(groups), defaults)

    @property
    def param_names(self) -> list[str]:
        """Every parameter the optimizer updates, group by group."""
        return [n for g in self.groups for n in g.params]

    def to_dict(self) -> dict[str, Any]:
        return {"format": _SPEC_FORMAT, "version": _VERSION, "optimizer": self.name, "defaults": dict(self.defaults),
                "groups": [{"params": list(g.params), "hyperparameters": dict(g.hyperparameters)}
                           for g in self.groups]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> OptimizerSpec:
        if obj.get("format") != _SPEC_FORMAT or obj.get("version") != _VERSION:
            raise ValueError(f"not a conveyor optimizer spec of version {_VERSION}: format={obj.get('format')!r}, "
                             f"version={obj.get('version')!r}")
        name = obj.get("optimizer")
        if name not in SUPPORTED:
            raise ValueError(f"optimizer {name!r} cannot run on the parameter servers; supported: "
                             f"{', '.join(SUPPORTED)}")
        try:
            groups = tuple(GroupSpec(tuple(str(n) for n in g["params"]),
                                     {str(k): _json_value(v, k) for k, v in g["hyperparameters"].items()})
                           for g in obj["groups"])
            defaults = {str(k): _json_value(v, k) for k, v in obj["defaults"].items()}
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"malformed optimizer spec ({type(err).__name__}: {err})") from None
        names = [n for g in groups for n in g.params]
        if len(set(names)) != len(names):
            raise ValueError("malformed optimizer spec: a parameter is listed in more than one group")
        return cls(name, groups, defaults)

    @classmethod
    def from_json(cls, data: str | bytes) -> OptimizerSpec:
        return cls.from_dict(json.loads(data))


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's current hyperparameters as JSON-able dicts, as ``ServerOptimizer.update_hyperparameters`` takes.

    The worker sends this after its LR scheduler (or the user) changed a group. Only the optimizer's
    own hyperparameters are included, not keys a scheduler adds (``initial_lr``, ``max_lr``, ...).
    """
    _check_class(optimizer)
    return [_hyperparameters_of(optimizer, g, i) for i, g in enumerate(optimizer.param_groups)]


def mean_of_gradients(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The average of the workers' gradients for one piece, ``grads`` in rank order (docs/ps.md).

    ``(g_0 + g_1 + ... + g_{n-1}) / n``: summed left to right in float32 (float64 stays float64), divided
    once, returned in the gradients' dtype. Always a new tensor.
    """
    if not grads:
        raise ValueError("mean_of_gradients: no gradients (expected one per worker, in rank order)")
    dtype = grads[0].dtype
    if any(g.dtype != dtype or g.shape != grads[0].shape for g in grads):
        raise ValueError(f"mean_of_gradients: gradients differ in dtype or shape: "
                         f"{[(str(g.dtype), tuple(g.shape)) for g in grads]}")
    total = grads[0].to(torch.promote_types(dtype, torch.float32), copy=True)
    for g in grads[1:]:
        total.add_(g)
    return total.div_(len(grads)).to(dtype)


class ServerOptimizer:
    """One server's share of the optimizer: its pieces as leaf tensors under a real ``torch.optim.<name>``.

    ``pieces`` maps a :class:`Piece` (or its key, ``"fc.weight[0:4096]"``) to its initial values; they
    are copied, flattened, into tensors this object owns (:attr:`params`, by key). Pieces of parameters
    the optimizer does not update (frozen ones, left out of the worker's optimizer) are held but never
    changed, and gradients for them are ignored, as torch would. Each piece joins its parameter's
    param group, so per-group hyperparameters apply to pieces exactly as to whole tensors.
    """

    def __init__(self, spec: OptimizerSpec, pieces: Mapping[Piece | str, torch.Tensor]) -> None:
        if spec.name not in SUPPORTED:
            raise ValueError(f"optimizer {spec.name!r} cannot run on the parameter servers; supported: "
                             f"{', '.join(SUPPORTED)}")
        self.spec = spec
        where = {n: (gi, pi) for gi, g in enumerate(spec.groups) for pi, n in enumerate(g.params)}
        entries = []
        self.params: dict[str, torch.Tensor] = {}
        for key, value in pieces.items():
            param, start, stop = (key.param, key.start, key.stop) if isinstance(key, Piece) else parse_piece_key(key)
            name = piece_key(param, start, stop)
            if name in self.params:
                raise ValueError(f"piece {name} given twice")
            if not isinstance(value, torch.Tensor) or value.numel() != stop - start:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"piece {name} has {stop - start} elements; its values are {got}")
            if not value.is_floating_point():
                raise ValueError(f"piece {name} is {value.dtype}: only floating-point parameters can be optimized")
            self.params[name] = value.detach().reshape(-1).clone(memory_format=torch.contiguous_format)
            if param in where:
                entries.append((where[param], start, name))
        entries.sort()
        self._trained = {name for _, _, name in entries}
        self._cls = getattr(torch.optim, spec.name)
        accepted = inspect.signature(self._cls.__init__).parameters
        kwargs = {k: v for k, v in _from_json(spec.defaults).items() if k in accepted}
        kwargs.update((k, v) for k, v in _IMPLEMENTATION.items() if k in accepted)
        groups = [{"params": [self.params[n] for (gi, _), _, n in entries if gi == index],
                   **_from_json(g.hyperparameters)} for index, g in enumerate(spec.groups)]
        self._opt: torch.optim.Optimizer = self._cls(groups, **kwargs)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer underneath (read it; changing it directly bypasses the checks here)."""
        return self._opt

    def unshare(self, keys: Iterable[str] | None = None) -> None:
        """Give the pieces ``keys`` (None: all) new memory holding their values, leaving the old to whoever
        still reads it (a reply on its way out): copy on write. The optimizer's state stays attached."""
        for key in self.params if keys is None else keys:
            param = self.params.get(key)
            if param is not None:
                param.data = param.data.clone()

    # -- stepping ---------------------------------------------------------------------------------

    @torch.no_grad()
    def apply(self, grads: Mapping[Piece | str, torch.Tensor]) -> None:
        """One optimizer step with these (already averaged) gradients, keyed like ``pieces``.

        A piece without a gradient is skipped this step, as torch skips a parameter whose ``.grad`` is
        None. The gradient tensors are only read (torch's update does not modify them) and are not kept.
        """
        given = []
        try:
            for key, grad in grads.items():
                name = key.key if isinstance(key, Piece) else key
                param = self.params.get(name)
                if param is None:
                    raise KeyError(f"gradient for {name!r}, which this server does not hold "
                                   f"({len(self.params)} pieces); the worker and server placements disagree")
                if name not in self._trained:
                    continue
                if grad.numel() != param.numel() or grad.dtype != param.dtype:
                    raise ValueError(f"gradient for {name} is {grad.dtype} with {grad.numel()} elements; the "
                                     f"piece is {param.dtype} with {param.numel()}")
                param.grad = grad.reshape(-1)
                given.append(param)
            self._opt.step()
        finally:
            for param in given:
                param.grad = None

    # -- hyperparameters --------------------------------------------------------------------------

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each group's current hyperparameters, JSON-able (``betas`` as a list)."""
        return [{k: _json_value(group[k], k) for k in spec.hyperparameters}
                for spec, group in zip(self.spec.groups, self._opt.param_groups, strict=True)]

    def update_hyperparameters(self, groups: Sequence[Mapping[str, Any]]) -> None:
        """Set hyperparameters group by group, e.g. from :func:`group_hyperparameters` after a scheduler step.

        ``groups`` has one dict per group (partial dicts change only what they name). Refused before
        anything changes: a different number of groups, an unknown key, a value of the wrong kind, and
        changing ``amsgrad``/``centered``, whose state would not exist.
        """
        if len(groups) != len(self.spec.groups):
            raise ValueError(f"{len(groups)} group(s) of hyperparameters for an optimizer with "
                             f"{len(self.spec.groups)}; the worker's optimizer must keep its param groups")
        updates = [self._checked(index, changes) for index, changes in enumerate(groups)]
        for group, changes in zip(self._opt.param_groups, updates, strict=True):
            group.update(changes)

    def set_lr(self, group: int, lr: float) -> None:
        """Set the learning rate of param group ``group``."""
        if not isinstance(group, int) or not 0 <= group < len(self.spec.groups):
            raise ValueError(f"group = {group!r}; the optimizer has groups 0..{len(self.spec.groups) - 1}")
        changes: list[Mapping[str, Any]] = [{} for _ in self.spec.groups]
        changes[group] = {"lr": lr}
        self.update_hyperparameters(changes)

    def _checked(self, index: int, changes: Mapping[str, Any]) -> dict[str, Any]:
        current = self._opt.param_groups[index]
        known = self.spec.groups[index].hyperparameters
        out = {}
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"group {index}: {key!r} is not a hyperparameter of {self.spec.name} "
                                 f"(known: {', '.join(known)})")
            value = _from_json({key: _json_value(value, key)})[key]
            old = current[key]
            if not _same_kind(old, value):
                raise ValueError(f"group {index}: {key} = {value!r} is not of the kind of its current value {old!r}")
            if key in _STRUCTURAL and value != old:
                raise ValueError(f"group {index}: {key} cannot change during training ({old!r} -> {value!r}): "
                                 f"the optimizer state it needs does not exist")
            out[key] = value
        return out

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, meta)``: copies of the pieces' values and optimizer state, and JSON metadata.

        ``tensors`` (for safetensors) holds ``"param/<piece key>"`` and ``"state/<piece key>/<state name>"``
        (``exp_avg``, ``step``, ...); ``meta`` lists them, the spec and the current hyperparameters. No
        pickle anywhere. The tensors are copies, so a checkpoint written in the background is not
        changed by the steps that follow.
        """
        tensors = {f"param/{k}": v.clone() for k, v in self.params.items()}
        state: dict[str, Any] = {}
        for key, param in self.params.items():
            entry: dict[str, Any] = {"tensors": [], "values": {}}
            for name, value in self._opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{key}/{name}"] = value.clone()
                    entry["tensors"].append(name)
                else:
                    entry["values"][name] = _json_value(value, name)
            if entry["tensors"] or entry["values"]:
                state[key] = entry
        meta = {"format": _STATE_FORMAT, "version": _VERSION, "spec": self.spec.to_dict(),
                "hyperparameters": self.hyperparameters(), "pieces": list(self.params), "state": state}
        return tensors, meta

    @torch.no_grad()
    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; refuses a checkpoint of another optimizer or placement."""
        if meta.get("format") != _STATE_FORMAT or meta.get("version") != _VERSION:
            raise ValueError(f"not a conveyor server-optimizer state of version {_VERSION}: "
                             f"format={meta.get('format')!r}, version={meta.get('version')!r}")
        theirs = OptimizerSpec.from_dict(meta["spec"])
        if theirs.name != self.spec.name or [g.params for g in theirs.groups] != [g.params for g in self.spec.groups]:
            raise ValueError(f"the checkpoint is of a {theirs.name} optimizer over groups "
                             f"{[len(g.params) for g in theirs.groups]} (parameters per group); this server runs "
                             f"{self.spec.name} over {[len(g.params) for g in self.spec.groups]}")
        if sorted(meta["pieces"]) != sorted(self.params):
            extra = sorted(set(meta["pieces"]) - set(self.params))[:3]
            missing = sorted(set(self.params) - set(meta["pieces"]))[:3]
            raise ValueError(f"the checkpoint holds other pieces than this server (e.g. extra {extra}, missing "
                             f"{missing}): it was written with another placement (number of ps tasks or chunk size)")
        restored: dict[torch.Tensor, tuple[torch.Tensor, dict[str, Any]]] = {}
        for key, param in self.params.items():
            value = _tensor(tensors, f"param/{key}", param)
            entry = meta["state"].get(key, {"tensors": [], "values": {}})
            own: dict[str, Any] = dict(entry["values"])
            for name in entry["tensors"]:
                own[name] = _tensor(tensors, f"state/{key}/{name}", None).clone()
            restored[param] = (value, own)
        if len(meta["hyperparameters"]) != len(self.spec.groups):
            raise ValueError(f"the checkpoint has hyperparameters for {len(meta['hyperparameters'])} group(s); "
                             f"the optimizer has {len(self.spec.groups)}")
        hyper = [self._checked(i, g) for i, g in enumerate(meta["hyperparameters"])]
        # Everything is checked: now change the object.
        self._opt.state.clear()
        for param, (value, own) in restored.items():
            param.copy_(value)
            if own:
                self._opt.state[param] = own
        for group, changes in zip(self._opt.param_groups, hyper, strict=True):
            group.update(changes)


# -- helpers --------------------------------------------------------------------------------------


def _check_class(optimizer: Any) -> str:
    cls = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim optimizer, got {cls.__module__}.{cls.__qualname__}")
    if cls.__name__ in SUPPORTED and cls is getattr(torch.optim, cls.__name__):
        return cls.__name__
    base = next((b for b in cls.__mro__[1:] if b.__name__ in SUPPORTED and b is getattr(torch.optim, b.__name__)),
                None)
    what = (f"{cls.__qualname__}, a subclass of torch.optim.{base.__name__} that may change its update"
            if base is not None else f"{cls.__module__}.{cls.__qualname__}")
    raise ValueError(f"the parameter servers cannot run {what}: they apply the update themselves, piece by piece, "
                     f"which is exact only for the elementwise optimizers they know. Supported: torch.optim."
                     f"{', torch.optim.'.join(SUPPORTED)}; use one of them, or the 'allreduce' strategy, which runs "
                     f"any optimizer on the workers")


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    # Adagrad creates its state (step 0) in the constructor; any other state means steps were taken.
    for state in optimizer.state.values():
        step = state.get("step")
        if (step is not None and float(step) > 0) or (step is None and state):
            return True
    return False


def _hyperparameters_of(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], where: int | str) -> dict[str, Any]:
    keys = [k for k in optimizer.defaults if k not in _IMPLEMENTATION and k != "params"]
    try:
        return {k: _json_value(group[k], k) for k in keys}
    except ValueError as err:
        raise ValueError(f"{where if isinstance(where, str) else f'param group {where}'}: {err}") from None


def _json_value(value: Any, key: str) -> Any:
    if isinstance(value, torch.Tensor):
        raise ValueError(f"hyperparameter {key} is a Tensor; the parameter servers take plain numbers "
                         f"(e.g. lr={float(value)!r}, not torch.tensor(...))")
    if isinstance(value, (tuple, list)):
        return [_json_value(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"hyperparameter {key} = {value!r} ({type(value).__name__}) is not a number, bool or string")


def _from_json(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    # JSON has no tuples; torch stores betas as a tuple, and keeping its type keeps comparisons simple.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in hyperparameters.items()}


def _same_kind(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, (int, float)):
        return isinstance(new, (int, float))
    if isinstance(old, tuple):
        return isinstance(new, tuple) and len(new) == len(old) and all(map(_same_kind, old, new))
    return type(old) is type(new)


def _tensor(tensors: Mapping[str, torch.Tensor], key: str, like: torch.Tensor | None) -> torch.Tensor:
    value = tensors.get(key)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"the checkpoint has no tensor {key!r}")
    if like is not None and (value.dtype != like.dtype or value.numel() != like.numel()):
        raise ValueError(f"checkpoint tensor {key!r} is {value.dtype} with {value.numel()} elements; expected "
                         f"{like.dtype} with {like.numel()}")
    return value.reshape(-1) if like is not None else value
