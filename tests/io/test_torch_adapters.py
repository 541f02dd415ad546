"""hf_pma.io.torch_adapters: this process's part of a tensor (the one DTensor helper of the
snapshot writers and the weight swap)."""

from __future__ import annotations

import torch

from hf_pma.io.torch_adapters import is_dtensor, local_tensor


class ShardedLike:
    """What FSDP2 hands out: an object whose ``to_local()`` is this rank's shard."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard = shard

    def to_local(self) -> torch.Tensor:
        return self.shard


def test_local_tensor_is_the_shard_of_a_dtensor_and_any_other_tensor_itself():
    plain, shard = torch.arange(4.0), torch.ones(2)
    assert local_tensor(plain) is plain and not is_dtensor(plain)
    assert local_tensor(ShardedLike(shard)) is shard and is_dtensor(ShardedLike(shard))
    # An attribute named to_local that cannot be called is no DTensor.
    odd = torch.zeros(1)
    odd.to_local = "not callable"
    assert local_tensor(odd) is odd and not is_dtensor(odd)
