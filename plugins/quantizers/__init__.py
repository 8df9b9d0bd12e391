"""Weight quantizers: primitives, offline algorithms, runtime weight objects."""
