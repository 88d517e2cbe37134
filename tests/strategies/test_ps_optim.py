"""The servers' optimizer against torch.optim in one process: same parameters, bit for bit.

A small model (embedding + two linear layers) trains STEPS steps with a torch optimizer (the reference).
The "parameter-server" run trains an identical copy whose values always come from ServerOptimizers
over a Placement with a tiny chunk size, so most tensors are split across servers; each step the
copy's gradients are split into pieces and applied on the servers. The parameters must end equal.

    pytest tests/strategies/test_ps_optim.py --durations=5
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import safetensors.torch
import torch
from torch import nn

from conveyor.strategies.ps.optim import (
    OptimizerSpec,
    ServerOptimizer,
    group_hyperparameters,
    mean_of_gradients,
)
from conveyor.strategies.ps.sharding import place

STEPS = 10
BATCH = 8
CHUNK = 96  # bytes: 24 float32 elements, so every weight matrix is split


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(idx).mean(1))))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 20, (BATCH, 4), generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def two_groups(model: Net, **second) -> list[dict]:
    """The embedding and fc1 in one group at the optimizer's lr; fc2 in a second with its own settings."""
    first = [*model.emb.parameters(), *model.fc1.parameters()]
    return [{"params": first}, {"params": list(model.fc2.parameters()), **second}]


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "sgd-dampening-wd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.8, dampening=0.3,
                                                  weight_decay=0.01),
    "sgd-maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.5, maximize=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam-amsgrad-wd": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.01, amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)),
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True, eps=1e-6),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9, centered=True),
    "sgd-two-groups": lambda m: torch.optim.SGD(two_groups(m, lr=0.3, momentum=0.5), lr=0.1, momentum=0.9),
    "adam-two-groups": lambda m: torch.optim.Adam(two_groups(m, lr=0.002, betas=(0.5, 0.9)), lr=0.01),
}


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def reference(make_opt, scheduler=None) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = make_opt(model)
    sched = scheduler(opt) if scheduler else None
    for x, y in batches():
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        if sched:
            sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class PsRun:
    """A worker model whose parameters live on ServerOptimizers, as the ps strategy will arrange it."""

    def __init__(self, make_opt, servers: int, chunk: int = CHUNK, scheduler=None) -> None:
        self.model = make_model()
        self.worker_opt = make_opt(self.model)  # never steps: it describes the optimizer, as in job.prepare
        self.scheduler = scheduler(self.worker_opt) if scheduler else None
        spec = OptimizerSpec.from_json(OptimizerSpec.from_optimizer(self.worker_opt, self.model.named_parameters())
                                       .to_json())  # through JSON, as it travels
        self.placement = place([(n, p.shape, p.dtype) for n, p in self.model.named_parameters()], servers, chunk)
        self.servers = [ServerOptimizer(spec, {piece: self._values(piece) for piece in self.placement.pieces_for(s)})
                        for s in range(servers)]

    def _values(self, piece):
        return dict(self.placement.split(piece.param, self.model.get_parameter(piece.param).detach()))[piece]

    def pull(self) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                pieces = self.placement.pieces_of(name)
                param.copy_(self.placement.join(name, {p: self.servers[p.server].params[p.key] for p in pieces})
                            .view_as(param))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pull()
        self.model.zero_grad()
        loss_of(self.model, x, y).backward()
        grads: list[dict] = [{} for _ in self.servers]
        for name, param in self.model.named_parameters():
            for piece, view in self.placement.split(name, param.grad):
                grads[piece.server][piece.key] = view
        sent = [{k: v.clone() for k, v in own.items()} for own in grads]
        for server, own in zip(self.servers, grads, strict=True):
            server.apply(own)
        for own, copies in zip(grads, sent, strict=True):  # the servers only read the gradients
            assert all(torch.equal(own[k], copies[k]) for k in own)
        if self.scheduler:
            with warnings.catch_warnings():  # the worker's optimizer never steps itself: torch warns about order
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            for server in self.servers:
                server.update_hyperparameters(group_hyperparameters(self.worker_opt))

    def params(self) -> dict[str, torch.Tensor]:
        self.pull()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: max diff {(a[name] - b[name]).abs().max().item():.3g}"


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny; on a busy 2-core machine extra intra-op threads only wait for each other (10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- parity -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("servers", [2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_parameters_as_torch_optim_in_one_process(name, servers):
    run = PsRun(OPTIMIZERS[name], servers)
    assert any(len(run.placement.pieces_of(n)) > 1 for n, _ in run.model.named_parameters())  # splits happen
    for x, y in batches():
        run.step(x, y)
    final = run.params()
    assert_same(final, reference(OPTIMIZERS[name]))
    assert not torch.equal(final["fc1.weight"], make_model().fc1.weight.detach())  # it did train


@pytest.mark.parametrize("name", ["sgd-momentum", "adam-amsgrad-wd", "adam-two-groups", "rmsprop", "adagrad"])
def test_state_dict_round_trip_mid_run_continues_identically(name):
    run = PsRun(OPTIMIZERS[name], 3)
    data = batches()
    for x, y in data[:5]:
        run.step(x, y)
    saved = []
    for server in run.servers:  # through safetensors bytes and JSON text, as a checkpoint stores them
        tensors, meta = server.state_dict()
        saved.append((safetensors.torch.save(tensors), json.dumps(meta)))
        assert all(k.startswith(("param/", "state/")) for k in tensors)

    fresh = PsRun(OPTIMIZERS[name], 3)  # new servers, empty state, and values that must be overwritten
    for server, (blob, meta) in zip(fresh.servers, saved, strict=True):
        for value in server.params.values():
            value.fill_(7.0)
        server.load_state_dict(safetensors.torch.load(blob), json.loads(meta))
    for x, y in data[5:]:
        fresh.step(x, y)
    assert_same(fresh.params(), reference(OPTIMIZERS[name]))


def test_state_dict_is_a_copy_and_refuses_another_placement():
    run = PsRun(OPTIMIZERS["adam"], 2)
    run.step(*batches()[0])
    tensors, meta = run.servers[0].state_dict()
    before = {k: v.clone() for k, v in tensors.items()}
    run.step(*batches()[1])
    assert all(torch.equal(before[k], tensors[k]) for k in tensors)  # later steps do not reach the checkpoint
    other = PsRun(OPTIMIZERS["adam"], 3)
    with pytest.raises(ValueError, match="another placement"):
        other.servers[0].load_state_dict(tensors, meta)
    sgd = PsRun(OPTIMIZERS["sgd"], 2)
    with pytest.raises(ValueError, match="checkpoint is of a Adam optimizer"):
        sgd.servers[0].load_state_dict(tensors, meta)
    with pytest.raises(ValueError, match="no tensor"):
        run.servers[0].load_state_dict({k: v for k, v in tensors.items() if "exp_avg_sq" not in k}, meta)


# -- hyperparameters ----------------------------------------------------------------------------------------------


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def one_cycle(opt):  # changes lr *and* the betas / momentum every step
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)


@pytest.mark.parametrize(("name", "scheduler"), [("sgd-two-groups", step_lr), ("adam-two-groups", step_lr),
                                                 ("adam", one_cycle), ("sgd-nesterov", one_cycle)])
def test_worker_side_scheduler_changes_propagate(name, scheduler):
    run = PsRun(OPTIMIZERS[name], 2, scheduler=scheduler)
    for x, y in batches():
        run.step(x, y)
    assert_same(run.params(), reference(OPTIMIZERS[name], scheduler))
    assert run.servers[0].hyperparameters() == group_hyperparameters(run.worker_opt)


def test_set_lr_and_hyperparameters():
    run = PsRun(OPTIMIZERS["adam-two-groups"], 2)
    server = run.servers[0]
    assert [g["lr"] for g in server.hyperparameters()] == [0.01, 0.002]
    assert server.hyperparameters()[1]["betas"] == [0.5, 0.9]
    server.set_lr(1, 0.5)
    assert [g["lr"] for g in server.hyperparameters()] == [0.01, 0.5]
    assert server.optimizer.param_groups[1]["lr"] == 0.5
    server.update_hyperparameters([{"betas": [0.7, 0.95]}, {}])
    assert server.optimizer.param_groups[0]["betas"] == (0.7, 0.95)
    assert json.loads(json.dumps(server.hyperparameters())) == server.hyperparameters()
    with pytest.raises(ValueError, match="1 group"):
        server.update_hyperparameters([{"lr": 0.1}])
    with pytest.raises(ValueError, match="'initial_lr' is not a hyperparameter of Adam"):
        server.update_hyperparameters([{"initial_lr": 0.1}, {}])
    with pytest.raises(ValueError, match="amsgrad cannot change"):
        server.update_hyperparameters([{"amsgrad": True}, {}])
    with pytest.raises(ValueError, match="not of the kind"):
        server.update_hyperparameters([{"lr": "fast"}, {}])
    with pytest.raises(ValueError, match="groups 0..1"):
        server.set_lr(2, 0.1)
    assert [g["lr"] for g in server.hyperparameters()] == [0.01, 0.5]  # refused updates changed nothing


def test_spec_json_round_trip_and_contents():
    model = make_model()
    opt = OPTIMIZERS["adam-two-groups"](model)
    spec = OptimizerSpec.from_optimizer(opt, dict(model.named_parameters()))
    assert spec.name == "Adam"
    assert [g.params for g in spec.groups] == [("emb.weight", "fc1.weight", "fc1.bias"), ("fc2.weight", "fc2.bias")]
    hp = spec.groups[1].hyperparameters
    assert hp["lr"] == 0.002 and hp["betas"] == [0.5, 0.9] and hp["amsgrad"] is False
    assert not {"foreach", "fused", "capturable", "differentiable"} & set(hp)  # the server picks the implementation
    assert OptimizerSpec.from_json(spec.to_json()) == spec
    assert spec.param_names == [n for n, _ in model.named_parameters()]


# -- refusals -----------------------------------------------------------------------------------------------------


def test_unsupported_optimizers_are_refused_with_the_list():
    model = make_model()
    with pytest.raises(ValueError, match=r"cannot run torch\.optim\.lbfgs\.LBFGS.*Supported: torch\.optim\.SGD"):
        OptimizerSpec.from_optimizer(torch.optim.LBFGS(model.parameters()), model.named_parameters())

    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="a subclass of torch.optim.SGD that may change its update"):
        OptimizerSpec.from_optimizer(MySGD(model.parameters(), lr=0.1), model.named_parameters())
    with pytest.raises(TypeError, match="expected a torch.optim optimizer"):
        OptimizerSpec.from_optimizer(object(), model.named_parameters())
    bad = OptimizerSpec.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    with pytest.raises(ValueError, match="supported: SGD, Adam"):
        OptimizerSpec.from_dict({**bad.to_dict(), "optimizer": "LBFGS"})


def test_an_optimizer_that_already_stepped_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, *batches()[0]).backward()
    opt.step()
    with pytest.raises(ValueError, match="already taken steps.*servers own the state"):
        OptimizerSpec.from_optimizer(opt, model.named_parameters())
    fresh_adagrad = torch.optim.Adagrad(model.parameters())  # has state (step 0) before any step: accepted
    assert OptimizerSpec.from_optimizer(fresh_adagrad, model.named_parameters()).name == "Adagrad"


