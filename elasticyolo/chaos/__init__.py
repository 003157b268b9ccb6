"""Chaos tooling: replay a real spot-capacity trace against a local cluster and measure goodput.

`trace` parses and validates a trace, `schedule` maps a window of it to kills/notices/joins (pure),
`runner` applies a schedule to real agents, `measure` reads the workers' traces, `projection`
applies the measured per-event costs to the whole trace uncompressed, `plot` draws the timeline.
"""
