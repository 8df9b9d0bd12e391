"""The built-in frontends, registered like any plugin's (``register_frontends``).

This module stays light (it is imported whenever a plugin manager starts): each factory
imports its server only when `tokenloom serve` mounts it.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import msgspec

from tokenloom.core.hookspecs import hookimpl

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: any free port (tests)


class WebSocketFrontendOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    port: Port = 8765


class OpenAIFrontendOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    port: Port = 8000  # vLLM's default, which OpenAI-speaking tools are often pointed at
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1 << 20  # larger bodies: 413
    served_model_name: str | None = None  # the name `model` must carry (default: --model as given)


def websocket_frontend(options: WebSocketFrontendOptions | None, context):
    """The token-streaming WebSocket protocol, /health, /metrics, /stats and the playground page."""
    from tokenloom.protocols.websocket.server import TokenServer

    options = options or WebSocketFrontendOptions()
    gateway = context.gateway
    return TokenServer(context.engine, dataclasses.replace(gateway.options, host=context.host, port=options.port),
                       gateway)


def openai_frontend(options: OpenAIFrontendOptions | None, context):
    """OpenAI-compatible HTTP: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)."""
    from tokenloom.protocols.openai.server import OpenAIFrontend

    return OpenAIFrontend(options or OpenAIFrontendOptions(), context)


@hookimpl
def register_frontends(register):
    register("websocket", websocket_frontend, options=WebSocketFrontendOptions)
    register("openai", openai_frontend, options=OpenAIFrontendOptions)
