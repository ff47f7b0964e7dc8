-- batch_refuse: a job that intake refused (gateway/api/batch/jobs.py, JobStore.refuse, which then
-- acknowledges its entry in tf:batch:in).
--
-- KEYS[1] the job's hash
-- ARGV[1] now   ARGV[2] the errors (json)
-- One key: one slot. Returns 1.
redis.call('HSET', KEYS[1], 'status', 'failed', 'failed_at', ARGV[1], 'errors', ARGV[2], 'committed', 1,
           'total', 0, 'completed', 0, 'failed', 0)
return 1
