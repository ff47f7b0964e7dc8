-- batch_commit: intake is done: the staged lines become the job's, the job starts, the entry
-- leaves tf:batch:in (gateway/batch/jobs.py, JobStore.commit).
--
-- KEYS[1] the job's hash   KEYS[2] its staging list   KEYS[3] its lines   KEYS[4] tf:batch:in
-- KEYS[5] the set of active jobs
-- ARGV[1] entry id   ARGV[2] total   ARGV[3] now   ARGV[4] job id   ARGV[5] expires_at
-- ARGV[6] the intake's token ('' when committed already)
-- One server only (batch jobs do not run on a Redis Cluster yet).
-- Returns 1 committed now, 0 committed before (the entry is acknowledged either way), -1 when
-- another intake holds the job now.
if redis.call('HGET', KEYS[1], 'committed') then
  redis.call('XACK', KEYS[4], '{GROUP}', ARGV[1])
  redis.call('XDEL', KEYS[4], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[1], 'intake_token') ~= ARGV[6] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[3]) end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' then status = 'in_progress' end
redis.call('HSET', KEYS[1], 'committed', 1, 'status', status, 'total', ARGV[2], 'next_index', 0,
           'completed', 0, 'failed', 0, 'in_progress_at', ARGV[3], 'expires_at', ARGV[5])
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('XACK', KEYS[4], '{GROUP}', ARGV[1])
redis.call('XDEL', KEYS[4], ARGV[1])
return 1
