"""A real inference engine for tests and load tests: llama.cpp's server (`make engine`) running a
small generated model.

`model.model_path("tiny" | "slow")` gives a cached GGUF file; `server.start_engine(path, ...)`
runs llama-server on a loopback port and returns an `Engine` (url, stop, kill, freeze, thaw).
"""
