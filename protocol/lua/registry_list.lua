-- registry_list: the live members of one or more registries (protocol/registry.py). Members
-- whose heartbeat lapsed (score before the server's now) are removed first, so a registry holds
-- the live processes and those that died within one TTL, whatever the keyspace holds besides.
--
-- KEYS[1..n] registries (one slot: they share the {fleet} hash tag)
-- ARGV[1] the most members returned per registry (the soonest to lapse first)
-- Returns one list of members per key, in KEYS order.
local now = redis.call('TIME')
local cutoff = '(' .. string.format('%.6f', tonumber(now[1]) + tonumber(now[2]) / 1000000)
local limit = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', cutoff)
  out[i] = redis.call('ZRANGE', key, 0, limit - 1)
end
return out
