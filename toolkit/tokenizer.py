"""Tokenizer, end-of-sequence ids and chat template, all through transformers from the checkpoint folder
(or from a GGUF file, which stores them)."""

from __future__ import annotations

from pathlib import Path

from toolkit.config import ModelConfig


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one will do


def load_tokenizer(path: str | Path, read_only: bool = False):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files (token-id prompts only).
    A GGUF file's is the one stored in it, chat template included. `read_only`: the caller only
    tokenizes, so a GGUF file's tokenizer may be the process's cached one rather than a copy of it."""
    path = Path(path)
    if not has_tokenizer(path):
        return None
    if path.is_file():
        from toolkit.gguf_checkpoint import load_tokenizer as load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(path, own_copy=not read_only)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    # Prompts are bounded by max_model_len, checked by the engine; the tokenizer's own limit would only
    # print a warning about "sequence length" that says nothing about what the engine accepts. (The same
    # value every time, so setting it on a shared GGUF tokenizer changes nothing for its other users.)
    tokenizer.model_max_length = int(1e30)
    return tokenizer


def has_tokenizer(path: str | Path) -> bool:
    """A GGUF file that stores a vocabulary, or a folder with a tokenizer file."""
    path = Path(path)
    if path.is_file():
        from toolkit.gguf_checkpoint import has_tokenizer as gguf_has_tokenizer, is_gguf

        return is_gguf(path) and gguf_has_tokenizer(path)
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def has_chat_template(path: str | Path) -> bool:
    """Whether the tokenizer at `path` (a folder or a GGUF file) has a chat template, read without loading it."""
    import json

    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            return False
        from toolkit.gguf_checkpoint import metadata, read

        return metadata(read(path), "tokenizer.chat_template", None) is not None
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def eos_token_ids(config: ModelConfig, tokenizer) -> frozenset[int]:
    """What ends generation: generation_config.json first (as transformers' generate does), then config, tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    if (Path(config.path) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(config.path).eos_token_id
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if not ids:
        ids.update(config.eos_token_ids)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, but the model folder has no tokenizer files")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; use generate() with plain prompts")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_messages(messages) -> list[dict]:
    """Chat messages with string content; OpenAI's [{"type": "text", "text": ...}] parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"messages[{i}] must be an object with a string role and a content")
        out.append({**m, "content": _text_content(m["content"], i)})
    return out


def _text_content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts (images are not supported)")
