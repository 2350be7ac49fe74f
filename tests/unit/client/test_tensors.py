"""Weights as a trainer hands them over: the names a wrapper adds are taken off."""

import torch
from torch import nn

from rlbus.client.tensors import prepare, unwrapped


def test_a_ddp_or_compiled_model_publishes_the_plain_model_s_names():
    plain = nn.Linear(3, 2).state_dict()
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        wrapped = {prefix + name: t for name, t in plain.items()}
        assert set(prepare(wrapped).specs) == {"weight", "bias"}


def test_a_prefix_only_some_names_carry_is_a_real_name_and_stays():
    state = {"module.weight": torch.zeros(2), "head.weight": torch.zeros(2)}
    assert unwrapped(state) is state
    assert unwrapped({}) == {}
