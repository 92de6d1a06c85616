-- The shared in-flight ledger of one backend: each replica holds one lease on it, its grant
-- of the backend's tokens, and admits its own requests within that grant without a call.
-- Timed by Redis TIME so replicas with disagreeing clocks still agree.
--
-- KEYS[1] leases: ZSET replica -> expiry (ms, Redis time)
-- KEYS[2] tokens: HASH replica -> tokens granted (what counts against the limit)
-- KEYS[3] usage:  HASH replica -> "<tokens> <sessions>" its admitted requests hold
-- KEYS[4] meta:   HASH seq (bumped on every change), wanted (ms until which an ask Redis
--                 refused wants room: no replica is granted spare tokens meanwhile)
-- The four keys share the backend's hash tag, so the script also runs on Redis Cluster.
--
-- ARGV[1] op: "size" | "release" | "peek"
-- ARGV[2] channel releases are published on, ARGV[3] the calling replica,
-- ARGV[4] the backend's name, ARGV[5] lease TTL in ms
-- size: ARGV[6] tokens and ARGV[7] sessions the replica's admitted requests hold (taken as
--       they are, past any limit: those requests run already), ARGV[8] the limit spare
--       tokens are granted under, ARGV[9] the spare's share of the free room in 1/1000,
--       ARGV[10] how long a refusal wants room (ms), ARGV[11..] asks: tokens, limit, ...
--       An ask is admitted if the other replicas' grants, this replica's requests, the
--       asks admitted before it and the ask itself fit under its limit. The grant becomes
--       what its requests hold plus a spare share of the room left; with no session,
--       nothing: the lease goes. A lease the store lost (expired, or a restart) comes
--       back this way.
-- release: the replica's lease goes.
--
-- Every call first drops expired leases (a crashed replica's) and then counts from the live
-- ones, so no total can drift. Capacity given back is published as
-- "<replica> <released> <expired> <tokens> <sessions> <seq> <backend>": `released` by the
-- calling replica's smaller grant, `expired` from leases whose holder stopped renewing them,
-- then what the backend's requests hold in all. A refusal while other grants hold spare is
-- published too, with nothing released or expired: those replicas give their spare back.
-- Reply: {admitted ("1"/"0" per ask), grant, tokens, sessions, seq, granted in all, restored,
-- wanted (1 while a refusal withholds every spare)}.

local leases, tokens, usage, meta = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, channel, replica, backend = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl = tonumber(ARGV[5])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local function forget(id)
  redis.call('ZREM', leases, id)
  redis.call('HDEL', tokens, id)
  redis.call('HDEL', usage, id)
end

local expired = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
  expired = expired + (tonumber(redis.call('HGET', tokens, id)) or 0)
  forget(id)
end

-- what every live lease is granted and holds; strays (a field without its lease) go
local granted, held, sessions = 0, 0, 0
local live = {}
for _, id in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
  local g = tonumber(redis.call('HGET', tokens, id))
  if g == nil then
    forget(id)
  else
    live[id] = true
    granted = granted + g
    local t, s = string.match(redis.call('HGET', usage, id) or '', '^(%d+) (%d+)$')
    held = held + (tonumber(t) or 0)
    sessions = sessions + (tonumber(s) or 0)
  end
end
for _, key in ipairs({tokens, usage}) do
  for _, id in ipairs(redis.call('HKEYS', key)) do
    if not live[id] then
      redis.call('HDEL', key, id)
    end
  end
end

local had = tonumber(redis.call('HGET', tokens, replica))
local had_held, had_sessions = 0, 0
if had ~= nil then
  local t, s = string.match(redis.call('HGET', usage, replica) or '', '^(%d+) (%d+)$')
  had_held, had_sessions = tonumber(t) or 0, tonumber(s) or 0
end
local others = granted - (had or 0)
local others_held = held - had_held
local flags, grant, restored = '', had or 0, 0
local changed = expired > 0
local wanted = false

if op == 'size' then
  local need, count = tonumber(ARGV[6]), tonumber(ARGV[7])
  local limit, spare, want_ms = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  for i = 11, #ARGV, 2 do
    local t = tonumber(ARGV[i])
    if others + need + t <= tonumber(ARGV[i + 1]) then
      need, count = need + t, count + 1
      flags = flags .. '1'
    else
      flags = flags .. '0'
      redis.call('HSET', meta, 'wanted', now + want_ms)
      wanted = true
    end
  end
  if had == nil and tonumber(ARGV[6]) > 0 then
    restored = 1
  end
  if count == 0 then
    grant = 0
    if had ~= nil then
      forget(replica)
    end
  else
    if (tonumber(redis.call('HGET', meta, 'wanted')) or 0) > now then
      spare = 0
    end
    grant = need + math.floor(math.max(0, limit - others - need) * spare / 1000)
    redis.call('ZADD', leases, now + ttl, replica)
    redis.call('HSET', tokens, replica, grant)
    redis.call('HSET', usage, replica, need .. ' ' .. count)
  end
  granted = others + grant
  held, sessions = held - had_held + need, sessions - had_sessions + count
  changed = changed or grant ~= (had or 0) or need ~= had_held or count ~= had_sessions
elseif op == 'release' then
  if had ~= nil then
    forget(replica)
    grant, granted = 0, others
    held, sessions = held - had_held, sessions - had_sessions
    changed = true
  end
end

local released = math.max(0, (had or 0) - grant)
local seq = tonumber(redis.call('HGET', meta, 'seq')) or 0
if changed then
  seq = redis.call('HINCRBY', meta, 'seq', 1)
end
if op == 'size' or changed then
  -- the keys outlive the last lease by one TTL; absent keys mean an idle backend
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
  local until_ms = now + ttl
  if #last == 2 then
    until_ms = math.max(until_ms, tonumber(last[2]))
  end
  for _, key in ipairs({leases, tokens, usage, meta}) do
    redis.call('PEXPIREAT', key, until_ms + ttl)
  end
end
local function publish(given, lapsed)
  redis.call('PUBLISH', channel, string.format(
    '%s %d %d %d %d %d %s', replica, given, lapsed, held, sessions, seq, backend))
end
if released + expired > 0 then
  publish(released, expired)
end
if wanted and others > others_held then
  publish(0, 0)  -- nothing given back: a refusal while other grants hold spare
end

local withheld = 0
if (tonumber(redis.call('HGET', meta, 'wanted')) or 0) > now then
  withheld = 1
end
return {flags, grant, held, sessions, seq, granted, restored, withheld}
