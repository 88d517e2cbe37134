"""The step log's throughput figures (conveyor.train.throughput): FLOPs counted once match the analytic count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.train.throughput import (
    PEAK_BF16_TFLOPS,
    Throughput,
    check_options,
    count_flops,
    device_peak_tflops,
    peak_memory_bytes,
    tokens_per_sample,
)

B = 8


def plain_step(model, optimizer, loss_fn, inputs, targets, mark):
    """The default strategy step, in short (conveyor.strategies.base.Step.train)."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    mark("forward_backward")
    optimizer.step()
    return loss.detach()


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_linear_layer_costs_2_in_out_per_sample_forward_and_3_times_that_with_backward():
    model, _ = mlp()
    x = torch.randn(B, 4, requires_grad=True)  # the input's gradient too: every layer computes both
    with torch.no_grad():
        _, forward = count_flops(model, x)
    _, both = count_flops(lambda: model(x).sum().backward())
    assert forward == 2 * B * (4 * 16 + 16 * 3)
    assert both == 3 * forward


def test_the_first_step_is_counted_once_and_later_steps_scale_with_the_batch():
    model, opt = mlp()
    meter = Throughput("cpu", count_flops=True)
    x, y = torch.randn(B, 4), torch.randint(0, 3, (B,))
    calls = []
    meter.train(lambda *a: calls.append(1) or plain_step(*a), model, opt, nn.functional.cross_entropy, x, y,
                lambda _: None)
    # forward 2*in*out per layer; backward the weight gradient of both, the input gradient of the second only
    per_sample = 2 * (4 * 16 + 16 * 3) + 2 * (4 * 16 + 16 * 3) + 2 * 16 * 3
    assert calls == [1] and meter.flops_per_sample == per_sample and meter.count_seconds > 0
    assert meter.measure(x[:3], y[:3], counted=3) == (None, 3 * per_sample)  # float inputs: no tokens
    meter.train(lambda *a: calls.append(2) or plain_step(*a), model, opt, nn.functional.cross_entropy, x, y,
                lambda _: None)
    assert calls == [1, 2] and meter.flops_per_sample == per_sample and meter.total_flops == 3 * per_sample


def test_a_convolution_is_counted_analytically():
    conv = nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        _, flops = count_flops(conv, x)
    assert flops == 2 * (2 * 8 * 6 * 6) * (3 * 3 * 3)  # 2 per multiply-add, per output element


def test_shape_inference_on_the_meta_device_is_no_flops():
    model = mlp()[0].to("meta")
    _, flops = count_flops(lambda: model(torch.randn(B, 4, device="meta")).sum().backward())
    assert flops == 0  # a pipeline stage builds its schedule so at the first step


def test_counting_does_not_change_the_step():
    results = []
    for counted in (True, False):
        model, opt = mlp()
        torch.manual_seed(1)
        x, y = torch.randn(B, 4), torch.randint(0, 3, (B,))
        meter = Throughput("cpu", count_flops=counted)
        loss = meter.train(plain_step, model, opt, nn.functional.cross_entropy, x, y, lambda _: None)
        results.append((loss, [p.detach().clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_tokens_are_b_times_t_for_integer_inputs_or_as_given():
    ids = torch.zeros(4, 32, dtype=torch.long)
    assert tokens_per_sample(ids, None) == 32
    assert tokens_per_sample(torch.zeros(4, 32), None) is None  # features, not tokens
    assert tokens_per_sample(torch.zeros(4, 3, 5, dtype=torch.long), None) is None  # not (B, T)
    assert tokens_per_sample(torch.zeros(4, 3), 7) == 7
    meter = Throughput("cpu", count_flops=False)
    assert meter.measure(ids, torch.zeros(4), counted=4) == (128, None)
    assert meter.measure(ids, torch.zeros(4), counted=0) == (0, None)  # a pipeline stage that does not count


def test_mfu_only_where_a_peak_is_known():
    assert device_peak_tflops("cpu") is None
    assert Throughput("cpu").figures(2e12, None, 2.0) == {"tflops": 1.0}
    assert Throughput("cpu", peak_tflops=4).figures(2e12, 10, 2.0) == {"tokens_per_second": 5.0, "tflops": 1.0,
                                                                     "mfu": 0.25}
    assert Throughput("cpu", peak_tflops=4).figures(None, None, 2.0) == {}
    names = [key for key, _ in PEAK_BF16_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100") and names.index("A10G") < names.index("A10")


def test_peak_memory_is_the_process_rss_on_the_cpu():
    before = peak_memory_bytes("cpu")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert peak_memory_bytes("cpu") >= max(before, 64 * 2**20) and block.sum() > 0


@pytest.mark.parametrize("options, fragment", [({"peak_tflops": 0}, "peak_tflops"), ({"peak_tflops": True}, "peak"),
                                               ({"tokens_per_sample": 0}, "tokens_per_sample"),
                                               ({"count": "yes"}, "count_flops")])
def test_options_are_checked(options, fragment):
    args = {"peak_tflops": None, "tokens_per_sample": None, "count": True, **options}
    with pytest.raises(ValueError, match=fragment):
        check_options(**args)


def test_the_trainer_checks_them_with_its_other_options():
    from conveyor.train.trainer import TrainConfig

    assert TrainConfig(peak_tflops=989, tokens_per_sample=128, count_flops=False).peak_tflops == 989
    with pytest.raises(ValueError, match="peak_tflops must be a positive number"):
        TrainConfig(peak_tflops=-1)
