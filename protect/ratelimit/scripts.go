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

// luaSlots holds the helpers of the slotted counters: a hash whose
// counters are fields "<kind><slot>" (kind one letter, slot the index of a
// slot of slotms milliseconds) holding whole numbers. A slot counts while
// now < (slot + 1) × slotms + span: from its start until span after its
// end, so a counter is never forgotten early, and late by at most one
// slot. Beside them the hash keeps "=<kind>", each kind's total over the
// slots it holds, and "<", the oldest slot it holds, so that while that
// slot still counts the totals are read with one HMGET; only once it has
// left does tally read the whole hash, drop what no longer counts and
// write the totals anew (once per slot at most).
//
// The invalid-request window keeps kinds t (requests) and i (invalid
// ones); the hourly tokens kind h. add counts n more of a kind now (after
// a tally: the totals must be fresh). live returns the counters that
// count, oldest first, as {slot, kind, value}, for the refusal paths:
// invalidat answers when a window whose share of invalid requests is over
// ppm millionths (with at least min requests) stops being so, as its
// slots leave in order, 0 when it is not over now; hourfree when slots
// holding over tokens in all will have left.
const luaSlots = `
local function live(key, now, slotms, span)
  local v = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #v, 2 do
    local s = tonumber(string.sub(v[i], 2))
    if s and (s + 1) * slotms + span > now then
      out[#out + 1] = {s, string.sub(v[i], 1, 1), tonumber(v[i + 1]) or 0}
    end
  end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end
local function tally(key, now, slotms, span)
  local v = redis.call('HMGET', key, '<', '=t', '=i', '=h')
  local lo = tonumber(v[1])
  if lo and (lo + 1) * slotms + span > now then
    return {t = tonumber(v[2]) or 0, i = tonumber(v[3]) or 0, h = tonumber(v[4]) or 0}
  end
  local all = redis.call('HGETALL', key)
  local sum, dead, first = {t = 0, i = 0, h = 0}, {}, nil
  for k = 1, #all, 2 do
    local f = all[k]
    local kind = string.sub(f, 1, 1)
    if kind ~= '<' and kind ~= '=' then
      local s = tonumber(string.sub(f, 2))
      if not s or sum[kind] == nil or (s + 1) * slotms + span <= now then
        dead[#dead + 1] = f
      else
        sum[kind] = sum[kind] + (tonumber(all[k + 1]) or 0)
        if not first or s < first then first = s end
      end
    end
  end
  if #dead > 0 then redis.call('HDEL', key, unpack(dead)) end
  if first then
    redis.call('HSET', key, '<', string.format('%d', first), '=t', string.format('%d', sum.t),
      '=i', string.format('%d', sum.i), '=h', string.format('%d', sum.h))
  else
    redis.call('HDEL', key, '<', '=t', '=i', '=h')
  end
  return sum
end
local function add(key, now, slotms, kind, n)
  local s = math.floor(now / slotms)
  redis.call('HINCRBY', key, kind .. string.format('%d', s), n)
  redis.call('HINCRBY', key, '=' .. kind, n)
  local lo = tonumber(redis.call('HGET', key, '<'))
  if not lo or s < lo then redis.call('HSET', key, '<', string.format('%d', s)) end
end
local function badshare(t, i, ppm, min)
  return t >= min and i * 1000000 > ppm * t
end
local function invalidat(key, now, ppm, min, slotms, span)
  local sum = tally(key, now, slotms, span)
  local t, i = sum.t, sum.i
  if not badshare(t, i, ppm, min) then return 0 end
  local l = live(key, now, slotms, span)
  local k = 1
  while k <= #l do
    local s = l[k][1]
    while k <= #l and l[k][1] == s do
      if l[k][2] == 't' then t = t - l[k][3] elseif l[k][2] == 'i' then i = i - l[k][3] end
      k = k + 1
    end
    if not badshare(t, i, ppm, min) then return (s + 1) * slotms + span end
  end
  return -1
end
local function hourfree(key, now, over, slotms, span)
  local freed = 0
  for _, e in ipairs(live(key, now, slotms, span)) do
    if e[2] == 'h' then
      freed = freed + e[3]
      if freed >= over then return (e[1] + 1) * slotms + span end
    end
  end
  return -1
end
`

