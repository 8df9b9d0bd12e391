"""Adapter plugins (the ``adapter`` role): low-rank updates over the base model, per request."""
