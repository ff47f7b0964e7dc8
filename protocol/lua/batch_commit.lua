-- batch_commit: intake is done: the staged lines become the job's and the job starts
-- (gateway/api/batch/jobs.py, JobStore.commit, which then lists it as active and acknowledges its
-- entry in tf:batch:in: those are the fleet's shared keys, on any shard).
--
-- KEYS[1] the job's hash   KEYS[2] its staging list   KEYS[3] its lines   (one slot: the job's)
-- ARGV[1] total   ARGV[2] now   ARGV[3] expires_at   ARGV[4] the intake's token
-- Returns 1 committed now, 0 committed before and still running, 2 committed before and over,
-- -1 when another intake holds the job now.
if redis.call('HGET', KEYS[1], 'committed') then
  local status = redis.call('HGET', KEYS[1], 'status')
  if status == 'in_progress' or status == 'cancelling' or status == 'finalizing' then return 0 end
  return 2
end
if redis.call('HGET', KEYS[1], 'intake_token') ~= ARGV[4] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[3]) end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' then status = 'in_progress' end
redis.call('HSET', KEYS[1], 'committed', 1, 'status', status, 'total', ARGV[1], 'next_index', 0,
           'completed', 0, 'failed', 0, 'in_progress_at', ARGV[2], 'expires_at', ARGV[3])
return 1
