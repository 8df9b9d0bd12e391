"""KV-cache managers: they own block ids; the runner owns the tensors."""
