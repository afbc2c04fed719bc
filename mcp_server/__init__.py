"""MCP surface of cuda-host-tracer: tools over ``tracer.analysis`` (server.py), transports (http.py), auth."""
