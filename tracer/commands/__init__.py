# Set by launch.py for `tracer record`/`demo` as root (not --help) before it imports cli: cli then registers the
# recording commands alone (the analyses' command modules cost half a second of imports before the probes are live).
RECORDING_ONLY = False
