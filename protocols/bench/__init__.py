"""`tokenloom bench`: offline strategy comparisons, batch decode speed vs the memory floor."""
