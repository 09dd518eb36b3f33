"""Which model to load: --model, else the built-in trained model, else a seeded random tiny Llama.

The random model exists so that `toolkit generate "hi"` works on a fresh checkout before the
built-in model has been trained (recipes/train_default_model.py): it is built once, offline, under
$TOOLKIT_CACHE (default ~/.cache/toolkit) and its text is gibberish, which the CLI says.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from toolkit.cli.errors import CliError
from toolkit.envs import cache_root
from toolkit.weights import checkpoint_files

TRAINED_MODEL = Path(__file__).resolve().parent.parent / "toolkit" / "default_model" / "target"
TRAINED_DRAFT = TRAINED_MODEL.parent / "draft"  # its speculative-decoding draft (same tokenizer)
RANDOM_MODEL_NAME = "default-random"
HELP_MODEL = ("expected a Hugging Face model folder with config.json, *.safetensors and tokenizer files, "
              "or a .gguf file")


def resolve_model(model: Path | None, warn) -> Path:
    """The model folder to load, checked enough to fail in one line rather than deep in loading."""
    if model is None:
        if (TRAINED_MODEL / "config.json").is_file():
            # Its answers are a 12M-parameter model's: say so, or a first user judges the toolkit by them.
            warn(f"no --model given: using the built-in demo model ({TRAINED_MODEL}), a small model for trying "
                 "the toolkit out. Pass --model PATH (a Hugging Face model folder) for real output.")
            return TRAINED_MODEL
        path = ensure_random_model(cache_root() / RANDOM_MODEL_NAME)
        warn(f"no trained default model at {TRAINED_MODEL}; using a seeded RANDOM tiny Llama at {path} "
             "(its text is gibberish). Pass --model PATH for real output.")
        return path
    check_model_folder(model)
    return model


def check_model_folder(path: Path) -> None:
    if not path.exists():
        raise CliError(f"model folder not found: {path}; {HELP_MODEL}")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return  # read (and refused when broken) by load_model_config, in one line
    if not path.is_dir():
        raise CliError(f"{path} is a file, not a model folder; {HELP_MODEL}")
    if not (path / "config.json").is_file():
        raise CliError(f"no config.json in {path}; {HELP_MODEL}")
    try:
        checkpoint_files(path)
    except FileNotFoundError as e:
        raise CliError(str(e)) from None


def ensure_random_model(path: Path) -> Path:
    """Builds the random model at path unless it is there; safe when several runs start at once."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        _write_random_model(tmp)
        os.rename(tmp, path)  # atomic: readers never see a half-written folder
    except OSError:
        if not (path / "config.json").is_file():  # a concurrent run winning the rename is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# A small fixed corpus: enough for the byte-level BPE to learn some merges; the model is random anyway.
_CORPUS = [
    "What is a list comprehension? A list comprehension builds a list from an iterable in one expression.",
    "A generator yields values one at a time; a function returns a value and ends.",
    "Python dictionaries map keys to values. Sets hold unique items. Tuples are immutable sequences.",
    "The quick brown fox jumps over the lazy dog. Hello, world!",
]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _write_random_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar would land in the middle of our output

    tokenizer = _train_tokenizer(vocab_size=512)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    fast.chat_template = _CHAT_TEMPLATE
    return fast
