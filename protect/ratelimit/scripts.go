package ratelimit

import "github.com/redis/go-redis/v9"

// luaLog holds the helpers of the sliding logs (ZSETs of op id → unix ms).
//
// An entry made at t counts while now < t + span: trim removes every entry
// with t ≤ now − span, so at exactly t + span it has left the log.
//
// freed answers when a log that holds count entries will hold fewer than
// lim: when entry number count − lim (by time, from 0) leaves. With count
// = lim that is the oldest entry; a larger count (a limit lowered since)
// needs more of them to leave.
const luaLog = `
local function trim(key, now, span)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - span)
  return redis.call('ZCARD', key)
end
local function freed(key, count, lim, span)
  local e = redis.call('ZRANGE', key, count - lim, count - lim, 'WITHSCORES')
  return tonumber(e[2]) + span
end
`

// luaOps holds the helpers that make a script idempotent. remember stores a
// state-changing answer under the op's key; replay answers it again. Both
// append a last value that says whether the answer is a replay, so a
// repeated op is not counted twice in the metrics.
const luaOps = `
local function remember(key, ttl, out)
  local parts = {}
  for i, n in ipairs(out) do parts[i] = string.format('%d', n) end
  redis.call('SET', key, table.concat(parts, ','), 'PX', ttl)
  out[#out + 1] = 0
  return out
end
local function replay(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local out = {}
  for n in string.gmatch(v, '-?%d+') do out[#out + 1] = tonumber(n) end
  out[#out + 1] = 1
  return out
end
`

// luaBucket holds the token bucket arithmetic. A bucket is a hash {l, t}:
// it holds l milli-tokens at unix ms t. It refills continuously at rate
// tokens per minute, which is rate/60 milli-tokens per ms, up to cap. An
// absent bucket is full.
//
// t may lie ahead of now: the site bucket's pacing reserves tokens at future
// send times, and a replica's clock may run a little ahead of another's.
// Then the bucket is read as it will be at t, which never pays out tokens
// that are already promised.
//
// Refill floors to whole milli-tokens, so a rate that is not a multiple of
// 60 tokens/min may lose under one milli-token per update; when the rate is
// a multiple of 60 the arithmetic is exact.
const luaBucket = `
local function level(key, now, rate, cap)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, t = tonumber(v[1]), tonumber(v[2])
  if not l or not t then return cap, now end
  if t >= now then return l, t end
  if l >= cap then return cap, now end
  local dt = now - t
  if dt * rate >= (cap - l) * 60 then return cap, now end
  return l + math.floor(dt * rate / 60), now
end
local function ready(l, t, need, rate)
  if l >= need then return t end
  return t + math.ceil((need - l) * 60 / rate)
end
local function save(key, l, t, now, rate, cap, grace)
  redis.call('HSET', key, 'l', string.format('%d', l), 't', string.format('%d', t))
  -- Once it would have refilled to cap, the bucket reads the same absent.
  redis.call('PEXPIRE', key, t - now + math.ceil((cap - l) * 60 / rate) + grace)
end
`

// gateScript is the one round trip of an /api request.
// KEYS: win, fail, anom. ARGV: now ms, op, requests per window, failed
// checks per hour (0: not checked), check anomalies (1/0), window ms,
// hour ms, anomaly threshold, grace ms.
// Returns {code, admits at ms, remaining, reset at ms, replayed}; code 0
// admits, 1 rate_limited, 2 too_many_failed_checks, 3 anomaly_blocked.
// "reset" is when the window's oldest counted request leaves it (0: empty).
//
// The op id is the window entry's member, so a re-sent admitted op is found
// there and admitted again without a second entry. Refusals change nothing
// and are not remembered: under a flood they must cost no memory, and a
// re-sent refusal is simply decided again.
var gateScript = redis.NewScript(luaLog + `
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[3])
local win = tonumber(ARGV[6])
local hour = tonumber(ARGV[7])
local n = trim(KEYS[1], now, win)
local reset = 0
if n > 0 then reset = freed(KEYS[1], n, n, win) end
local rem = limit - n
if rem < 0 then rem = 0 end
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  return {0, 0, rem, reset, 1}
end
if ARGV[5] == '1' then
  local th = tonumber(ARGV[8])
  local a = trim(KEYS[3], now, hour)
  if a >= th then return {3, freed(KEYS[3], a, th, hour), rem, reset, 0} end
end
local fl = tonumber(ARGV[4])
if fl > 0 then
  local f = trim(KEYS[2], now, hour)
  if f >= fl then return {2, freed(KEYS[2], f, fl, hour), rem, reset, 0} end
end
if n >= limit then
  return {1, freed(KEYS[1], n, limit, win), 0, reset, 0}
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], win + tonumber(ARGV[9]))
if n == 0 then reset = now + win end
return {0, 0, rem - 1, reset, 0}
`)

