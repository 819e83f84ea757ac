"""Per-key token buckets and concurrency slots shared by every gateway process via Redis.

Each check is one Lua script (atomic on the server, one round trip) and uses the Redis
server's clock, so pods with skewed clocks still agree.  Concurrency slots are members of a
sorted set scored by a lease expiry: a gateway that dies holding slots frees them when the
lease runs out (``limits.concurrency_lease_s``) instead of leaking them forever.
"""

from __future__ import annotations

from typing import Any

_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1])
local at = tonumber(state[2])
if tokens == nil or at == nil then
  tokens = burst
  at = now
end
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""

_ACQUIRE = """
local limit = tonumber(ARGV[1])
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= limit then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(lease) + 1)
return 1
"""


class RedisLimits:
    """The shared store; every method raises on a Redis failure (the caller falls back)."""

    def __init__(self, redis: Any, prefix: str, lease_s: float) -> None:
        self.redis = redis
        self.prefix = prefix
        self.lease_s = lease_s
        self._bucket = redis.register_script(_BUCKET)
        self._acquire = redis.register_script(_ACQUIRE)

    async def load_scripts(self) -> None:
        """Load both scripts now, so a request's first check is one EVALSHA round trip (not a
        NOSCRIPT reply, then EVAL) within its short bound."""
        for script in (self._bucket, self._acquire):
            await self.redis.script_load(script.script)

    async def take(self, key: str, rate: float, burst: float) -> float:
        """0.0 when admitted, else the seconds until a token is available."""
        wait = await self._bucket(keys=[f"{self.prefix}rate:{key}"], args=[repr(rate), repr(burst)])
        return float(wait)

    async def acquire(self, key: str, limit: int, ticket: str) -> bool:
        ok = await self._acquire(keys=[f"{self.prefix}conc:{key}"], args=[limit, ticket, repr(self.lease_s)])
        return bool(int(ok))

    async def release(self, key: str, ticket: str) -> None:
        await self.redis.zrem(f"{self.prefix}conc:{key}", ticket)
