-- batch_feed: queue the next lines of a batch job, or write them off as error lines
-- (gateway/api/batch/jobs.py, JobStore.feed lays the call out).
--
-- KEYS[1] the job's hash   KEYS[2] its lines   KEYS[3] the request stream   KEYS[4] its outputs
-- KEYS[5] its written bitmap   KEYS[6...] the records of the 'R' items, in order
-- ARGV[1] the expected next_index   ARGV[2] lines consumed   ARGV[3] now   ARGV[4] record ttl (s)
-- ARGV[5] 'run' | 'end'   ARGV[6...] items:
--           'E', index, custom_id, output line            (a line refused: its error line)
--           'R', message, n, n field/value pairs           (one request: its record and entry)
-- One slot: the job's keys, its items' records and its partition's stream share its tag.
-- Returns 1, 2 when the job's last line is written, -1 when the job is not in that state,
-- -2 when another ingester moved first (next_index is a compare-and-set).
local status = redis.call('HGET', KEYS[1], 'status')
local ending = redis.call('HGET', KEYS[1], 'ending')
if ARGV[5] == 'run' and (status ~= 'in_progress' or ending) then return -1 end
if ARGV[5] == 'end' and not ending then return -1 end
if tonumber(redis.call('HGET', KEYS[1], 'next_index') or '0') ~= tonumber(ARGV[1]) then return -2 end
local failed = 0
local record = 5
local i = 6
while i <= #ARGV do
  if ARGV[i] == 'E' then
    if redis.call('SETBIT', KEYS[5], ARGV[i + 1], 1) == 0 then
      redis.call('XADD', KEYS[4], '*', 'index', ARGV[i + 1], 'custom_id', ARGV[i + 2], 'ok', '0',
                 'line', ARGV[i + 3])
      failed = failed + 1
    end
    i = i + 4
  else
    record = record + 1
    local key, n = KEYS[record], tonumber(ARGV[i + 2])
    redis.call('HSET', key, unpack(ARGV, i + 3, i + 2 + 2 * n))
    local entry = redis.call('XADD', KEYS[3], '*', 'm', ARGV[i + 1])
    redis.call('HSET', key, 'entry_id', entry)
    redis.call('EXPIRE', key, tonumber(ARGV[4]))
    i = i + 3 + 2 * n
  end
end
redis.call('LTRIM', KEYS[2], tonumber(ARGV[2]), -1)
redis.call('HINCRBY', KEYS[1], 'next_index', tonumber(ARGV[2]))
if failed > 0 then redis.call('HINCRBY', KEYS[1], 'failed', failed) end
{FINISH_CHECK}
return 1
