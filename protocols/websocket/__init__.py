"""The WebSocket token stream: the server (``server.py``), one task pair per connection
(``connection.py``, ``outbound.py``), the wire format (``messages.py``), a Python client
(``client.py``) and the playground page (``static/``)."""
