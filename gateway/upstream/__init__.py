"""Backend instances: their runtime state and the transport that talks to them."""
