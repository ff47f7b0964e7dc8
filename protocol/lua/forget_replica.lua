-- forget_replica: a dead peer's own stream goes once nothing is left in it, unless its owner
-- came back meanwhile (service/replica_streams.py). Routing by prefix runs on one server only
-- (protocol/keys.py, replica_stream), so these keys need not share a slot.
--
-- KEYS[1] the peer's heartbeat   KEYS[2] its own stream   KEYS[3] the model's set of routed ids
-- ARGV[1] the peer's id
-- Returns 1 when the stream was deleted and the peer unlisted, else 0.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('XLEN', KEYS[2]) > 0 then return 0 end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
