"""speculative_config errors name the field, before any weight loads."""

from __future__ import annotations

import pytest

from toolkit.speculative import SpeculativeConfig, SpeculativeConfigError
from tests.checkpoints import write_checkpoint
from toolkit import LLM, EngineConfig


@pytest.mark.parametrize("config,field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 1.5}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"}, "model"),
    ("{not json", "JSON"),
    (["ngram"], "dict"),
])
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(SpeculativeConfigError, match=field):
        SpeculativeConfig.parse(config)
    # LLM(...) refuses it before loading anything (the model path does not even exist).
    with pytest.raises(SpeculativeConfigError, match=field):
        EngineConfig(model="/nonexistent/model", speculative_config=config)


def test_parse_accepts_json_a_dict_or_a_config_and_fills_the_default_draft(tmp_path):
    draft = write_checkpoint(tmp_path / "draft", "llama3", seed=3)
    parsed = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (parsed.method, parsed.k, parsed.prompt_lookup_min, parsed.prompt_lookup_max) == ("ngram", 3, 1, 5)
    assert SpeculativeConfig.parse(parsed) is parsed and SpeculativeConfig.parse(None) is None
    filled = SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2}, default_draft=draft)
    assert filled.model == str(draft)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    target = write_checkpoint(tmp_path / "target", "llama3", seed=1)
    draft = write_checkpoint(tmp_path / "draft", "llama3", seed=2, vocab_size=200)
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config.model: the draft's vocabulary \(200"):
        LLM(str(target), dtype="float32", max_model_len=64, enforce_eager=True, skip_tokenizer_init=True,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
