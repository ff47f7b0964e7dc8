-- acquire_leases: a tenant's concurrent-request leases (gateway/tenants/limits.py, TenantLimiter).
--
-- KEYS[1] the tenant's lease set (tf:tenant:{name}:leases: member req id, score its expiry)
-- ARGV[1] now   ARGV[2] when the new leases lapse   ARGV[3] the tenant's cap   ARGV[4...] req ids
-- One key: one slot.
-- Lapsed leases go first; then all of the call's requests get a lease, or none does.
-- The set's TTL always reaches past its latest lease (never cut to the new, short ones: leases
-- renewed for their full term by extend_leases.lua would be lost with the set). It is counted
-- from ARGV's `now`, the clock the scores are on, not from Redis's.
-- Returns -1 when they got them, else how many the tenant holds.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held + #ARGV - 3 > tonumber(ARGV[3]) then return held end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i]) end
local latest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(latest) - tonumber(ARGV[1])) + 1)
return -1
