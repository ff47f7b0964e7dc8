-- write_results: every update of one scheduler step, in one call (service/result_store.py packs them).
--
-- KEYS: none declared (on a Redis Cluster a step's updates would be split by hash slot first).
-- ARGV[1] owner      the scheduler writing; an update of a record another one owns is refused
-- ARGV[2] ttl        seconds the record lives after this write
-- ARGV[3] updates    msgpack list; each update is
--           u[1] result key          u[2] request stream     u[3] event channel ('' = none)
--           u[4] event               u[5] entry id to acknowledge ('' = none)
--           u[6] notice stream ('' = none)   u[7] notice req id   u[8] notice job id
--           u[9] seq of this update ('' = none)
--           u[10] [field, chunk, ...] to append   u[11] [field, value, ...] to set
-- ARGV[4], ARGV[5] the tenant lease key around its tenant (before, after)
-- ARGV[6] the result key less its req id
-- The GROUP and TERMINAL placeholders are filled in by the loader (protocol/lua/__init__.py).
--
-- Per update: refused (0) when another scheduler owns the request; the appends are skipped when
-- the record's seq has reached this update's (a write retried after a lost connection must not
-- append a chunk twice); a batch notice goes out only on the first terminal write. A terminal
-- write also ends the request's tenant lease (gateway/limits.py), when its record names a tenant.
-- Returns the 0/1 of each update.
local owner = ARGV[1]
local ttl = tonumber(ARGV[2])
local updates = cmsgpack.unpack(ARGV[3])
local owned = {}
for i = 1, #updates do
  local u = updates[i]
  local key = u[1]
  local current = redis.call('HGET', key, 'owner')
  if current and current ~= owner then
    owned[i] = 0
  else
    local notify = false
    if u[6] ~= '' then
      local state = redis.call('HGET', key, 'state')
      notify = not ({TERMINAL})
    end
    local appends = u[10]
    if #appends > 0 then
      local applied = u[9] ~= '' and tonumber(redis.call('HGET', key, 'seq') or '0') >= tonumber(u[9])
      if not applied then
        for j = 1, #appends, 2 do
          redis.call('HSET', key, appends[j], (redis.call('HGET', key, appends[j]) or '') .. appends[j + 1])
        end
      end
    end
    redis.call('HSET', key, 'owner', owner, unpack(u[11]))
    redis.call('EXPIRE', key, ttl)
    if u[3] ~= '' then redis.call('PUBLISH', u[3], u[4]) end
    if u[5] ~= '' then
      redis.call('XACK', u[2], '{GROUP}', u[5])
      redis.call('XDEL', u[2], u[5])
      local tenant = redis.call('HGET', key, 'tenant')
      if tenant then  -- the request's lease on its tenant's concurrency ends with it
        redis.call('ZREM', ARGV[4] .. tenant .. ARGV[5], string.sub(key, #ARGV[6] + 1))
      end
    end
    if notify then redis.call('XADD', u[6], '*', 'req', u[7], 'job', u[8]) end
    owned[i] = 1
  end
end
return owned
