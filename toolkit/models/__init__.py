"""Model registry: config.json `architectures` -> model class."""

from toolkit.config import SUPPORTED_ARCHITECTURES
from toolkit.models.llama import LlamaForCausalLM

MODEL_CLASSES = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}

__all__ = ["MODEL_CLASSES", "LlamaForCausalLM"]
