"""The ways in: one sub-package per frontend -- ``websocket`` (the token stream and the
playground), ``openai`` (the OpenAI-compatible HTTP API) -- and ``router`` (data-parallel
serving over several replicas). What they share sits beside them: ``gateway.py`` (admission:
API key, Origin list, queue and connection limits, draining), ``http.py`` (the small HTTP
responses the WebSocket server and the router answer themselves), ``metrics.py`` and
``ratelimit.py``; ``frontends.py`` registers the built-in frontends."""
