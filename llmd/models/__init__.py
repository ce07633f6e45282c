"""Model folders llmd makes and reads: the tiny random-weight model used by tests, demos and vLLM's CPU build."""