// failScript records one failed check.
// KEYS: fail. ARGV: now ms, op, per hour, hour ms, grace ms.
// Returns {count, blocked until ms (0: not blocked), replayed}.
//
// The log keeps only its newest perHour entries: the block lasts until the
// oldest of those leaves the hour, which is exactly when the full count
// would drop below perHour, so nothing is lost by forgetting older ones,
// and memory stays bounded whatever the caller records.
var failScript = redis.NewScript(luaLog + `
local now = tonumber(ARGV[1])
local lim = tonumber(ARGV[3])
local hour = tonumber(ARGV[4])
trim(KEYS[1], now, hour)
local replayed = 1
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
  replayed = 0
end
local n = redis.call('ZCARD', KEYS[1])
if n > lim then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - lim - 1)
  n = lim
end
redis.call('PEXPIRE', KEYS[1], hour + tonumber(ARGV[5]))
local at = 0
if n >= lim then at = freed(KEYS[1], n, lim, hour) end
return {n, at, replayed}
`)

// beforeCallScript is a principal's check before one model call: the input
// spike check, then the principal's token bucket.
// KEYS: ema, anom, tpm, op key. ARGV: now ms, op, prompt tokens, amount
// tokens, rate (tokens/min, 0: no bucket), hour ms, anomaly threshold,
// anomaly log cap, ema ttl ms, op ttl ms, grace ms, spike factor, min samples.
// Returns {status, anomalies in hour, at ms, ema milli-tokens, samples,
// replayed}; status 0 proceeds (tokens taken, or no bucket), 1 is an input
// spike (at: blocked until, 0 when not blocked), 2 the bucket is short (at:
// when it will hold the amount), 3 the amount exceeds the capacity.
//
// The EMA (α = 0.3, in milli-tokens, rounded half up) learns only from
// calls that proceed: a spike must not raise the bar for the next one, and
// a call that waits for the bucket and asks again is still one call.
var beforeCallScript = redis.NewScript(luaLog + luaOps + luaBucket + `
local out = replay(KEYS[4])
if out then return out end
local now = tonumber(ARGV[1])
local prompt = tonumber(ARGV[3])
local opttl = tonumber(ARGV[10])
local grace = tonumber(ARGV[11])
local e = redis.call('HMGET', KEYS[1], 'm', 'n')
local m, n = tonumber(e[1]) or 0, tonumber(e[2]) or 0
-- prompt > factor × m/1000, kept in integers.
if n >= tonumber(ARGV[13]) and prompt * 1000 > tonumber(ARGV[12]) * m then
  local hour = tonumber(ARGV[6])
  local th = tonumber(ARGV[7])
  local logcap = tonumber(ARGV[8])
  trim(KEYS[2], now, hour)
  redis.call('ZADD', KEYS[2], 'NX', ARGV[1], ARGV[2])
  local a = redis.call('ZCARD', KEYS[2])
  if a > logcap then
    redis.call('ZREMRANGEBYRANK', KEYS[2], 0, a - logcap - 1)
    a = logcap
  end
  redis.call('PEXPIRE', KEYS[2], hour + grace)
  local at = 0
  if a >= th then at = freed(KEYS[2], a, th, hour) end
  return remember(KEYS[4], opttl, {1, a, at, m, n})
end
local rate = tonumber(ARGV[5])
if rate > 0 then
  local cap = rate * 2000
  local amt = tonumber(ARGV[4]) * 1000
  if amt > cap then return remember(KEYS[4], opttl, {3, 0, 0, m, n}) end
  local l, t = level(KEYS[3], now, rate, cap)
  if l < amt then return remember(KEYS[4], opttl, {2, 0, ready(l, t, amt, rate), m, n}) end
  save(KEYS[3], l - amt, t, now, rate, cap, grace)
end
if n == 0 then
  m = prompt * 1000
else
  m = math.floor((3 * prompt * 1000 + 7 * m + 5) / 10)
end
n = n + 1
redis.call('HSET', KEYS[1], 'm', string.format('%d', m), 'n', string.format('%d', n))
redis.call('PEXPIRE', KEYS[1], ARGV[9])
return remember(KEYS[4], opttl, {0, 0, 0, m, n})
`)

