"""keepstep.agent.telemetry: OpenTelemetry metrics and recovery traces from a node's events.

config    where telemetry goes, chosen once at the entry point
export    the one module that talks to telemetry backends
recovery  one node's view of a recovery, pieced together from its events
otel      events become metric points and span trees
"""
