"""The transports' registry, the config's names and the transport modules agree: a name the config accepts has a
module holding both its ends, and every registered module has them."""

from __future__ import annotations

import typing

import pytest

from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.transport import Transport
from megatron_rl.weight_sync.transports import TRANSPORTS, receivers, transport_for


def test_every_name_the_config_accepts_is_registered_and_nothing_else():
    accepted = set(typing.get_args(typing.get_type_hints(RolloutConfig)["weight_transport"]))
    assert accepted == {"auto", "rpc", "broadcast", "ipc", "vllm_nccl_m2n", "vllm_ipc"}
    assert set(TRANSPORTS) == accepted - {"auto"} == set(typing.get_args(Transport))


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_each_registered_transport_has_both_ends(name):
    transport = transport_for(name)
    assert callable(transport.trainer) and callable(transport.owners) and callable(transport.engine_sender)
    assert transport.receiver is None or transport.receiver in receivers()


def test_an_unknown_transport_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"no weight transport 'carrier_pigeon'; the transports are \['broadcast', 'ipc', 'rpc'"):
        transport_for("carrier_pigeon")