def test_foreign_tensors_and_tensor_hyperparameters_are_refused():
    model = make_model()
    other = make_model()
    with pytest.raises(ValueError, match="not parameters of the model"):
        OptimizerSpec.from_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), model.named_parameters())
    with pytest.raises(ValueError, match="lr is a Tensor"):
        OptimizerSpec.from_optimizer(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)),
                                     model.named_parameters())


def test_frozen_parameters_are_held_but_not_updated():
    model = make_model()
    opt = torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.1)  # emb frozen
    spec = OptimizerSpec.from_optimizer(opt, model.named_parameters())
    placement = place([(n, p.shape, p.dtype) for n, p in model.named_parameters()], 1, CHUNK)
    server = ServerOptimizer(spec, {p: v for n, t in model.named_parameters()
                                    for p, v in placement.split(n, t.detach())})
    before = {k: v.clone() for k, v in server.params.items()}
    server.apply({k: torch.ones_like(v) for k, v in server.params.items()})
    for key, value in server.params.items():
        assert torch.equal(value, before[key]) == key.startswith("emb.")
    with pytest.raises(KeyError, match="does not hold"):
        server.apply({"nope[0:1]": torch.ones(1)})
    with pytest.raises(ValueError, match="float64 with 1 elements"):
        server.apply({"fc2.bias[0:3]": torch.ones(1, dtype=torch.float64)})


