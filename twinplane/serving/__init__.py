"""The rollout plane over HTTP: an OpenAI-compatible server on the own engine, and per-episode sessions that own
their tokens (an agent's later turns extend the exact tokens of its earlier ones)."""
