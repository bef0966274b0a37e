package budget

import "github.com/redis/go-redis/v9"

// Every key one day's scripts touch starts with faregate:budget:{<day>}:,
// and the {<day>} hash tag puts them all in one Redis Cluster slot:
//
//	site            hash  site tokens: settled, outstanding, overage, warned, exhausted
//	spend           hash  site money in micro-units, same fields
//	tier:<tier>     hash  a tier's tokens (its max_site_share), same fields
//	p:<principal>   hash  a principal's tokens, same fields
//	task:<task>     hash  a task's tokens: settled, outstanding, overage
//	taskres:<task>  set   ids of the task's open reservations (for ReleaseTask)
//	res             zset  open reservation id → expiry (unix ms, caller's clock)
//	resinfo         hash  open reservation id → "tokens|cost|principal|tier|task|model"
//	done            hash  ended reservation id → "state|tokens|cost|ovtok|ovcost|late|info"
//	                      state R = given back (expired or released), S = settled;
//	                      op:<id> → what one ReleaseTask round released
//
// The day's ledger stream, faregate:usage:{<day>} (see Ledger), carries
// the same tag, so the settle script appends the call's entry itself.
//
// Keys of scopes named only inside resinfo (a reaped reservation's
// principal, tier and task) are built by the scripts from the prefix of
// KEYS[1] rather than declared; they share the {<day>} tag, so every script
// stays single-slot on a cluster.
//
// "Used" in a scope means settled + outstanding. A reservation is granted
// only while used + amount ≤ limit; a settle may push used past the limit
// only by what it records as overage, so settled + outstanding − overage ≤
// limit holds at every instant, and the next reservation is refused.
//
// Numbers handed to HINCRBY go through int(): Lua numbers are doubles, and
// their default string form ("1e+15", "-0") is not an integer to Redis.

// luaHelpers turn numbers into what Redis takes as integers, and Redis's
// answers into numbers.
const luaHelpers = `
local function int(n) return string.format('%d', n) end
local function num(v) return tonumber(v) or 0 end
`

