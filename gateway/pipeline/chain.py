"""Binding the pipeline's layers to each other, once: the order, and why, is
`gateway.request_path`'s."""

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
