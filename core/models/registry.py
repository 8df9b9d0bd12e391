"""The registered model architectures, looked up by checkpoint (core/interfaces.py's
``ModelRegistry``): an HF ``architectures[0]`` or a GGUF ``general.architecture`` names
the model plugin that reads its config and builds it."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from tokenloom.core.errors import ConfigError
from tokenloom.core.interfaces import ModelArchitecture


class ModelRegistry:
    def __init__(self, architectures: Mapping[str, ModelArchitecture]):
        self.architectures = dict(architectures)
        self._hf: dict[str, ModelArchitecture] = {}
        self._gguf: dict[str, ModelArchitecture] = {}
        for arch in self.architectures.values():
            for table, names, kind in ((self._hf, arch.hf_architectures, "HF architecture"),
                                       (self._gguf, arch.gguf_architectures, "GGUF architecture")):
                for n in names:
                    if n in table:
                        raise ConfigError(f"{kind} {n!r} is claimed by two model plugins: {table[n].name!r} and "
                                          f"{arch.name!r}")
                    table[n] = arch

    def get(self, name: str) -> ModelArchitecture:
        if name not in self.architectures:
            raise ConfigError(f"no model plugin {name!r}; registered: {', '.join(sorted(self.architectures))}")
        return self.architectures[name]

    def for_hf(self, raw: dict) -> ModelArchitecture:
        archs = raw.get("architectures") or []
        if not archs:  # an old config.json without the key: its model_type
            model_type = raw.get("model_type", "llama")
            by_type = [a for a in self.architectures.values() if model_type in getattr(a, "hf_model_types", ())]
            if by_type:
                return by_type[0]
            archs = ["LlamaForCausalLM"] if model_type == "llama" else [f"(model_type {model_type!r})"]
        if archs[0] not in self._hf:
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(self._hf))} "
                              "(a plugin package can add one through the register_models hook)")
        return self._hf[archs[0]]

    def for_gguf(self, arch: str) -> ModelArchitecture:
        if arch not in self._gguf:
            raise ConfigError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(self._gguf))}")
        return self._gguf[arch]


@functools.cache
def default_registry() -> ModelRegistry:
    """The architectures of a default plugin manager (built-ins and installed plugin
    packages): what a loader or the planner uses when not handed an engine's registry."""
    from tokenloom.core import contracts
    from tokenloom.core.plugins import PluginManager

    return contracts.model_registry(PluginManager())
