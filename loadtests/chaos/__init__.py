"""Chaos tooling: ways to degrade the network and processes around the gateway under load."""
