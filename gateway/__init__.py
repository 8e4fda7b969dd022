"""A resilience gateway for OpenAI-compatible LLM model backends."""

__version__ = "0.1.0"
