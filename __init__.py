"""tokenloom: an LLM inference engine whose every optimisation is a plugin.

The public Python API lives in :mod:`tokenloom.core`; this module re-exports the
names most users need so ``from tokenloom import LLM, SamplingParams`` works.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # Lazy: importing tokenloom (e.g. for the CLI's --help) should not import torch.
    if name in ("LLM",):
        from tokenloom.core.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from tokenloom.core.engine import AsyncEngine

        return AsyncEngine
    if name == "SamplingParams":
        from tokenloom.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from tokenloom.core.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