// gateScript is the one round trip of an /api request.
// KEYS: win, fail, anom, inv, hour. ARGV: now ms, op, requests per
// window, failed checks per hour (0: not checked), check anomalies (1/0),
// window ms, hour ms, anomaly threshold, grace ms, requests per second (0:
// off), invalid ratio in millionths (0: off), invalid minimum requests,
// invalid slot ms, invalid window ms, hourly tokens (0: off), soft tokens,
// soft requests per window, hour slot ms, hour window ms, second ms.
// Returns {code, admits at ms, remaining, reset at ms, replayed, hour
// tokens used, soft (1/0)}; code 0 admits, 1 rate_limited (the minute),
// 2 too_many_failed_checks, 3 anomaly_blocked, 4 rate_limited (the
// second), 5 rate_limited (the soft minute), 6 invalid_ratio. "reset" is
// when the window's oldest counted request leaves it (0: empty).
//
// The per-second window is the minute's log read over its last second:
// one log, one round trip, for both. A principal whose hour has reached
// its soft share is held to the soft requests per window instead of the
// full number (when that is lower).
//
// The op id is the window entry's member, so a re-sent admitted op is found
// there and admitted again without a second entry. Refusals change nothing
// and are not remembered: under a flood they must cost no memory, and a
// re-sent refusal is simply decided again. An admitted request with the
// invalid ratio on counts as one request of its invalid window.
var gateScript = redis.NewScript(luaLog + luaSlots + `
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[3])
local win = tonumber(ARGV[6])
local hour = tonumber(ARGV[7])
local grace = tonumber(ARGV[9])
local rps = tonumber(ARGV[10])
local ppm = tonumber(ARGV[11])
local islot, ispan = tonumber(ARGV[13]), tonumber(ARGV[14])
local hourly = tonumber(ARGV[15])
local used, soft = 0, 0
if hourly > 0 then
  used = tally(KEYS[5], now, tonumber(ARGV[18]), tonumber(ARGV[19])).h
  if used >= tonumber(ARGV[16]) then soft = 1 end
end
local eff, full = limit, 1
if soft == 1 and tonumber(ARGV[17]) < limit then eff, full = tonumber(ARGV[17]), 5 end
local n = trim(KEYS[1], now, win)
local reset = 0
if n > 0 then reset = freed(KEYS[1], n, n, win) end
local rem = eff - n
if rem < 0 then rem = 0 end
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  return {0, 0, rem, reset, 1, used, soft}
end
if ARGV[5] == '1' then
  local th = tonumber(ARGV[8])
  local a = trim(KEYS[3], now, hour)
  if a >= th then return {3, freed(KEYS[3], a, th, hour), rem, reset, 0, used, soft} end
end
local fl = tonumber(ARGV[4])
if fl > 0 then
  local f = trim(KEYS[2], now, hour)
  if f >= fl then return {2, freed(KEYS[2], f, fl, hour), rem, reset, 0, used, soft} end
end
if ppm > 0 then
  local at = invalidat(KEYS[4], now, ppm, tonumber(ARGV[12]), islot, ispan)
  if at ~= 0 then return {6, at, rem, reset, 0, used, soft} end
end
if n >= eff then
  return {full, freed(KEYS[1], n, eff, win), 0, reset, 0, used, soft}
end
if rps > 0 then
  local sec = tonumber(ARGV[20])
  local lo = '(' .. string.format('%d', now - sec)
  local c = redis.call('ZCOUNT', KEYS[1], lo, '+inf')
  if c >= rps then
    local e = redis.call('ZRANGEBYSCORE', KEYS[1], lo, '+inf', 'WITHSCORES', 'LIMIT', c - rps, 1)
    return {4, tonumber(e[2]) + sec, rem, reset, 0, used, soft}
  end
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], win + grace)
if ppm > 0 then
  add(KEYS[4], now, islot, 't', 1)
  redis.call('PEXPIRE', KEYS[4], islot + ispan + grace)
end
if n == 0 then reset = now + win end
return {0, 0, rem - 1, reset, 0, used, soft}
`)

