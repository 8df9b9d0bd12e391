"""The OpenAI-compatible HTTP API: request structs and response shapes (``schema.py``), the
Starlette app on uvicorn (``server.py``), the key/Origin middleware and error bodies
(``rules.py``) and a request's answer, whole or streamed as server-sent events (``answer.py``)."""
