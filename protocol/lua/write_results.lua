-- write_results: every update of one scheduler step to one partition's records, in one call
-- (service/result_store.py packs them: ResultStore.pack, and groups them by partition).
--
-- KEYS[2i-1] update i's record (tf:res)   KEYS[2i] the stream its entry is in
-- KEYS[2n+1] the batch notice stream (tf:batch:done), only when an update sends a notice
-- ARGV[1] owner      the scheduler writing; an update of a record another one owns is refused
-- ARGV[2] ttl        seconds the record lives after this write
-- ARGV[3] updates    msgpack list of n; each update is
--           u[1] event channel ('' = none)   u[2] event   u[3] entry id to acknowledge ('' = none)
--           u[4] 1: a batch notice on its first terminal write   u[5] notice req id   u[6] notice job id
--           u[7] seq of this update ('' = none)
--           u[8] [field, chunk, ...] to append   u[9] [field, value, ...] to set
-- One slot: the records, streams and channels carry one partition tag (the notice stream too,
-- on a cluster). The GROUP, TERMINAL and PUBLISH placeholders are filled in by the loader.
--
-- Per update: refused (0) when another scheduler owns the request; an update with appends whose
-- seq the record has reached landed already (a write retried after its reply was lost): neither
-- its appends, nor its sets, nor its event are done again. Its sets too: they hold its seq, and
-- setting it back would let the call's next update of the request append its chunk twice. A
-- batch notice goes out only on the first terminal write. An update with appends whose seq is
-- more than one past the record's finds a gap: the record lost writes its clients may have seen
-- (Redis came back from an append-only file without its last second), so nothing of it is done
-- and the caller sends the whole record instead of the chunk.
-- Returns, per update, 0 (refused), 1 (written), 2 (a gap: nothing written), or the tenant its
-- record names when the write acknowledged its entry: that request's tenant lease ends
-- (gateway/tenants/limits.py; the caller removes it, from the tenant's own key).
local owner = ARGV[1]
local ttl = tonumber(ARGV[2])
local updates = cmsgpack.unpack(ARGV[3])
local notices = KEYS[2 * #updates + 1]
local owned = {}
for i = 1, #updates do
  local u = updates[i]
  local key = KEYS[2 * i - 1]
  local current = redis.call('HGET', key, 'owner')
  local appends = u[8]
  local seq, stored = nil, nil  -- an update with appends: its seq, and the record's
  if #appends > 0 and u[7] ~= '' then
    seq = tonumber(u[7])
    stored = tonumber(redis.call('HGET', key, 'seq') or '0')
  end
  if current and current ~= owner then
    owned[i] = 0
  elseif seq and stored < seq - 1 then
    owned[i] = 2
  else
    owned[i] = 1
    local notify = false
    if u[4] == 1 then
      local state = redis.call('HGET', key, 'state')
      notify = not ({TERMINAL})
    end
    local applied = seq and stored >= seq
    if not applied then
      for j = 1, #appends, 2 do
        redis.call('HSET', key, appends[j], (redis.call('HGET', key, appends[j]) or '') .. appends[j + 1])
      end
      redis.call('HSET', key, 'owner', owner, unpack(u[9]))
      if u[1] ~= '' then redis.call('{PUBLISH}', u[1], u[2]) end
    end
    redis.call('EXPIRE', key, ttl)
    if u[3] ~= '' then
      redis.call('XACK', KEYS[2 * i], '{GROUP}', u[3])
      redis.call('XDEL', KEYS[2 * i], u[3])
      local tenant = redis.call('HGET', key, 'tenant')
      if tenant then owned[i] = tenant end
    end
    if notify then redis.call('XADD', notices, '*', 'req', u[5], 'job', u[6]) end
  end
end
return owned
