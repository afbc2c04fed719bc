"""MCP surface of cuda-host-tracer: ``build_server`` (server.py) over the tools in ``tools/`` (thin views over
``tracer.analysis``, reading the server's state, state.py, through their Context), transports (http.py), auth."""
