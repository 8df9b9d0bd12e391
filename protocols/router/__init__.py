"""The data-parallel router: one WebSocket endpoint in front of several `tokenloom serve`
replicas, placing each request by prefix affinity and load (``policy.py``), relaying its
stream (``client.py``: the client side, ``upstream.py``: one replica) and taking a failed
replica out of rotation. Requests are admitted by the same gateway as a replica's."""
