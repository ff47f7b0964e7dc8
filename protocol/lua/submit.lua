-- submit: queue one request (gateway/serving/store.py, RequestStore._submit_call, lays the call out).
--
-- KEYS[1] the request's record (tf:res)       KEYS[2] the stream it queues in (its partition's)
-- KEYS[3] its Idempotency-Key's key (untouched without ARGV[4])
-- Routed to a replica (one server only: gateway/fleet/routing.py), 3 more:
-- KEYS[4] the replica's heartbeat   KEYS[5] its drain key   KEYS[6] its own stream
-- ARGV[1] the record's ttl (s)      ARGV[2] the request message
-- ARGV[3] the Idempotency-Key's value ('' = no key)      ARGV[4] the key's ttl (s)
-- ARGV[5...] the record's field/value pairs
-- Every key carries the request's partition tag: one slot. (The tenant set and the tenant's
-- lease live in the tenant's keys, on any shard: the gateway writes them around this call.)
--
-- The record is created in state "queued" *before* the entry exists (a poll never finds
-- nothing), and learns its entry id (a cancel before any scheduler took it removes the entry).
-- An Idempotency-Key another request holds queues nothing: returns {0, what the key maps to};
-- else {1, entry id}. A routed request goes to the replica's own stream only while its heartbeat
-- lives and no drain was asked for, checked here, atomically (nothing lands in a stream its
-- peers took over already); else to KEYS[2]. The record keeps a routed request's stream.
-- A request already queued (its record names its entry: the same call sent again after its reply
-- was lost, e.g. by a cluster client retrying through a failover) queues nothing more: {1, that
-- entry}, so a retried submit never makes a second entry of one request.
local queued = redis.call('HGET', KEYS[1], 'entry_id')
if queued then return {1, queued} end
if ARGV[3] ~= '' and not redis.call('SET', KEYS[3], ARGV[3], 'NX', 'EX', tonumber(ARGV[4])) then
  return {0, redis.call('GET', KEYS[3])}
end
local stream = KEYS[2]
if #KEYS == 6 and redis.call('EXISTS', KEYS[4]) == 1 and redis.call('EXISTS', KEYS[5]) == 0 then
  stream = KEYS[6]
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
local entry = redis.call('XADD', stream, '*', 'm', ARGV[2])
redis.call('HSET', KEYS[1], 'entry_id', entry)
if stream ~= KEYS[2] then redis.call('HSET', KEYS[1], 'stream', stream) end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return {1, entry}
