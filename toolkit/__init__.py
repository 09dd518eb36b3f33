"""A small, torch.compile-centric LLM inference toolkit with vLLM's offline API."""

import os as _os

# In a source checkout, toolkit.attention, toolkit.cli, ... are the folders beside this one (the wheel
# installs them under toolkit/, pyproject.toml's package-dir); anywhere else this adds nothing.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isdir(_os.path.join(_checkout, "attention")):
    __path__.append(_checkout)

from toolkit import envs

envs.set_process_defaults()  # before anything builds a oneDNN primitive (toolkit/envs.py)

# The public names load on first use, so `import toolkit.scheduling` (bookkeeping, no torch) stays
# as light as the scheduler is; `from toolkit import LLM` loads the engine.
_EXPORTS = {
    "LLM": "toolkit.llm", "SamplingParams": "toolkit.sampling_params", "Engine": "toolkit.engine",
    "EngineConfig": "toolkit.config", "RequestOutput": "toolkit.outputs", "CompletionOutput": "toolkit.outputs",
    "Logprob": "toolkit.outputs", "RequestMetrics": "toolkit.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
