-- batch_stop: stop a job (gateway/api/batch/jobs.py, JobStore.stop).
--
-- KEYS[1] the job's hash
-- ARGV[1] 'cancelled' (a client asked) or 'expired'   ARGV[2] now
-- One key: one slot. Returns 1 when it stopped the job, 0 when it was ending or over already.
local status = redis.call('HGET', KEYS[1], 'status')
if redis.call('HGET', KEYS[1], 'ending') then return 0 end
if status ~= 'validating' and status ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'ending', ARGV[1])
if ARGV[1] == 'cancelled' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
end
return 1
