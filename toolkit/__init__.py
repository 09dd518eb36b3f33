"""A small, torch.compile-centric LLM inference toolkit with vLLM's offline API."""

import os as _os

# In a source checkout, toolkit.attention, toolkit.cli, ... are the folders beside this one (the wheel
# installs them under toolkit/, pyproject.toml's package-dir); anywhere else this adds nothing.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isdir(_os.path.join(_checkout, "attention")):
    __path__.append(_checkout)

from toolkit import envs

envs.set_process_defaults()  # before anything builds a oneDNN primitive (toolkit/envs.py)

from toolkit.config import EngineConfig
from toolkit.engine import Engine
from toolkit.llm import LLM
from toolkit.outputs import CompletionOutput, RequestMetrics, RequestOutput
from toolkit.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Engine", "EngineConfig"]
