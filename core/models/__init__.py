"""Model definitions. The model calls the backend for every hot op."""
