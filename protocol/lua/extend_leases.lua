-- extend_leases: a queued request's tenant lease lasts its full term (gateway/serving/store.py).
--
-- KEYS[1] the tenant's lease set (tf:tenant:{name}:leases: member req id, score its expiry)
-- ARGV[1] now   ARGV[2] when the leases lapse   ARGV[3...] req ids
-- One key: one slot.
-- Only a lease still held is renewed (ZADD XX: a fast terminal write may have ended it), and the
-- set's TTL is pushed past its latest lease (counted from `now`, the scores' clock), so that
-- the set never expires with leases in it.
-- Returns how many leases were renewed.
local renewed = 0
for i = 3, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[i])
    renewed = renewed + 1
  end
end
if renewed > 0 then
  local latest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
  redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(latest) - tonumber(ARGV[1])) + 1)
end
return renewed
