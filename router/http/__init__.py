"""The HTTP data plane: the ASGI server, the proxy fast path, the upstream client and
every reply the router sends."""
