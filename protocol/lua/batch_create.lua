-- batch_create: the record of a job submitted through the gateway or the CLI, in validating, so
-- it can be read back at once (gateway/api/batch/jobs.py, JobStore.create: its entry was just added
-- to tf:batch:in, the fleet's shared stream; an intake that got there first made the record
-- itself, from the same entry, and this one keeps it).
--
-- KEYS[1] the job's hash
-- ARGV[1] job id   ARGV[2] now   ARGV[3] entry id   ARGV[4...] the entry's field/value pairs
-- One key: one slot. Returns 1 when the record is this entry's, 0 when another entry's job has
-- the id.
local entry = redis.call('HGET', KEYS[1], 'entry_id')
if entry and entry ~= ARGV[3] then return 0 end
if not entry then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'status', 'validating', 'created_at', ARGV[2], 'entry_id', ARGV[3])
  for i = 4, #ARGV, 2 do
    if ARGV[i] ~= 'lines' then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
  end
end
return 1
