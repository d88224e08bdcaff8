"""Networking every role shares: ZeroMQ sockets, CURVE keys, connection caps, the scheduler link, /metrics."""
