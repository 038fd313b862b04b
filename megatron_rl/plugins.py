"""Plug-ins by import path: seven config keys take a built-in name or a user's `package.module:function`.

    load_plugins(cfg)    # at start, on every rank (preflight.check_before_start), before any model or engine

| key                    | a plug-in is called as                                                        | looked up in |
| ---------------------- | ----------------------------------------------------------------------------- | ------------ |
| algorithm.loss         | fn(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,          | algorithms.POLICY_LOSSES |
|                        |    ref_logprobs, rollout_logprobs, entropy) -> (loss_sum, metrics)            |              |
| algorithm.advantage    | fn(rewards, index, group_size, cfg) -> advantages [N]                         | algorithms.ADVANTAGES |
| algorithm.tis_mode     | fn(log_rho, params) -> (weight, keep, truncated), or an ISCorrection          | algorithms.IS_CORRECTIONS |
| algorithm.group_filter | fn(rewards, group_ids) -> keep [N] bool                                       | algorithms.GROUP_FILTERS |
| data.reward            | fn(response, answer, *, prompt) -> float                                      | rollout.rewards.get_reward_fn |
| rollout.agent          | a subclass of rollout.agents.Environment                                      | rollout.agents.load_agent |
| rollout.function       | fn(engine, prompts, spec, tokenizer, cfg) -> Rollouts                         | rollout.function.get_rollout_function |

Each import path is imported and checked against the call its key makes (the
registry's Protocol, rollout.import_path.check_call: Python must be able to bind
the caller's arguments to the function), so a function that cannot take them is
refused before any work, in one line naming the key, the value, the expected
call and the function's own (PluginError, a ConfigError: exit code 2):

    algorithm.loss='my_pkg.losses:my_loss': fn(logprobs, ..., entropy=None) -> tuple[torch.Tensor, Metrics] expected; got my_loss(x)

The four algorithm keys' functions are then added to their registry under the
path, so the callers' lookups by the config's value (get_policy_loss(cfg.loss),
compute_advantages, the IS correction inside the loss, dynamic sampling's filter)
find them without a change to the package. The reward, the agent and the rollout
function are resolved by their own loaders, which apply the same checks. The
module must import on every rank (on PYTHONPATH on every node).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.algorithms import ADVANTAGES, GROUP_FILTERS, IS_CORRECTIONS, POLICY_LOSSES, ISCorrection, as_is_correction
from megatron_rl.config.core import is_import_path
from megatron_rl.rollout.import_path import check_call, expected_call, load_callable, load_object


def load_plugins(cfg: Any) -> dict[str, Any]:
    """Import and check every import path among the seven keys; add the algorithm ones to their registries.

    Returns {config key: the loaded function or class} for the keys given as import paths. The first failure
    raises a ConfigError naming its key (see the module docstring)."""
    from megatron_rl.rollout.agents.base import load_agent
    from megatron_rl.rollout.function import get_rollout_function
    from megatron_rl.rollout.rewards import get_reward_fn

    algo, loaded = cfg.algorithm, {}
    for registry, value in ((POLICY_LOSSES, algo.loss), (ADVANTAGES, algo.advantage), (GROUP_FILTERS, algo.group_filter)):
        if is_import_path(value):
            loaded[registry.config_key] = _add_function(registry, value)
    if is_import_path(algo.tis_mode):
        loaded["algorithm.tis_mode"] = load_is_correction(algo.tis_mode)
    reward_fn = get_reward_fn(cfg.data.reward)  # a built-in name is checked too (its extra installed)
    if is_import_path(cfg.data.reward):
        loaded["data.reward"] = reward_fn
    if cfg.rollout.agent:
        agent = load_agent(cfg.rollout.agent)
        if is_import_path(cfg.rollout.agent):
            loaded["rollout.agent"] = agent
    rollout_fn = get_rollout_function(cfg.rollout.function)
    if is_import_path(cfg.rollout.function):
        loaded["rollout.function"] = rollout_fn
    return loaded


def _add_function(registry: Any, path: str) -> Any:
    """The function at `path`, checked against the registry's call and added to it under the path."""
    fn = load_callable(registry.config_key, path, registry.call)
    registry.add_plugin(path, fn)
    return fn


def load_is_correction(path: str) -> ISCorrection:
    """algorithm.tis_mode=path: an ISCorrection (its weight function checked) or a weight function (a token-level
    correction reading the config's tis_cap, is_lower, is_upper), added to IS_CORRECTIONS under the path."""
    key, call = IS_CORRECTIONS.config_key, IS_CORRECTIONS.call
    entry = load_object(key, path, f"an ISCorrection or {expected_call(call)}")
    check_call(key, path, entry.weights if isinstance(entry, ISCorrection) else entry, call)
    correction = as_is_correction(entry, path)
    IS_CORRECTIONS.add_plugin(path, correction)
    return correction


__all__ = ["load_is_correction", "load_plugins"]
