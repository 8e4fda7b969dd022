"""The data plane's ASGI endpoint: request parsing, limits, header handling, relaying."""
