-- batch_finalize: the last step of a job: its end state, and its working keys go
-- (gateway/batch/jobs.py, JobStore.finalize).
--
-- KEYS[1] the job's hash   KEYS[2] its lines   KEYS[3] its written bitmap   KEYS[4] the active set
-- ARGV[1] job id   ARGV[2] now
-- One server only (batch jobs do not run on a Redis Cluster yet).
-- Returns 1 when it ended the job, 0 when the job is not finalizing.
if redis.call('HGET', KEYS[1], 'status') ~= 'finalizing' then return 0 end
local final = redis.call('HGET', KEYS[1], 'ending') or 'completed'
redis.call('HSET', KEYS[1], 'status', final, final .. '_at', ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
