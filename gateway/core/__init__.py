"""Pure decision logic: no asyncio, no I/O, no clock reads (`now` and randomness are arguments)."""
