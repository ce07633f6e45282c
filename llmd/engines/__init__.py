"""Engines: the vLLM server processes llmd launches, and the simulated engine that speaks vLLM's API and events."""
