"""What every Ferry service shares: configuration, sampling parameters, telemetry, TLS and cluster auth.

Imports nothing of Ferry's but the wire contract (protos/); the services sit above it, the apps above them.
"""
