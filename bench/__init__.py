"""`tokenloom bench`: offline strategy comparisons, decode speed against the memory floor,
quantisers, speculative decoders, prefix caching, latency targets, peers and the served soak.
``cli.py`` wires the sub-commands; each has a module with ``run_*`` and ``format_*``."""
