-- One rate-limit decision for one tenant, atomic inside Redis, timed by Redis TIME.
-- The same arithmetic as gateway/ratelimit/bucket.py; keep the two in step.
--
-- KEYS[1] the request bucket, KEYS[2] the token bucket: hashes {level, at}, same hash tag.
-- KEYS[3], for "acquire" and "refund": the decision's id key (same hash tag), which makes
-- both idempotent: an acquire sent twice (a retry after a lost connection) debits once,
-- and a refund gives back only an admission, once.
-- ARGV: op ("acquire" | "adjust" | "refund" | "peek"), requests_per_minute,
--       request_capacity, tokens_per_minute, token_capacity, tokens (the cost; for
--       "adjust" the tokens to charge, negative to refund; "refund" gives back one request
--       and `tokens`: an admission its caller never used), and for "adjust" ARGV[7]
--       requests to charge (what a replica admitted on its own while Redis was away);
--       whatever "adjust" charges, the debt it leaves is at most one bucket.
--       For "acquire", ARGV[7] and ARGV[8]: the requests and tokens the caller would take
--       beyond this request, as a grant it spends on its own (gateway/ratelimit/redis_limiter.py);
--       it gets at most a quarter of what each bucket holds after the request, and nothing
--       unless both are at least 1. A refund gives the grant back with the request.
-- Returns {code, request_level, token_level, granted_requests, granted_tokens}: code 0
-- allowed, 1 requests, 2 tokens, 3 too_large; levels as "%.17g" strings, after the debit
-- (the grant's included) when allowed; what was granted, 0 and 0 when none.

local op = ARGV[1]
local rpm, rcap = tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, tcap = tonumber(ARGV[4]), tonumber(ARGV[5])
local cost = tonumber(ARGV[6])

local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000

-- A level stays within one bucket either way: a settlement may leave debt, at most one
-- bucket's worth (bucket.py's settled_level says why), so every wait it implies and every
-- key's expiry stays bounded; a level stored out of that range is read as its bound.
local function bounded(lv, cap)
  return math.max(-cap, math.min(cap, lv))
end

local function level(key, per_minute, cap)
  local saved = redis.call('HMGET', key, 'level', 'at')
  local lv, at = tonumber(saved[1]), tonumber(saved[2])
  if lv == nil or at == nil or lv ~= lv then
    return cap
  end
  return bounded(lv + math.max(0, now - at) * per_minute / 60, cap)
end

-- The key lives until its bucket would be full again; after that, absent means full.
local function store(key, lv, per_minute, cap)
  redis.call('HSET', key, 'level', string.format('%.17g', lv), 'at', string.format('%.17g', now))
  redis.call('PEXPIRE', key, math.ceil((cap - lv) * 60000 / per_minute) + 1000)
end

local function reply(code, r, t, sr, st)
  return {code, string.format('%.17g', r), string.format('%.17g', t), sr or 0, st or 0}
end

local r = level(KEYS[1], rpm, rcap)
local t = level(KEYS[2], tpm, tcap)

if op == 'peek' then
  return reply(0, r, t)
end

if op == 'adjust' then
  local charged = tonumber(ARGV[7] or '0')
  if charged ~= 0 then
    r = bounded(r - charged, rcap)
    store(KEYS[1], r, rpm, rcap)
  end
  t = bounded(t - cost, tcap)
  store(KEYS[2], t, tpm, tcap)
  return reply(0, r, t)
end

local DECIDED_MS = 120000  -- longer than any retry or late answer takes

-- the id key holds "admitted <grant requests> <grant tokens>", then "refunded"
local function admitted(key)
  local sr, st = string.match(redis.call('GET', key) or '', '^admitted (%d+) (%d+)$')
  return tonumber(sr), tonumber(st)
end

if op == 'refund' then
  local sr, st = admitted(KEYS[3])
  if sr == nil then
    return reply(0, r, t)
  end
  redis.call('SET', KEYS[3], 'refunded', 'PX', DECIDED_MS)
  r = math.min(rcap, r + 1 + sr)
  t = math.min(tcap, t + cost + st)
  store(KEYS[1], r, rpm, rcap)
  store(KEYS[2], t, tpm, tcap)
  return reply(0, r, t)
end

if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then  -- decided (and debited) already
  local sr, st = admitted(KEYS[3])
  return reply(0, r, t, sr, st)
end
if cost > tcap then
  return reply(3, r, t)
end
if r < 1 then
  return reply(1, r, t)
end
if t < cost then
  return reply(2, r, t)
end
r = r - 1
t = t - cost
local sr = math.floor(math.min(tonumber(ARGV[7] or '0'), r / 4))
local st = math.floor(math.min(tonumber(ARGV[8] or '0'), t / 4))
if sr < 1 or st < 1 then
  sr, st = 0, 0
end
r = r - sr
t = t - st
store(KEYS[1], r, rpm, rcap)
store(KEYS[2], t, tpm, tcap)
if KEYS[3] then
  redis.call('SET', KEYS[3], string.format('admitted %d %d', sr, st), 'PX', DECIDED_MS)
end
return reply(0, r, t, sr, st)
