"""Schedulers: which sequences run each step, under which token budget."""
