"""Composition of the request pipeline, in one place.

Order, outermost first (each layer wraps everything after it):
  retry     - the retry loop, per client request; every attempt below re-runs what follows
  pick      - chooses the instance for the attempt (round robin, skipping tried and paused ones)
  account   - counts the attempt against its instance and pool when it ends
  deadline  - sets the attempt's timeouts from the instance's latency prediction
  transport - sends the attempt and reads up to the first byte (terminal)

Retries wrap `pick` so every attempt re-picks; the deadline sits inside the retry loop, so it
bounds one attempt; accounting wraps the deadline, so a timed-out attempt is counted too.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from gateway.pipeline.call import Handler, Layer


def compose(layers: Sequence[Layer], terminal: Handler) -> Handler:
    """`layers[0]` runs first and calls the next one; the last calls `terminal`.

    Built once at startup; each layer is bound to its successor with `partial`, so a request
    pays one call per layer and nothing more.
    """
    handler = terminal
    for layer in reversed(layers):
        handler = partial(layer, next_handler=handler)
    return handler
