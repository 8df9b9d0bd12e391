"""Decoder strategies: how a batch becomes new tokens."""
