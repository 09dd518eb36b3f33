"""Pipeline stages (parallel/pipeline.py): the layer partition, and a model cut into stages that hold
exactly their own tensors and, chained stage after stage, give the unsplit model's logits."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import write_checkpoint
from toolkit.attention import allocate_kv_cache
from toolkit.config import load_model_config
from toolkit.inputs import build
from toolkit.parallel import ParallelConfigError
from toolkit.parallel.pipeline import StageSplit, head_layers, layer_partition
from toolkit.scheduling import ScheduledRequest
from toolkit.weights import load_model


@pytest.mark.parametrize("layers, pp, want", [(16, 4, [4, 4, 4, 4]), (13, 4, [3, 3, 4, 3]), (7, 3, [2, 3, 2]),
                                              (5, 2, [3, 2]), (3, 3, [1, 1, 1]), (9, 4, [2, 2, 3, 2]),
                                              (11, 4, [3, 3, 3, 2])])
def test_default_partition_is_vllms_rule(layers, pp, want):
    # Even, then one leftover layer each to the stages before the last, from the second-to-last back.
    assert layer_partition(layers, pp) == want


def _splits(layers: int, pp: int):
    """Every split of `layers` into `pp` stages of at least one layer."""
    if pp == 1:
        yield [layers]
        return
    for first in range(1, layers - pp + 2):
        for rest in _splits(layers - first, pp - 1):
            yield [first, *rest]


@pytest.mark.parametrize("layers,pp", [(12, 2), (12, 3), (30, 2), (30, 4), (7, 3), (5, 5)])
@pytest.mark.parametrize("head", [0.3, 1.95, 4.0, 9.0])
def test_the_default_split_minimizes_the_costliest_stage_with_the_head_on_the_last(layers, pp, head):
    # Against every split there is: none has a cheaper costliest stage (the last one's cost is its
    # layers plus the head's).
    cost = lambda split: max(*split[:-1], split[-1] + head) if len(split) > 1 else split[0] + head  # noqa: E731
    chosen = layer_partition(layers, pp, head_layers=head)
    assert sum(chosen) == layers and len(chosen) == pp and min(chosen) >= 1
    assert cost(chosen) == min(cost(split) for split in _splits(layers, pp))


@pytest.mark.parametrize("shape,want", [("125m", [7, 5]), ("smollm2", [17, 13])])
def test_the_heads_weight_is_half_its_matmul_over_a_layers(tmp_path, shape, want):
    # Counted from the built model's own linears (meta device): the lm_head's weights over one decoder
    # layer's, halved (only sampled tokens reach the head).
    import transformers

    from toolkit.cli.bench.model import shape_config
    from toolkit.weights import build_model

    if shape == "125m":
        hf = shape_config("125m")
    else:  # SmolLM2-135M's shape: 9 heads of 64, 3 kv heads, 30 layers, tied 49,152-token head
        hf = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    hf.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    model = build_model(config, 64)
    layer = sum(m.weight.numel() for m in model.model.layers["0"].modules() if isinstance(m, torch.nn.Linear))
    assert head_layers(config) == pytest.approx(0.5 * model.lm_head.weight.numel() / layer)
    assert layer_partition(config.num_layers, 2, head_layers=head_layers(config)) == want


def test_partition_override_and_errors():
    assert layer_partition(16, 4, "4,4,5,3") == [4, 4, 5, 3]
    with pytest.raises(ParallelConfigError, match="sums to 15 layers but the model has 16"):
        layer_partition(16, 4, "4,4,4,3")
    with pytest.raises(ParallelConfigError, match="has 3 stages but pipeline_parallel_size is 4"):
        layer_partition(16, 4, "6,5,5")
    with pytest.raises(ParallelConfigError, match="at least one layer"):
        layer_partition(4, 2, "4,0")
    with pytest.raises(ParallelConfigError, match="comma-separated"):
        layer_partition(4, 2, "2;2")
    with pytest.raises(ParallelConfigError, match="more than the model's 3 layers"):
        layer_partition(3, 4)


def _stage_models(path, sizes):
    mc = load_model_config(path)
    stages = [StageSplit.of(i, sizes, mc.tie_word_embeddings) for i in range(len(sizes))]
    return mc, stages, [load_model(mc, torch.float32, torch.device("cpu"), 64, stage=s) for s in stages]


@pytest.mark.parametrize("family", ["llama3", "tied_mqa"])
def test_stages_hold_their_tensors_and_chain_to_the_whole_model(tmp_path, family):
    path = write_checkpoint(tmp_path / family, family, num_hidden_layers=5)
    mc, stages, models = _stage_models(path, [2, 2, 1])
    whole = load_model(mc, torch.float32, torch.device("cpu"), 64)
    whole_params = dict(whole.named_parameters(remove_duplicate=False))
    for stage, model in zip(stages, models):
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        want = {n for n in whole_params if stage.holds_tensor(n)}
        if mc.tie_word_embeddings and stage.is_last and not stage.is_first:
            assert "model.embed_tokens.weight" not in names
            want = (want - {"model.embed_tokens.weight"}) | {"lm_head.weight"}
        assert names == want, stage.describe()
        for n, p in model.named_parameters(remove_duplicate=False):
            assert torch.equal(p, whole_params[n]), n
    assert [len(m.model.layers) for m in models] == [2, 2, 1]
    assert [sorted(map(int, m.model.layers)) for m in models] == [[0, 1], [2, 3], [4]]

    # Two requests, a prefill each, then a decode: the chained stages' logits equal the whole model's.
    caches = [allocate_kv_cache(len(s.layers), 8, 16, mc.num_kv_heads, mc.head_dim, torch.float32, "cpu")
              for s in stages]
    whole_cache = allocate_kv_cache(5, 8, 16, mc.num_kv_heads, mc.head_dim, torch.float32, "cpu")
    prompts = [[5, 9, 33, 7, 80], list(range(3, 23))]
    steps = [[ScheduledRequest("a", prompts[0], 0, [0], True), ScheduledRequest("b", prompts[1], 0, [1, 2], True)],
             [ScheduledRequest("a", [11], 5, [0], True), ScheduledRequest("b", [12], 20, [1, 2], True)]]
    with torch.inference_mode():
        for scheduled in steps:
            inputs = build(scheduled, block_size=16, num_blocks=8, backend="torch", device=torch.device("cpu"))
            args = (inputs.input_ids, inputs.positions)
            want = whole(*args, whole_cache, inputs.meta, inputs.logits_indices)
            hidden = None
            for model, cache in zip(models, caches):
                hidden = model(*args, cache, inputs.meta, inputs.logits_indices, hidden)
                if model.lm_head is None:
                    assert hidden.shape == (inputs.input_ids.shape[0], mc.hidden_size)
            torch.testing.assert_close(hidden, want, rtol=0, atol=0)


def test_a_send_to_a_stage_that_died_names_both_ranks(monkeypatch):
    """gloo fails a send itself where the next stage's connection closed, which can come before any
    wait of this stage notices the death (test_pipeline_parallel.py's fault test runs into either):
    the error names this stage and rank and the one it sent to, as a failed wait does."""
    from collections import deque
    from types import SimpleNamespace

    import torch.distributed as dist

    from toolkit.parallel.pipeline import PipelineParallel, StageStats

    def closed(*args, **kwargs):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:3499")

    monkeypatch.setattr(dist, "isend", closed)
    link = PipelineParallel.__new__(PipelineParallel)
    link.stage, link.group, link.rank, link.tp_size = SimpleNamespace(index=0, size=3), None, 1, 2
    link._sends, link.stats, link._cpu, link._owed = deque(), StageStats(), True, None
    with pytest.raises(RuntimeError, match=r"^pipeline stage 1 of 3 \(rank 1\) could not send its hidden states to "
                                           r"stage 2 \(rank 3\): Connection closed by peer"):
        link.send_hidden(torch.zeros(2, 4))
    assert not link._sends and link.stats.hidden_bytes == 0