def test_pieces_are_copied_not_aliased():
    model = make_model()
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    weight = model.fc2.bias.detach()
    server = ServerOptimizer(spec, {"fc2.bias[0:3]": weight})
    server.apply({"fc2.bias[0:3]": torch.ones(3)})
    assert torch.equal(weight, model.fc2.bias.detach()) and not torch.equal(server.params["fc2.bias[0:3]"], weight)


# -- gradient averaging -------------------------------------------------------------------------------------------


def test_mean_of_gradients_sums_in_rank_order_then_divides_once():
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(1000, generator=g) * 10 ** (i - 2) for i in range(5)]
    expected = functools.reduce(torch.add, grads) / 5
    assert torch.equal(mean_of_gradients(grads), expected)
    assert torch.equal(mean_of_gradients(grads[:1]), grads[0]) and mean_of_gradients(grads[:1]) is not grads[0]
    # With a power-of-two count the division is exact: equal to DDP's divide-then-sum.
    assert torch.equal(mean_of_gradients(grads[:4]), functools.reduce(torch.add, [x / 4 for x in grads[:4]]))


def test_mean_of_gradients_accumulates_half_precision_in_float32():
    grads = [torch.full((4,), 60000.0, dtype=torch.float16)] * 2  # the fp16 sum, 120000, would overflow
    assert torch.equal(mean_of_gradients(grads), torch.full((4,), 60000.0, dtype=torch.float16))
    doubles = [torch.tensor([1.0, 2.0], dtype=torch.float64)] * 3
    assert mean_of_gradients(doubles).dtype == torch.float64
    with pytest.raises(ValueError, match="differ in dtype or shape"):
        mean_of_gradients([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="no gradients"):
        mean_of_gradients([])


def test_mean_of_worker_gradients_matches_the_combined_batch():
    x, y = batches()[0]
    model = make_model()
    loss_of(model, x, y).backward()
    combined = {n: p.grad.clone() for n, p in model.named_parameters()}
    per_worker = []
    for rank in range(2):
        model.zero_grad()
        loss_of(model, x[rank * BATCH // 2:(rank + 1) * BATCH // 2], y[rank * BATCH // 2:(rank + 1) * BATCH // 2]) \
            .backward()
        per_worker.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, expected in combined.items():
        mean = mean_of_gradients([w[name] for w in per_worker])
        torch.testing.assert_close(mean, expected, rtol=0, atol=1e-7)
