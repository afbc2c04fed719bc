# Set by launch.py before it imports cli, for a command whose start-up matters: cli then registers only that
# command's group (the analyses' command modules cost half a second of imports). "record": `tracer record`/`demo`
# as root (not --help), before the probes are live; "dump": `tracer dump`, which a user runs on a hung job and
# expects at once (issue 29: under 1 s). None: every command.
ONLY: str | None = None