// afterCallScript settles a model call against its bucket.
// KEYS: tpm, op key. ARGV: now ms, rate, reserved tokens, actual tokens,
// op ttl ms, grace ms. Returns {overage tokens, replayed}.
//
// Unused tokens come back (never above cap); usage over the reservation is
// charged even below zero, and refills pay it back. That is the only way a
// bucket goes below zero.
var afterCallScript = redis.NewScript(luaOps + luaBucket + `
local out = replay(KEYS[2])
if out then return out end
local now = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local reserved = tonumber(ARGV[3])
local actual = tonumber(ARGV[4])
local cap = rate * 2000
local over = 0
if actual ~= reserved then
  local l, t = level(KEYS[1], now, rate, cap)
  if actual < reserved then
    l = math.min(cap, l + (reserved - actual) * 1000)
  else
    over = actual - reserved
    l = l - over * 1000
  end
  save(KEYS[1], l, t, now, rate, cap, tonumber(ARGV[6]))
end
return remember(KEYS[2], tonumber(ARGV[5]), {over})
`)

// peekScript reads whether a bucket could pay need now.
// KEYS: tpm. ARGV: now ms, rate, need tokens.
// Returns {ok, at ms when it can, level milli-tokens}.
var peekScript = redis.NewScript(luaBucket + `
local now = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local l, t = level(KEYS[1], now, rate, rate * 2000)
local at = ready(l, t, tonumber(ARGV[3]) * 1000, rate)
if at <= now then return {1, now, l} end
return {0, at, l}
`)

// paceScript reserves a send time in a bucket (virtual scheduling): the
// earliest time, no earlier than every reservation before it, at which the
// bucket can pay the amount. The bucket's t becomes that send time, so the
// next call is scheduled after it: calls are served in the order they asked,
// whichever replica asked.
// KEYS: tpm, op key. ARGV: now ms (rounded down), rate, amount tokens,
// latest send ms, op ttl ms, grace ms, now ms rounded up. Returns
// {reserved (1/0), send at ms, replayed}. A send after the latest reserves
// nothing and is not remembered.
//
// The caller sends at its real now or at the send time, whichever is
// later: the refill is counted to now rounded down, never past the send,
// and the queue's end moves to now rounded up, never before it (the
// refill in between is forgone), so the tokens sent in any span stay
// within the bound whatever fraction of a millisecond now is.
var paceScript = redis.NewScript(luaOps + luaBucket + `
local out = replay(KEYS[2])
if out then return out end
local now = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cap = rate * 2000
local amt = tonumber(ARGV[3]) * 1000
local l, t = level(KEYS[1], now, rate, cap)
local send = ready(l, t, amt, rate)
if send > tonumber(ARGV[4]) then return {0, send, 0} end
if send > t then l = math.min(cap, l + math.floor((send - t) * rate / 60)) end
save(KEYS[1], l - amt, math.max(send, tonumber(ARGV[7])), now, rate, cap, tonumber(ARGV[6]))
return remember(KEYS[2], tonumber(ARGV[5]), {1, send})
`)
