"""The built-in model families, registered through ``register_models`` like a plugin
package's would be (plugins/models/families.py, moe.py)."""

from __future__ import annotations

from tokenloom.core.hookspecs import hookimpl
from tokenloom.plugins.models.families import BUILTIN_FAMILIES
from tokenloom.plugins.models.moe import MOE_FAMILIES


@hookimpl
def register_models(register):
    for family in (*BUILTIN_FAMILIES, *MOE_FAMILIES):
        register(family.name, family, description=(family.__doc__ or "").strip().split("\n")[0])
