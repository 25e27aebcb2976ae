"""The remote-tier tests' Redis servers: the same local cluster / single server ``kvflow bench shared`` starts."""

from kvflow.bench.redis_local import RedisProcs, free_ports, redis_available

__all__ = ["RedisProcs", "free_ports", "redis_available"]