// luaPrelude is shared by every script: helpers, the scope list of a
// reservation, give-back and the reaper.
//
// The reaper gives back each reservation of the day whose expiry (ARGV now)
// has passed: its amounts leave "outstanding" in exactly the scopes its
// resinfo names, it leaves res, resinfo and its task's set, and done records
// it as given back (R), so a second reaper finds nothing and a late settle
// is charged as overage. At most 256 are reaped per call, which bounds how
// long one script blocks Redis; a larger backlog drains over the next calls
// and until then still counts, which errs on the safe side.
const luaPrelude = luaHelpers + `
local prefix = string.sub(KEYS[1], 1, -5)
-- known holds the settled and outstanding of each scope key as this
-- script last read or wrote them (a script runs atomically, and incr is
-- the only writer of those fields), and expiring the keys incr has set
-- an expiry on: a redis.call costs about as much again as the command
-- itself, and a script would otherwise read each scope two or three
-- times and set the same expiry once per field.
local known, expiring = {}, {}
local function used(key)
  local k = known[key]
  if not (k and k.settled and k.outstanding) then
    local v = redis.call('HMGET', key, 'settled', 'outstanding')
    k = {settled = num(v[1]), outstanding = num(v[2])}
    known[key] = k
  end
  return k.settled + k.outstanding
end
local function incr(key, field, n, ttl)
  if n ~= 0 then
    local v = redis.call('HINCRBY', key, field, int(n))
    if field == 'settled' or field == 'outstanding' then
      known[key] = known[key] or {}
      known[key][field] = v
    end
    -- One ttl per script, and a script's clock stands still: a second
    -- EXPIRE of the key would set the same instant.
    if expiring[key] ~= ttl then
      redis.call('EXPIRE', key, ttl)
      expiring[key] = ttl
    end
  end
end
local function scopes(info)
  local tok, cost, p, tier, task = string.match(info, '^(%d+)|(%d+)|([^|]+)|([^|]*)|([^|]+)|')
  if not tok then return nil end
  tok, cost = tonumber(tok), tonumber(cost)
  local s = {{prefix .. 'site', tok}, {prefix .. 'spend', cost},
    {prefix .. 'p:' .. p, tok}, {prefix .. 'task:' .. task, tok}}
  if tier ~= '' then s[#s + 1] = {prefix .. 'tier:' .. tier, tok} end
  return s, task
end
local function giveback(id, info, ttl)
  local s, task = scopes(info)
  if s then
    for _, x in ipairs(s) do incr(x[1], 'outstanding', -x[2], ttl) end
    redis.call('SREM', prefix .. 'taskres:' .. task, id)
  end
  redis.call('ZREM', prefix .. 'res', id)
  redis.call('HDEL', prefix .. 'resinfo', id)
  redis.call('HSET', prefix .. 'done', id, 'R|0|0|0|0|0|' .. info)
  redis.call('EXPIRE', prefix .. 'done', ttl)
end
local function reap(now, ttl)
  local ids = redis.call('ZRANGEBYSCORE', prefix .. 'res', '-inf', now, 'LIMIT', 0, 256)
  for _, id in ipairs(ids) do
    local info = redis.call('HGET', prefix .. 'resinfo', id)
    if info then giveback(id, info, ttl) else redis.call('ZREM', prefix .. 'res', id) end
  end
end
-- crossed reports whether key is at 80% of limit or more and this
-- operation (tag) is the one that first saw it today. The flag holds the
-- tag, so a re-sent script (lost reply) reports the same crossing again,
-- and no other operation, on any replica, ever does.
local function crossed(key, limit, tag)
  local u = used(key)
  if limit <= 0 or u * 5 < limit * 4 then return 0, u end
  if redis.call('HSETNX', key, 'warned', tag) == 1 then return 1, u end
  if redis.call('HGET', key, 'warned') == tag then return 1, u end
  return 0, u
end
-- withScopes appends to out the four warning flags, then the four used
-- values, of site, spend, tier and principal (KEYS 1 to 4). Only an answer
-- that charged (charged) can cross a warning line; the others report use.
local function withScopes(out, charged, limit, active, tag)
  local w, u = {}, {}
  for i = 1, 4 do
    w[i], u[i] = 0, 0
    if active[i] then
      if charged then w[i], u[i] = crossed(KEYS[i], limit[i], tag) else u[i] = used(KEYS[i]) end
    end
  end
  for i = 1, 4 do out[#out + 1] = w[i] end
  for i = 1, 4 do out[#out + 1] = u[i] end
  return out
end
-- first reports whether this refusal (tag) is the scope's first today.
local function first(key, tag, ttl)
  if redis.call('HSETNX', key, 'exhausted', tag) == 1 then
    redis.call('EXPIRE', key, ttl)
    return 1
  end
  if redis.call('HGET', key, 'exhausted') == tag then return 1 end
  return 0
end
`

// Scope numbers shared by the scripts and scopeByIndex: the KEYS order of
// reserve, settle, canAfford and usage.
//
//	1 site tokens, 2 site spend, 3 tier, 4 principal, 5 task

