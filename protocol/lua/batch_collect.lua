-- batch_collect: write one line's output, once (gateway/api/batch/jobs.py, JobStore.collect).
--
-- KEYS[1] the job's hash   KEYS[2] its outputs   KEYS[3] its written bitmap
-- KEYS[4...] the line's request records (deleted: the output holds what they held)
-- ARGV[1] index   ARGV[2] custom_id   ARGV[3] now   ARGV[4] ok ('1' / '0')   ARGV[5] the output line
-- One slot: the job's keys and its items' records share its tag.
-- Returns 1 written, 0 written before, 2 written and it was the job's last line.
if redis.call('SETBIT', KEYS[3], ARGV[1], 1) == 1 then return 0 end
redis.call('XADD', KEYS[2], '*', 'index', ARGV[1], 'custom_id', ARGV[2], 'ok', ARGV[4], 'line', ARGV[5])
redis.call('HINCRBY', KEYS[1], ARGV[4] == '1' and 'completed' or 'failed', 1)
for k = 4, #KEYS do redis.call('DEL', KEYS[k]) end
{FINISH_CHECK}
return 1
