-- batch_finalize: the last step of a job: its end state, and its working keys go
-- (gateway/api/batch/jobs.py, JobStore.finalize, which then takes it out of the active set: a
-- shared key; the ingesters' maintenance also unlists an active job that is over).
--
-- KEYS[1] the job's hash   KEYS[2] its lines   KEYS[3] its written bitmap   (one slot: the job's)
-- ARGV[1] now
-- Returns 1 when it ended the job, 0 when the job is not finalizing.
if redis.call('HGET', KEYS[1], 'status') ~= 'finalizing' then return 0 end
local final = redis.call('HGET', KEYS[1], 'ending') or 'completed'
redis.call('HSET', KEYS[1], 'status', final, final .. '_at', ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
