-- finish_unclaimed: end a request nobody has claimed yet, in the gateway (cancel, or a passed
-- deadline): the record and event a scheduler would write, and the entry leaves the queue.
-- (gateway/serving/store.py, RequestStore.finish_unclaimed.) A scheduler that already read
-- the entry finds the terminal state on claim and just acks.
--
-- KEYS[1] the request's record      KEYS[2] the stream its entry is in (the record's `stream`
--                                    when it was routed, else its partition's stream)
-- ARGV[1] state   ARGV[2] finished_at   ARGV[3] error json   ARGV[4] events channel   ARGV[5] event
-- One slot: the record, the stream and the channel carry the request's partition tag.
-- Returns 1 when it ended the request here, 0 when a scheduler owns it or it is not queued.
if redis.call('HEXISTS', KEYS[1], 'owner') == 1 then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'finished_at', ARGV[2], 'error', ARGV[3], 'seq', 1)
redis.call('{PUBLISH}', ARGV[4], ARGV[5])
local entry = redis.call('HGET', KEYS[1], 'entry_id')
if entry then redis.call('XDEL', KEYS[2], entry) end
return 1
