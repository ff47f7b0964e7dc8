-- batch_finish_check: a part of the scripts that write a batch job's outputs (batch_feed,
-- batch_collect), not a script of its own: when every line is written, the job is finalizing.
-- KEYS[1] the job's hash. ARGV[3] now. Returns 2 from the script when it moved the job.
local h = redis.call('HMGET', KEYS[1], 'total', 'next_index', 'completed', 'failed', 'status')
local total = tonumber(h[1] or '-1')
if total >= 0 and tonumber(h[2] or '0') >= total
   and tonumber(h[3] or '0') + tonumber(h[4] or '0') >= total
   and (h[5] == 'in_progress' or h[5] == 'cancelling') then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[3])
  return 2
end
