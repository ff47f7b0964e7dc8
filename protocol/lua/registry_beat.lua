-- registry_beat: a process says it is alive (protocol/registry.py). Its score is when it stops
-- counting as alive, in the Redis server's own clock, so that hosts whose clocks differ agree.
--
-- KEYS[1] the registry of its kind   ARGV[1] the process's id   ARGV[2] its heartbeat's TTL (s)
-- Returns the score written.
local now = redis.call('TIME')
local expiry = tonumber(now[1]) + tonumber(now[2]) / 1000000 + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
return string.format("%.6f", expiry)