// reserveScript: KEYS site, spend, tier, principal, task, taskres, res,
// resinfo, done; ARGV now, expiry, id, tokens, cost, limits of site, spend,
// tier, principal, task (0 = no cap for spend and tier), ttl seconds, info,
// has-tier (1/0).
//
// Returns {status, scope, remaining, first, site used, spend used,
// reservations, 4 warning flags, 4 used} where status is 1 granted, 2
// granted before (a re-send: nothing is charged again), 0 refused by scope
// (task, principal, tier, site, spend: the narrowest is named), 3 the id
// belongs to another reservation. The warning flags and used values are of
// site, spend, tier and principal.
var reserveScript = redis.NewScript(luaPrelude + `
local now, id, ttl, info = ARGV[1], ARGV[3], tonumber(ARGV[11]), ARGV[12]
reap(now, ttl)
local tag = 'r:' .. id
local tok, cost = tonumber(ARGV[4]), tonumber(ARGV[5])
if not tok or not cost or tok < 0 or cost < 0 or tok > 9007199254740991 or cost > 9007199254740991 then
  return redis.error_reply('ERR budget: reserve amount out of range')
end
local amount = {tok, cost, tok, tok, tok}
local limit = {tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])}
local active = {true, true, ARGV[13] == '1', true, true}
local function answer(status, scope, rem, fst)
  return withScopes({status, scope, rem, fst, used(KEYS[1]), used(KEYS[2]), redis.call('ZCARD', KEYS[7])},
    status == 1 or status == 2, limit, active, tag)
end
-- The id is made before the call, so a reply lost on the way back and the
-- client's re-send of the same script meet here: answer the first success.
local prev = redis.call('HGET', KEYS[8], id)
if prev then
  if prev == info then return answer(2, 0, 0, 0) end
  return answer(3, 0, 0, 0)
end
local d = redis.call('HGET', KEYS[9], id)
if d then
  -- Given back (reaped or released) before the re-send arrived: still the
  -- first answer; the caller's settle will be charged as overage.
  if d == 'R|0|0|0|0|0|' .. info then return answer(2, 0, 0, 0) end
  return answer(3, 0, 0, 0)
end
for _, i in ipairs({5, 4, 3, 1, 2}) do
  if active[i] and limit[i] > 0 then
    local u = used(KEYS[i])
    if u + amount[i] > limit[i] then
      local fst = 0
      if i ~= 5 then fst = first(KEYS[i], tag, ttl) end
      return answer(0, i, math.max(limit[i] - u, 0), fst)
    end
  end
end
for i = 1, 5 do
  if active[i] then incr(KEYS[i], 'outstanding', amount[i], ttl) end
end
redis.call('ZADD', KEYS[7], ARGV[2], id)
redis.call('HSET', KEYS[8], id, info)
redis.call('SADD', KEYS[6], id)
for i = 6, 8 do redis.call('EXPIRE', KEYS[i], ttl) end
return answer(1, 0, 0, 0)
`)

