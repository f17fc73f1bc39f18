"""The jobs behind `generate`, `chat`, `eval` and `trace-summary`: what they run and the figures they print."""
