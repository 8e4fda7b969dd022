"""A fake vLLM (OpenAI-compatible) backend with faults switchable at run time over HTTP.

It also serves the Anthropic Messages API (`POST /v1/messages`, see `anthropic.py`).

Run it with `python -m loadtests.fake_vllm --port 0 ...`; it prints
`fake-vllm READY name=<name> port=<port>` once serving. See `app.py` for the endpoints.
"""

from .app import FakeVllm, build_app
from .config import FakeConfig, Faults

__all__ = ["FakeConfig", "FakeVllm", "Faults", "build_app"]
