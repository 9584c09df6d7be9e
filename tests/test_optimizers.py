"""The fused optimizer default: same update as torch's default implementation, and left alone when configured."""

from __future__ import annotations

import functools

import pytest
import torch

from src.engine.steps.optimizers import build_optimizer, is_fused, takes_fused

pytestmark = pytest.mark.fast


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(64, 32), (64,), (10, 64), (10,)]]


def run(factory, fused: bool, steps: int = 30) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    ps = params()
    opt = build_optimizer(factory, ps, fused=fused)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in ps], opt


@pytest.mark.parametrize("cls,kwargs", [(torch.optim.Adam, {"lr": 1e-3}), (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
                                        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_fused_step_equals_the_default_step(cls, kwargs):
    factory = functools.partial(cls, **kwargs)
    fused, opt = run(factory, fused=True)
    plain, plain_opt = run(factory, fused=False)
    assert is_fused(opt) and not is_fused(plain_opt)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused[0], params()[0])  # the steps did move the weights


def test_a_configured_implementation_is_kept():
    for chosen in ({"foreach": True}, {"fused": False}):
        factory = functools.partial(torch.optim.Adam, lr=1e-3, **chosen)
        assert not takes_fused(factory)
        assert not is_fused(build_optimizer(factory, params()))


def test_optimizers_without_fused_are_built_as_configured():
    factory = functools.partial(torch.optim.RMSprop, lr=0.01)  # takes no `fused`
    opt = build_optimizer(factory, params())
    assert isinstance(opt, torch.optim.RMSprop) and not is_fused(opt)


def test_the_default_model_trains_with_the_fused_kernel(make_cfg):
    from src.train import train

    _, objects = train(make_cfg("train", ["test=false"]))
    (optimizer,) = objects["trainer"].optimizers
    assert is_fused(optimizer)