// settleScript: KEYS as reserveScript, then the day's ledger stream and
// its counters (same {<day>} tag); ARGV now, id, tokens, cost, info, ttl
// seconds, limits of site, spend, tier, principal, has-tier (1/0),
// write-ledger (1/0), then for the ledger Ledger.argv's block (luaLedger).
// The stored info must equal the caller's, so a Reservation whose fields
// were altered cannot move tokens between scopes.
//
// Amounts past 2^53 (where doubles stop being exact) or below zero are
// refused before anything moves; Go never sends them.
//
// An open reservation: its hold leaves outstanding, the actual usage is
// settled in full, and what exceeds the hold is added to overage. One
// given back (expired or released) before the settle arrived: the actual
// usage is settled and all of it is overage. One already settled: the
// first settlement is answered again and nothing moves. The ledger entry
// is added exactly when a settlement is first recorded, so a re-sent
// script (lost reply) never writes a second line.
//
// Returns {status, tokens, cost, overage tokens, overage cost, late, site
// used, spend used, reservations, 4 warning flags, 4 used, then the
// ledger's backlog, lost and unexported (luaLedger; 0, 0, -1 without an
// entry)}; status 1 settled, 2 settled before, 0 unknown.
var settleScript = redis.NewScript(luaPrelude + luaLedger + `
local now, id, info, ttl = ARGV[1], ARGV[2], ARGV[5], tonumber(ARGV[6])
reap(now, ttl)
local tag = 's:' .. id
local at, ac = tonumber(ARGV[3]), tonumber(ARGV[4])
if not at or not ac or at < 0 or ac < 0 or at > 9007199254740991 or ac > 9007199254740991 then
  return redis.error_reply('ERR budget: settle amount out of range')
end
local actual = {at, ac, at, at, at}
local limit = {tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])}
local active = {true, true, ARGV[11] == '1', true, true}
local ledger = {0, 0, -1}
local function answer(status, t, c, ot, oc, late)
  local out = withScopes({status, t, c, ot, oc, late, used(KEYS[1]), used(KEYS[2]), redis.call('ZCARD', KEYS[7])},
    status ~= 0, limit, active, tag)
  for i = 1, 3 do out[#out + 1] = ledger[i] end
  return out
end
local function record(ot, oc, late)
  redis.call('HSET', KEYS[9], id, 'S|' .. int(at) .. '|' .. int(ac) .. '|' .. int(ot) .. '|' .. int(oc) .. '|' .. late .. '|' .. info)
  redis.call('EXPIRE', KEYS[9], ttl)
  if ARGV[12] == '1' then ledger = ledgerAppendArgv(KEYS[10], KEYS[11], 13, ac, ot, oc, id) end
end
local open = redis.call('HGET', KEYS[8], id)
if open then
  if open ~= info then return answer(0, 0, 0, 0, 0, 0) end
  local rt, rc = string.match(open, '^(%d+)|(%d+)|')
  rt, rc = tonumber(rt), tonumber(rc)
  local held = {rt, rc, rt, rt, rt}
  local ot, oc = math.max(at - rt, 0), math.max(ac - rc, 0)
  local over = {ot, oc, ot, ot, ot}
  -- The reserve of this open reservation set the expiry of every scope
  -- it held an amount in, moments ago (reap has just given back any whose
  -- hold had expired): those need no second EXPIRE. A scope it held
  -- nothing in may be new here, and gets one.
  for i = 1, 5 do
    if active[i] and held[i] ~= 0 then expiring[KEYS[i]] = ttl end
  end
  for i = 1, 5 do
    if active[i] then
      incr(KEYS[i], 'outstanding', -held[i], ttl)
      incr(KEYS[i], 'settled', actual[i], ttl)
      incr(KEYS[i], 'overage', over[i], ttl)
    end
  end
  redis.call('ZREM', KEYS[7], id)
  redis.call('HDEL', KEYS[8], id)
  redis.call('SREM', KEYS[6], id)
  record(ot, oc, 0)
  return answer(1, at, ac, ot, oc, 0)
end
local d = redis.call('HGET', KEYS[9], id)
if not d then return answer(0, 0, 0, 0, 0, 0) end
local st, t, c, ot, oc, late, rest = string.match(d, '^([RS])|(%d+)|(%d+)|(%d+)|(%d+)|(%d)|(.*)$')
if rest ~= info then return answer(0, 0, 0, 0, 0, 0) end
if st == 'S' then
  return answer(2, tonumber(t), tonumber(c), tonumber(ot), tonumber(oc), tonumber(late))
end
for i = 1, 5 do
  if active[i] then
    incr(KEYS[i], 'settled', actual[i], ttl)
    incr(KEYS[i], 'overage', actual[i], ttl)
  end
end
record(at, ac, 1)
return answer(1, at, ac, at, ac, 1)
`)

// releaseScript: KEYS site, taskres, res, resinfo, done; ARGV now, ttl
// seconds, op id. Gives back up to 256 open reservations of one task in
// all their scopes and records them as given back (R), so their settles
// are charged as overage. The count is recorded under the op id, so a
// re-sent script answers it again instead of 0. Returns {released, still
// open, site used, spend used, reservations}; the caller repeats (with a
// new op id) while some are still open.
var releaseScript = redis.NewScript(luaPrelude + `
local ttl = tonumber(ARGV[2])
reap(ARGV[1], ttl)
local op = 'op:' .. ARGV[3]
local prev = redis.call('HGET', KEYS[5], op)
if prev then
  return {tonumber(prev), redis.call('SCARD', KEYS[2]), used(KEYS[1]), used(prefix .. 'spend'), redis.call('ZCARD', KEYS[3])}
end
local ids = redis.call('SRANDMEMBER', KEYS[2], 256)
local n = 0
for _, id in ipairs(ids) do
  local info = redis.call('HGET', KEYS[4], id)
  if info then
    giveback(id, info, ttl)
    n = n + 1
  else
    redis.call('SREM', KEYS[2], id)
  end
end
-- Nothing released needs no record: a re-send would find nothing either.
if n > 0 then
  redis.call('HSET', KEYS[5], op, n)
  redis.call('EXPIRE', KEYS[5], ttl)
end
return {n, redis.call('SCARD', KEYS[2]), used(KEYS[1]), used(prefix .. 'spend'), redis.call('ZCARD', KEYS[3])}
`)

