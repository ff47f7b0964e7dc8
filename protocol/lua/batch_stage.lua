-- batch_stage: an intake's lines go to the job's staging list, fenced by the intake's token: an
-- intake that another ingester took over (its claim lapsed) finds its token replaced and stops,
-- so two intakes never interleave their lines (gateway/api/batch/jobs.py, JobStore.stage).
--
-- KEYS[1] the job's hash   KEYS[2] its staging list
-- ARGV[1] the intake's token   ARGV[2] '1' to start the list over   ARGV[3...] the packed lines
-- One slot: the job's. Returns -1 when the intake is no longer this token's, else the list's length
-- (0: no lines).
if redis.call('HGET', KEYS[1], 'intake_token') ~= ARGV[1] then return -1 end
if ARGV[2] == '1' then redis.call('DEL', KEYS[2]) end
if #ARGV > 2 then return redis.call('RPUSH', KEYS[2], unpack(ARGV, 3)) end
return 0
