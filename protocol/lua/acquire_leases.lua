-- acquire_leases: a tenant's concurrent-request leases (gateway/limits.py, TenantLimiter).
--
-- KEYS[1] the tenant's lease set (tf:tenant:{name}:leases: member req id, score its expiry)
-- ARGV[1] now   ARGV[2] when the new leases lapse   ARGV[3] the tenant's cap   ARGV[4...] req ids
-- One key: one slot.
-- Lapsed leases go first; then all of the call's requests get a lease, or none does.
-- Returns -1 when they got them, else how many the tenant holds.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held + #ARGV - 3 > tonumber(ARGV[3]) then return held end
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 1)
return -1
