"""A small, torch.compile-centric LLM inference toolkit with vLLM's offline API."""

from toolkit import envs

envs.set_process_defaults()  # before anything builds a oneDNN primitive (toolkit/envs.py)

from toolkit.config import EngineConfig
from toolkit.engine import Engine
from toolkit.llm import LLM
from toolkit.outputs import CompletionOutput, RequestMetrics, RequestOutput
from toolkit.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Engine", "EngineConfig"]
