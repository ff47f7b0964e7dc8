-- keep_size: a finished job's result file never changes: its size is kept in the job's hash (if
-- the hash is still there) so that a list does not read every job's output again
-- (gateway/api/batch/files_api.py).
--
-- KEYS[1] the job's hash   ARGV[1] the size's field   ARGV[2] the size (bytes)
-- One key: one slot. Returns nothing.
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
