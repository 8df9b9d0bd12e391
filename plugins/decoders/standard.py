"""`standard`: one token per sequence per step; proposes no drafts. It runs the shared
step (plugins/decoders/base.py), so a request may still pick another decoder."""

from __future__ import annotations

import msgspec

from tokenloom.core.hookspecs import hookimpl
from tokenloom.plugins.decoders.base import SharedStepDecoder


class StandardOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StandardDecoder(SharedStepDecoder):
    name = "standard"


@hookimpl
def register_decoders(register):
    register("standard", StandardDecoder, options=StandardOptions,
             description="one forward pass per step, one token per sequence")