// noteScript counts outcomes in a principal's invalid-request window and,
// for a visitor's failed check, logs it as failScript does, in one call.
// KEYS: fail, inv, op key. ARGV: now ms, op, failed checks per hour (0:
// none to log), hour ms, grace ms, requests, invalid, invalid slot ms,
// invalid window ms, op ttl ms.
// Returns {failed checks in the hour, blocked until ms (0: not blocked),
// replayed}.
var noteScript = redis.NewScript(luaLog + luaOps + luaSlots + `
local out = replay(KEYS[3])
if out then return out end
local now = tonumber(ARGV[1])
local lim = tonumber(ARGV[3])
local grace = tonumber(ARGV[5])
local n, at = 0, 0
if lim > 0 then
  local hour = tonumber(ARGV[4])
  trim(KEYS[1], now, hour)
  redis.call('ZADD', KEYS[1], 'NX', ARGV[1], ARGV[2])
  n = redis.call('ZCARD', KEYS[1])
  if n > lim then
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - lim - 1)
    n = lim
  end
  redis.call('PEXPIRE', KEYS[1], hour + grace)
  if n >= lim then at = freed(KEYS[1], n, lim, hour) end
end
local requests, invalid = tonumber(ARGV[6]), tonumber(ARGV[7])
if requests > 0 or invalid > 0 then
  local islot, ispan = tonumber(ARGV[8]), tonumber(ARGV[9])
  tally(KEYS[2], now, islot, ispan)
  if requests > 0 then add(KEYS[2], now, islot, 't', requests) end
  if invalid > 0 then add(KEYS[2], now, islot, 'i', invalid) end
  redis.call('PEXPIRE', KEYS[2], islot + ispan + grace)
end
return remember(KEYS[3], tonumber(ARGV[10]), {n, at})
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
// spike check, then the principal's token bucket, then its hourly tokens.
// KEYS: ema, anom, tpm, op key, hour. ARGV: now ms, op, prompt tokens,
// amount tokens, rate (tokens/min, 0: no bucket), hour ms, anomaly
// threshold, anomaly log cap, ema ttl ms, op ttl ms, grace ms, spike
// factor, min samples, hourly tokens (0: off), soft tokens, hour slot ms,
// hour window ms.
// Returns {status, anomalies in hour, at ms, ema milli-tokens, samples,
// hour tokens used, soft (1/0), hour slot, replayed}; status 0 proceeds
// (tokens taken, or no bucket; the amount added to the hour), 1 is an
// input spike (at: blocked until, 0 when not blocked), 2 the bucket is
// short (at: when it will hold the amount), 3 the amount exceeds the
// capacity, 4 the hour is short (at: when enough of it has slid), 5 the
// amount exceeds the hourly tokens. "hour tokens used" and "soft" are the
// hour as the call found it: charged and reserved, before this call.
//
// The EMA (α = 0.3, in milli-tokens, rounded half up) learns only from
// calls that proceed: a spike must not raise the bar for the next one, and
// a call that waits for the bucket and asks again is still one call. The
// hour holds the call's whole amount from now on, so calls in flight at
// once can never take the hour past its quota; the settle (afterCallScript)
// gives back what the call did not use.
var beforeCallScript = redis.NewScript(luaLog + luaOps + luaBucket + luaSlots + `
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
  return remember(KEYS[4], opttl, {1, a, at, m, n, 0, 0, 0})
end
local rate = tonumber(ARGV[5])
local tokens = tonumber(ARGV[4])
local l, t, cap
if rate > 0 then
  cap = rate * 2000
  if tokens * 1000 > cap then return remember(KEYS[4], opttl, {3, 0, 0, m, n, 0, 0, 0}) end
  l, t = level(KEYS[3], now, rate, cap)
  if l < tokens * 1000 then return remember(KEYS[4], opttl, {2, 0, ready(l, t, tokens * 1000, rate), m, n, 0, 0, 0}) end
end
local hourly = tonumber(ARGV[14])
local used, soft, slot = 0, 0, 0
if hourly > 0 then
  local hs, hspan = tonumber(ARGV[16]), tonumber(ARGV[17])
  used = tally(KEYS[5], now, hs, hspan).h
  if used >= tonumber(ARGV[15]) then soft = 1 end
  if tokens > hourly then return remember(KEYS[4], opttl, {5, 0, 0, m, n, used, soft, 0}) end
  if used + tokens > hourly then
    return remember(KEYS[4], opttl, {4, 0, hourfree(KEYS[5], now, used + tokens - hourly, hs, hspan), m, n, used, soft, 0})
  end
  slot = math.floor(now / hs)
  add(KEYS[5], now, hs, 'h', tokens)
  redis.call('PEXPIRE', KEYS[5], hs + hspan + grace)
end
if rate > 0 then save(KEYS[3], l - tokens * 1000, t, now, rate, cap, grace) end
if n == 0 then
  m = prompt * 1000
else
  m = math.floor((3 * prompt * 1000 + 7 * m + 5) / 10)
end
n = n + 1
redis.call('HSET', KEYS[1], 'm', string.format('%d', m), 'n', string.format('%d', n))
redis.call('PEXPIRE', KEYS[1], ARGV[9])
return remember(KEYS[4], opttl, {0, 0, 0, m, n, used, soft, slot})
`)

// afterCallScript settles a model call against its bucket and its hour.
// KEYS: tpm, op key, hour. ARGV: now ms, rate (0: no bucket), reserved
// tokens, actual tokens, op ttl ms, grace ms, hourly tokens (0: off), the
// hour slot the call was added to, hour slot ms, hour window ms.
// Returns {overage tokens, replayed}.
//
// Unused tokens come back (never above cap); usage over the reservation is
// charged even below zero, and refills pay it back. That is the only way a
// bucket goes below zero. In the hour, unused tokens leave the slot the
// call was added to (if it still counts), and usage over the reservation
// is added to the current slot, where it counts a whole hour from now.
var afterCallScript = redis.NewScript(luaOps + luaBucket + luaSlots + `
local out = replay(KEYS[2])
if out then return out end
local now = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local reserved = tonumber(ARGV[3])
local actual = tonumber(ARGV[4])
local grace = tonumber(ARGV[6])
local over = 0
if actual > reserved then over = actual - reserved end
if rate > 0 and actual ~= reserved then
  local cap = rate * 2000
  local l, t = level(KEYS[1], now, rate, cap)
  if actual < reserved then
    l = math.min(cap, l + (reserved - actual) * 1000)
  else
    l = l - over * 1000
  end
  save(KEYS[1], l, t, now, rate, cap, grace)
end
if tonumber(ARGV[7]) > 0 and actual ~= reserved then
  local hs, hspan = tonumber(ARGV[9]), tonumber(ARGV[10])
  tally(KEYS[3], now, hs, hspan)
  if actual < reserved then
    local f = 'h' .. ARGV[8]
    local v = tonumber(redis.call('HGET', KEYS[3], f))
    if v then
      local back = math.min(v, reserved - actual)
      if back == v then redis.call('HDEL', KEYS[3], f) else redis.call('HINCRBY', KEYS[3], f, -back) end
      redis.call('HINCRBY', KEYS[3], '=h', -back)
    end
  else
    add(KEYS[3], now, hs, 'h', over)
    redis.call('PEXPIRE', KEYS[3], hs + hspan + grace)
  end
end
return remember(KEYS[2], tonumber(ARGV[5]), {over})
`)

// hourScript reads whether a principal's hour could take need more tokens
// now. KEYS: hour. ARGV: now ms, hourly tokens, need, hour slot ms, hour
// window ms. Returns {ok (1/0), at ms when it can, tokens used}.
var hourScript = redis.NewScript(luaSlots + `
local now = tonumber(ARGV[1])
local hourly, need = tonumber(ARGV[2]), tonumber(ARGV[3])
local hs, hspan = tonumber(ARGV[4]), tonumber(ARGV[5])
local used = tally(KEYS[1], now, hs, hspan).h
if used + need <= hourly then return {1, now, used} end
return {0, hourfree(KEYS[1], now, used + need - hourly, hs, hspan), used}
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
