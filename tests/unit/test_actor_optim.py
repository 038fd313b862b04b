"""actor.optim's choice of torch's fused Adam, and that a checkpoint load keeps it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.actor.optim import fuse_torch_adam, kernel_choice_kept, unshare_step_counters


def _wrapped(param: torch.nn.Parameter):
    """A torch AdamW inside the (chained) shape megatron's optimizer has: chained_optimizers[i].optimizer."""
    inner = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    return inner, SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])


def _steps(inner, param, steps: range) -> None:
    for step in steps:
        param.grad = torch.cos(param.detach() * (step + 1))
        inner.step()


def test_fused_only_where_asked_on_cpu_and_the_same_update():
    """On CPU parameters nothing changes unless a device is asked for (the CPU tests pin the foreach numbers);
    asked, three fused steps equal three foreach steps."""
    results = []
    for fuse in (True, False):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 64))
        inner, wrapped = _wrapped(param)
        assert fuse_torch_adam(wrapped) == (0, "")
        if fuse:
            assert fuse_torch_adam(wrapped, torch.device("cpu"))[0] == 1 and inner.param_groups[0]["fused"]
        _steps(inner, param, range(3))
        results.append(param.detach())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_a_load_keeps_this_builds_kernel_and_gives_each_parameter_its_counter():
    """A checkpoint saved by a foreach optimizer, loaded into a fused one: the groups stay fused (torch's load
    takes the saved groups' flags), every parameter has a step counter of its own, and training goes on."""
    saved_param = torch.nn.Parameter(torch.linspace(-1, 1, 64))
    saved_inner, _ = _wrapped(saved_param)
    _steps(saved_inner, saved_param, range(2))
    saved = saved_inner.state_dict()
    assert not saved["param_groups"][0]["fused"]

    params = [torch.nn.Parameter(saved_param.detach().clone()), torch.nn.Parameter(torch.zeros(8))]
    inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    wrapped = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])
    fuse_torch_adam(wrapped, torch.device("cpu"))
    saved["param_groups"][0]["params"] = [0, 1]
    saved["state"][1] = {"step": saved["state"][0]["step"], "exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)}
    with kernel_choice_kept(wrapped):
        inner.load_state_dict(saved)
    assert inner.param_groups[0]["fused"] and not inner.param_groups[0]["foreach"]
    unshare_step_counters(wrapped)
    counters = [inner.state[p]["step"] for p in params]
    assert counters[0] is not counters[1] and all(float(c) == 2 for c in counters)
    params[1].grad = torch.ones(8)
    _steps(inner, params[0], range(2, 3))  # the fused kernel runs on the loaded state
    assert [float(inner.state[p]["step"]) for p in params] == [3.0, 3.0]
