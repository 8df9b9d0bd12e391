"""The engine core: request lifecycle, hook specs, config, model runner and models."""
