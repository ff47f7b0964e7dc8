-- batch_refuse: a job that intake refused (gateway/batch/jobs.py, JobStore.refuse).
--
-- KEYS[1] the job's hash   KEYS[2] tf:batch:in
-- ARGV[1] entry id   ARGV[2] now   ARGV[3] the errors (json)
-- One server only (batch jobs do not run on a Redis Cluster yet). Returns 1.
redis.call('HSET', KEYS[1], 'status', 'failed', 'failed_at', ARGV[2], 'errors', ARGV[3], 'committed', 1,
           'total', 0, 'completed', 0, 'failed', 0)
redis.call('XACK', KEYS[2], '{GROUP}', ARGV[1])
redis.call('XDEL', KEYS[2], ARGV[1])
return 1
