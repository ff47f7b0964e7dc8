-- batch_collect: write the outputs of some of a job's lines, each once (gateway/api/batch/jobs.py,
-- JobStore.collect): one call for a notice batch's lines, not one per line.
--
-- KEYS[1] the job's hash   KEYS[2] its outputs   KEYS[3] its written bitmap
-- KEYS[4...] the lines' request records, line after line (deleted: the output holds what they held)
-- ARGV[1] the number of lines   ARGV[2] (unused)   ARGV[3] now
-- ARGV[4...] per line: index, custom_id, ok ('1' / '0'), the output line, its number of records
-- One slot: the job's keys and its items' records share its tag.
-- Returns per line 1 written or 0 written before, then 2 if the job's last line was written, else 0.
local function finish_check()
{FINISH_CHECK}
  return 0
end
local answers = {}
local k, a = 4, 4
for i = 1, tonumber(ARGV[1]) do
  local index, ok, n = ARGV[a], ARGV[a + 2], tonumber(ARGV[a + 4])
  if redis.call('SETBIT', KEYS[3], index, 1) == 1 then
    answers[i] = 0
  else
    redis.call('XADD', KEYS[2], '*', 'index', index, 'custom_id', ARGV[a + 1], 'ok', ok, 'line', ARGV[a + 3])
    redis.call('HINCRBY', KEYS[1], ok == '1' and 'completed' or 'failed', 1)
    for r = k, k + n - 1 do redis.call('DEL', KEYS[r]) end
    answers[i] = 1
  end
  k, a = k + n, a + 5
end
answers[#answers + 1] = finish_check()
return answers
