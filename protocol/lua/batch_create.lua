-- batch_create: a job submitted through the gateway or the CLI: its entry in tf:batch:in and its
-- record in validating, atomically, so it can be read back at once (JobStore.create).
--
-- KEYS[1] tf:batch:in   KEYS[2] the job's hash   KEYS[3] the jobs zset
-- ARGV[1] job id   ARGV[2] now   ARGV[3...] the entry's field/value pairs
-- One server only (batch jobs do not run on a Redis Cluster yet).
-- Returns the entry id, or false when the id is taken.
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
local entry = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], unpack(ARGV, 3))
redis.call('HSET', KEYS[2], 'id', ARGV[1], 'status', 'validating', 'created_at', ARGV[2], 'entry_id', entry)
for i = 3, #ARGV, 2 do
  if ARGV[i] ~= 'lines' then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return entry
