"""ParallelDims: the rank layout against the device mesh's own, and validation of a layout against
the launch and the model (every error before any process group is joined)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from toolkit.parallel import ParallelConfigError, ParallelDims


def dense(**kw):
    base = dict(family="llama", num_heads=8, num_kv_heads=2, intermediate_size=64, num_layers=6, path="dense",
                hidden_size=64, head_dim=8, vocab_size=128,
                tie_word_embeddings=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (2, 2, 2), (3, 2, 2)])
def test_rank_layout_is_the_meshs(dp, pp, tp):
    # init_device_mesh(device, (dp, pp, tp)) lays the world out as arange(world).view(dp, pp, tp).
    mesh = torch.arange(dp * pp * tp).view(dp, pp, tp)
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    assert dims.world_size == mesh.numel()
    for d in range(dp):
        assert dims.replica_ranks(d) == mesh[d].flatten().tolist()
        for p in range(pp):
            for t in range(tp):
                assert dims.rank(d, p, t) == mesh[d, p, t].item()
    for p in range(pp):
        assert dims.stage_ranks(p) == mesh[:, p, :].flatten().tolist()
    assert ParallelDims(dp=dp, pp=pp, tp=tp, expert_parallel=True).ep == dp * tp
    assert dims.ep == 1


def test_validate_returns_the_stages_and_checks_the_launch_and_the_model():
    dims, stages = ParallelDims(pp=2, tp=2).validate(dense(), 4)
    assert stages == [3, 3] and dims == ParallelDims(pp=2, tp=2)
    assert ParallelDims(pp=3, pp_layer_partition="1,2,3").validate(dense(), 3)[1] == [1, 2, 3]
    with pytest.raises(ParallelConfigError, match="world size of 2"):
        ParallelDims(pp=2, tp=2).validate(dense(), 2)
    with pytest.raises(ParallelConfigError, match="3 does not divide the model's 8 attention heads"):
        ParallelDims(tp=3).validate(dense(), 3)
    with pytest.raises(ParallelConfigError, match="more than the model's 6 layers"):
        ParallelDims(pp=7).validate(dense(), 7)
    with pytest.raises(ParallelConfigError, match="sums to 5 layers"):
        ParallelDims(pp=2, pp_layer_partition="2,3").validate(dense(), 2)
    with pytest.raises(ParallelConfigError, match="must be an integer >= 1"):
        ParallelDims(dp=0).validate(dense(), 1)


def test_expert_parallel_is_checked_over_the_expert_group_and_dropped_for_a_dense_model(caplog):
    moe = dense(num_experts=6, path="moe")
    dims, _ = ParallelDims(dp=3, pp=2, tp=1, expert_parallel=True).validate(moe, 6)
    assert dims.expert_parallel and dims.ep == 3
    with pytest.raises(ParallelConfigError, match="expert parallel size 4 .* does not divide the model's 6 experts"):
        ParallelDims(dp=2, tp=2, expert_parallel=True).validate(moe, 4)
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        dims, _ = ParallelDims(dp=2, expert_parallel=True).validate(dense(), 2)
    assert not dims.expert_parallel and "no routed experts" in caplog.text
