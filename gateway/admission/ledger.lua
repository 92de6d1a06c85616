-- The shared in-flight ledger of one backend: one atomic call per reserve, release, renew
-- or peek, timed by Redis TIME so replicas with disagreeing clocks still agree.
--
-- KEYS[1] leases: ZSET lease id -> expiry (ms, Redis time)
-- KEYS[2] tokens: HASH lease id -> tokens reserved
-- KEYS[3] meta:   HASH total (tokens of the live leases), seq (bumped on every change)
-- The three keys share the backend's hash tag, so the script also runs on Redis Cluster.
--
-- ARGV[1] op: "reserve" | "release" | "renew" | "peek"
-- ARGV[2] channel releases are published on, ARGV[3] the calling replica,
-- ARGV[4] the backend's name, ARGV[5] lease TTL in ms
-- reserve: ARGV[6] lease id, ARGV[7] tokens, ARGV[8] limit
-- release: ARGV[6] lease id
-- renew:   ARGV[6..] lease id, tokens, ...: the leases the replica still holds; any the
--          ledger lost (expired while the replica stalled, or Redis restarted) are restored,
--          and a lease holding fewer tokens than the replica says (its answer outgrew the
--          reservation: the replica extended it) is raised to its figure, past any limit
--
-- Every call first drops expired leases (a crashed replica's). Reserve and release then check
-- that `total` is in step with the live leases (recounting when it is missing, negative, or
-- the leases and their tokens disagree); renew and peek, which every replica sends every
-- refresh, always recount it from the leases. So the count can neither drift nor go negative. Capacity given back is published as
-- "<replica> <released> <expired> <total> <sessions> <seq> <backend>": `released` by the
-- calling replica's release, `expired` from leases whose holder stopped renewing them.
-- Reply: {status, total, sessions, seq, restored lease ids...}; status 1 when a reserve was
-- admitted or a release freed something.

local leases, tokens, meta = KEYS[1], KEYS[2], KEYS[3]
local op, channel, replica, backend = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl = tonumber(ARGV[5])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local function purge()
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  local freed = 0
  for _, id in ipairs(expired) do
    freed = freed + (tonumber(redis.call('HGET', tokens, id)) or 0)
    redis.call('HDEL', tokens, id)
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  end
  return freed
end

local function recount()
  local sum, live = 0, {}
  for _, id in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
    local t = tonumber(redis.call('HGET', tokens, id))
    if t == nil then
      redis.call('ZREM', leases, id)
    else
      sum = sum + t
      live[id] = true
    end
  end
  for _, id in ipairs(redis.call('HKEYS', tokens)) do
    if not live[id] then
      redis.call('HDEL', tokens, id)
    end
  end
  return sum
end

local function reconciled(total)
  local n = redis.call('ZCARD', leases)
  if n == 0 then
    redis.call('DEL', tokens)
    return 0
  end
  if total == nil or total < 0 or redis.call('HLEN', tokens) ~= n then
    return recount()
  end
  return total
end

local saved = tonumber(redis.call('HGET', meta, 'total'))
local expired = purge()
local released = 0
local total
if op == 'renew' or op == 'peek' then
  total = recount()
else
  total = reconciled(saved and (saved - expired))
end
local changed = expired > 0 or total ~= (saved or 0)
local status = 0
local restored = {}

local function add(id, t)
  redis.call('ZADD', leases, now + ttl, id)
  redis.call('HSET', tokens, id, t)
  total = total + t
  changed = true
end

if op == 'reserve' then
  local t, limit = tonumber(ARGV[7]), tonumber(ARGV[8])
  if redis.call('ZSCORE', leases, ARGV[6]) then
    status = 1
  elseif total + t <= limit then
    add(ARGV[6], t)
    status = 1
  end
elseif op == 'release' then
  local t = tonumber(redis.call('HGET', tokens, ARGV[6]))
  if t ~= nil then
    redis.call('HDEL', tokens, ARGV[6])
    redis.call('ZREM', leases, ARGV[6])
    total = total - t
    released = t
    changed = true
    status = 1
  end
elseif op == 'renew' then
  for i = 6, #ARGV, 2 do
    local id = ARGV[i]
    if redis.call('ZSCORE', leases, id) then
      redis.call('ZADD', leases, now + ttl, id)
      local had, t = tonumber(redis.call('HGET', tokens, id)) or 0, tonumber(ARGV[i + 1])
      if t > had then
        redis.call('HSET', tokens, id, t)
        total = total + t - had
        changed = true
      end
    else
      add(id, tonumber(ARGV[i + 1]))
      restored[#restored + 1] = id
    end
  end
end

local sessions = redis.call('ZCARD', leases)
local seq = tonumber(redis.call('HGET', meta, 'seq')) or 0
if changed then
  seq = redis.call('HINCRBY', meta, 'seq', 1)
  redis.call('HSET', meta, 'total', total)
end
if op == 'reserve' or op == 'renew' or changed then
  -- the keys outlive the last lease by one TTL; absent keys mean an idle backend
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
  local until_ms = now + ttl
  if #last == 2 then
    until_ms = math.max(until_ms, tonumber(last[2]))
  end
  for _, key in ipairs({leases, tokens, meta}) do
    redis.call('PEXPIREAT', key, until_ms + ttl)
  end
end
if released + expired > 0 then
  redis.call('PUBLISH', channel, string.format(
    '%s %d %d %d %d %d %s', replica, released, expired, total, sessions, seq, backend))
end

local reply = {status, total, sessions, seq}
for _, id in ipairs(restored) do
  reply[#reply + 1] = id
end
return reply
