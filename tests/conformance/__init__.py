"""Conformance scenarios for the data plane's HTTP/1.1 client against scripted raw upstreams."""
