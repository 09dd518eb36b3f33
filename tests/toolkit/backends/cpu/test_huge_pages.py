"""The CPU backend's KV cache on transparent huge pages: every layer's cache starts on a 2 MiB boundary
(so its whole pages are advised), zeroed, in the layout the attention kernels read."""

import torch

from tests.checkpoints import write_checkpoint
from toolkit import LLM
from toolkit.attention import allocate_kv_cache
from toolkit.backends.cpu.huge_pages import HUGE_PAGE, empty_on_huge_pages


def test_the_kv_cache_is_allocated_on_huge_pages_and_zeroed(tmp_path):
    caches = allocate_kv_cache(3, 600, 16, 2, 32, torch.bfloat16, "cpu", empty=empty_on_huge_pages)
    for cache in caches:
        assert cache.shape == (2, 600, 16, 2, 32) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
        assert cache.data_ptr() % HUGE_PAGE == 0 and cache.nbytes >= HUGE_PAGE
        assert not cache.any()
    # The engine's own caches come from the backend's allocator.
    ckpt = write_checkpoint(tmp_path, "llama3", seed=1, num_hidden_layers=2)
    llm = LLM(str(ckpt), dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=8 << 20)
    kv = llm.engine.runner.kv_caches
    assert len(kv) == 2 and all(c.data_ptr() % HUGE_PAGE == 0 for c in kv)
