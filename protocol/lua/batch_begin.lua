-- batch_begin: an entry's intake starts: the job's record in validating unless it exists, in one
-- step, so no reader ever sees half a record (gateway/api/batch/jobs.py, JobStore.begin, which then
-- lists the job and maps the entry to it: the fleet's shared keys, idempotent commands).
--
-- KEYS[1] the job's hash
-- ARGV[1] job id   ARGV[2] now   ARGV[3] entry id   ARGV[4] the intake's token
-- ARGV[5...] the entry's described field/value pairs
-- One key: one slot. Returns 1 when it made the record, 0 when the job existed.
if redis.call('HSETNX', KEYS[1], 'id', ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'validating', 'created_at', ARGV[2], 'entry_id', ARGV[3],
           'intake_token', ARGV[4], unpack(ARGV, 5))
return 1
