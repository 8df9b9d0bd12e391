"""User-facing surfaces: the CLI (and, later, the WebSocket server and its client)."""