// canAffordScript: KEYS site, spend, tier, principal, res, resinfo, done;
// ARGV now, ttl seconds, tokens, cost, limits of site, spend, tier,
// principal, has-tier (1/0). Reaps, then only reads, except that a refusal
// sets the scope's once-a-day exhausted flag.
// Returns {ok, scope, remaining, first, site used, spend used, reservations}
// with principal, tier, site and spend checked in that order.
var canAffordScript = redis.NewScript(luaPrelude + `
local ttl = tonumber(ARGV[2])
reap(ARGV[1], ttl)
local tok, cost = tonumber(ARGV[3]), tonumber(ARGV[4])
local amount = {tok, cost, tok, tok}
local limit = {tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])}
local active = {true, true, ARGV[9] == '1', true}
local su, spu, n = used(KEYS[1]), used(KEYS[2]), redis.call('ZCARD', KEYS[5])
for _, i in ipairs({4, 3, 1, 2}) do
  if active[i] and limit[i] > 0 then
    local u = used(KEYS[i])
    if u + amount[i] > limit[i] then
      return {0, i, math.max(limit[i] - u, 0), first(KEYS[i], 'a:' .. ARGV[1], ttl), su, spu, n}
    end
  end
end
return {1, 0, 0, 0, su, spu, n}
`)

// usageScript: KEYS site, spend, tier, principal, task, res, resinfo,
// done; ARGV now, ttl seconds. Reaps, then reads every scope in the same
// atomic step so the numbers agree. Returns settled, outstanding and
// overage of each scope in KEYS order, then the reservation count.
var usageScript = redis.NewScript(luaPrelude + `
reap(ARGV[1], tonumber(ARGV[2]))
local out = {}
for i = 1, 5 do
  local v = redis.call('HMGET', KEYS[i], 'settled', 'outstanding', 'overage')
  for j = 1, 3 do out[#out + 1] = num(v[j]) end
end
out[#out + 1] = redis.call('ZCARD', KEYS[6])
return out
`)

// withdrawScript: KEYS as reserveScript; ARGV now, ttl seconds, id.
// Undoes a reserve as if it had never been sent: an open reservation id
// is given back (recorded as given back, so a settle would be overage);
// a warning or exhaustion flag of site, spend, tier or principal that this
// reserve set (its tag) is cleared, so the next operation to cross that
// line raises the day's alert; it is still raised once. A reservation
// already settled is left alone. A re-sent script finds nothing to do.
// Returns {given back (1/0), flags cleared, site used, spend used,
// reservations}.
var withdrawScript = redis.NewScript(luaPrelude + `
local ttl, id = tonumber(ARGV[2]), ARGV[3]
reap(ARGV[1], ttl)
local tag = 'r:' .. id
local d = redis.call('HGET', KEYS[9], id)
if d and string.sub(d, 1, 1) == 'S' then
  return {0, 0, used(KEYS[1]), used(KEYS[2]), redis.call('ZCARD', KEYS[7])}
end
local back = 0
local info = redis.call('HGET', KEYS[8], id)
if info then
  giveback(id, info, ttl)
  back = 1
end
local cleared = 0
for i = 1, 4 do
  for _, f in ipairs({'warned', 'exhausted'}) do
    if redis.call('HGET', KEYS[i], f) == tag then
      redis.call('HDEL', KEYS[i], f)
      cleared = cleared + 1
    end
  end
end
return {back, cleared, used(KEYS[1]), used(KEYS[2]), redis.call('ZCARD', KEYS[7])}
`)
