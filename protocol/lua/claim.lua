-- claim: a scheduler becomes the owner of requests it admits and reads what was delivered
-- before, and reads their cancel flags (service/result_store.py, ResultStore.claim_many).
--
-- KEYS[1..n] the requests' records   KEYS[n+1..] cancel flags to look at
-- ARGV[1] owner   ARGV[2] the records' ttl (s)   ARGV[3] n
-- One slot: the caller makes one call per partition.
-- Returns {record 1 as HGETALL's flat list, ..., record n, exists flag 1, ...}.
local n = tonumber(ARGV[3])
local out = {}
for i = 1, n do
  out[i] = redis.call('HGETALL', KEYS[i])
  redis.call('HSET', KEYS[i], 'owner', ARGV[1])
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[2]))
end
for i = n + 1, #KEYS do out[i] = redis.call('EXISTS', KEYS[i]) end
return out
