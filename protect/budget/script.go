package budget

import "github.com/redis/go-redis/v9"

// batchScript runs a batch of operations of the principals' layout (see
// layout.go) in one atomic step: every reserve, settle, withdraw, release,
// lease report and read that one replica's callers sent to one cluster
// slot (on a single Redis, to the whole server) while the batch before was
// on its way (group commit, commit.go).
//
// ARGV: now (unix ms, the caller's clock: reservation expiry), key ttl
// seconds, ledger ttl seconds, the ledger's keep and cap (LedgerOptions),
// the number of registered export groups and their names, then the
// operations. An operation is one header of fields joined by "|" (its
// kind first, the number of free-text arguments that follow it last:
// identifiers are [A-Za-z0-9_-] and numbers, which never hold a "|";
// model names, request ids and raw reports, which may, come as arguments
// of their own). Each operation appends a fixed number of integers to the
// reply; ops.go reads them.
//
// Scope hashes are read once per batch (HMGET of every field the layout
// uses), changed in a Lua table, and written back at the end with one
// HSET and one EXPIRE per key that changed: however many calls of one
// principal a batch carries, its hashes cost three commands. A script
// runs atomically, so no other client sees the table's state in between.
//
// Ledger entries and records are appended by the billing feed's own
// fragment (luaLedger), as the day's layout appends them: each stream
// numbered, counted and kept for its export groups the same way. The
// reply ends with what the batch's records did to the day's stream:
// backlog, lost, unexported (ledgerPut's answer; the S operation answers
// its entry's own).
//
// Numbers are doubles in Lua, exact up to 2^53; Go bounds every amount
// there, and an operation whose amount is past it, negative or not a
// number answers status 4 and changes nothing. int() formats a number
// for Redis (a double's default form, "1e+15", is not an integer).
var batchScript = redis.NewScript(`
local now, ttl, lttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local keep, cap, ngroups = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local groups = {}
for i = 1, ngroups do groups[i] = ARGV[6 + i] end
local MAXN = 9007199254740991
local out = {}
local function int(n) return string.format('%d', n) end
local function num(v) return tonumber(v) or 0 end
` + luaLedger + `
local function push(...) for _, v in ipairs({...}) do out[#out + 1] = v end end
local function split(s)
  local t, i = {}, 1
  while true do
    local j = string.find(s, '|', i, true)
    if not j then t[#t + 1] = string.sub(s, i) return t end
    t[#t + 1] = string.sub(s, i, j - 1)
    i = j + 1
  end
end
-- amount is a header field that must be a whole number in [0, 2^53).
local function amount(v)
  local n = tonumber(v)
  if not n or n < 0 or n > MAXN or n ~= math.floor(n) then return nil end
  return n
end
local function bucketPrefix(day, bk) return 'faregate:budget:{' .. day .. ':b' .. bk .. '}:' end
local function dayPrefix(day) return 'faregate:budget:{' .. day .. '}:' end

-- One EXPIRE per key and script: a script's clock stands still.
local expiring = {}
local function expire(key, secs)
  if expiring[key] ~= secs then
    redis.call('EXPIRE', key, secs)
    expiring[key] = secs
  end
end

-- Scope hashes: tokens (settled, outstanding, overage), money in
-- micro-units for a principal and a task (m…), the part of outstanding
-- leased to replicas and the largest reservation seen (day scopes).
--
-- A field is read only when an operation needs its value (a check, a
-- block's size, a read), once per batch, and written back once at the end
-- of the batch: with one HSET of every field read, and one HINCRBY for
-- each field only added to (a settle adds to fields it never reads).
-- Each number read or written is a conversion between a string and a
-- double in Lua, which costs about as much as a simple command.
local FIELDS = {'settled', 'outstanding', 'overage', 'msettled', 'moutstanding', 'moverage', 'leased', 'largest'}
local scopes, order = {}, {}
local function entry(key)
  local s = scopes[key]
  if not s then
    s = {v = {}, d = {}, dirty = {}, read = false, new = false}
    scopes[key] = s
    order[#order + 1] = key
  end
  return s
end
-- fetch makes fields of key known, reading those not read yet this batch
-- (with what was added to them meanwhile), and returns the values.
local function fetch(key, ...)
  local s = entry(key)
  local want = {}
  for _, f in ipairs({...}) do
    if s.v[f] == nil then want[#want + 1] = f end
  end
  if #want > 0 then
    local r = redis.call('HMGET', key, unpack(want))
    local none = true
    for i, f in ipairs(want) do
      if r[i] then none = false end
      local d = s.d[f]
      s.v[f] = num(r[i]) + (d or 0)
      if d then
        s.d[f] = nil
        s.dirty[f] = true
      end
    end
    -- A scope none of whose fields exist is new: its expiry is set once,
    -- when it is written (its fields are never deleted, so a scope that
    -- has one has had its expiry set).
    if not s.read then s.new = none end
    s.read = true
  end
  return s.v
end
local function add(key, f, n)
  if n == 0 then return end
  local s = entry(key)
  if s.v[f] ~= nil then
    s.v[f] = s.v[f] + n
    s.dirty[f] = true
  else
    s.d[f] = (s.d[f] or 0) + n
  end
end
local function used(key)
  local v = fetch(key, 'settled', 'outstanding')
  return v.settled + v.outstanding
end
local function writeback()
  for _, key in ipairs(order) do
    local s, args = scopes[key], {}
    local fresh = s.new
    for _, f in ipairs(FIELDS) do
      if s.dirty[f] then
        args[#args + 1] = f
        args[#args + 1] = int(s.v[f])
      end
    end
    if #args > 0 then redis.call('HSET', key, unpack(args)) end
    for _, f in ipairs(FIELDS) do
      local d = s.d[f]
      if d and d ~= 0 then
        -- Never read: the first value of the field means a scope that
        -- may be new (setting its expiry again is harmless).
        if redis.call('HINCRBY', key, f, int(d)) == d and not s.read then fresh = true end
      end
    end
    if fresh and (#args > 0 or next(s.d)) then expire(key, ttl) end
  end
end

-- crossed reports whether key, now at u, is at 80% of limit or more and
-- this operation (tag) is the one that first saw it today; a re-sent
-- operation (lost reply) reports the same crossing again.
local function crossed(key, u, limit, tag)
  if limit <= 0 or u * 5 < limit * 4 then return 0 end
  if redis.call('HSETNX', key, 'warned', tag) == 1 then
    expire(key, ttl)
    return 1
  end
  if redis.call('HGET', key, 'warned') == tag then return 1 end
  return 0
end
-- first reports whether this refusal (tag) is the scope's first today.
local function first(key, tag)
  if redis.call('HSETNX', key, 'exhausted', tag) == 1 then
    expire(key, ttl)
    return 1
  end
  if redis.call('HGET', key, 'exhausted') == tag then return 1 end
  return 0
end
-- clear removes the warning and exhaustion flags (with warnedOnly, the
-- warnings) tag set on keys.
local function clear(keys, tag, warnedOnly)
  local flags = {'warned', 'exhausted'}
  if warnedOnly then flags = {'warned'} end
  local n = 0
  for _, key in ipairs(keys) do
    for _, f in ipairs(flags) do
      if redis.call('HGET', key, f) == tag then
        redis.call('HDEL', key, f)
        n = n + 1
      end
    end
  end
  return n
end

-- A principal's reservation: res[id] = "expiry|tokens|cost|principal|tier|task|model".
local function parseInfo(info)
  local tok, cost, p, tier, task = string.match(info, '^(%d+)|(%d+)|([^|]+)|([^|]*)|([^|]+)|')
  return tonumber(tok), tonumber(cost), p, tier, task
end
local function holdPrincipal(B, p, task, tok, cost)
  for _, k in ipairs({B .. 'p:' .. p, B .. 'task:' .. task}) do
    add(k, 'outstanding', tok)
    add(k, 'moutstanding', cost)
  end
end
local function giveBack(B, id, info)
  local tok, cost, p, _, task = parseInfo(info)
  if tok then holdPrincipal(B, p, task, -tok, -cost) end
  redis.call('HDEL', B .. 'res', id)
  redis.call('HSET', B .. 'done', id, 'R|0|0|0|0|0|' .. info)
  expire(B .. 'done', ttl)
end
-- The reaper gives back the slot's reservations whose expiry (the
-- caller's clock) has passed, at most 256 a batch. res["~next"] holds the
-- earliest expiry of the open ones (or one since settled), so a batch
-- reads one field to know whether anything is due, and scans the open
-- reservations only when something is.
-- reapDue is the reaper of one hash of open reservations (a slot's res,
-- a day's dres): it calls give(id, info) for at most 256 whose expiry has
-- passed and returns the earliest expiry left open (nil: none).
local function reapDue(hash, give)
  local nxt = tonumber(redis.call('HGET', hash, '~next'))
  if not (nxt and nxt <= now) then return nxt end
  local all, n = redis.call('HGETALL', hash), 0
  nxt = nil
  for i = 1, #all, 2 do
    local id = all[i]
    local exp, info = string.match(all[i + 1], '^(%d+)|(.*)$')
    if id ~= '~next' and exp then
      exp = tonumber(exp)
      if exp <= now and n < 256 then
        give(id, info)
        n = n + 1
      elseif not nxt or exp < nxt then
        nxt = exp
      end
    end
  end
  if nxt then redis.call('HSET', hash, '~next', int(nxt)) else redis.call('HDEL', hash, '~next') end
  return nxt
end
-- markDue records a new open reservation's expiry in hash's ~next, and in
-- memo[key], what this batch knows of it.
local function markDue(hash, memo, key, exp)
  local nxt = memo[key]
  if not nxt or exp < nxt then
    redis.call('HSET', hash, '~next', int(exp))
    memo[key] = exp
  end
end
local nextOf = {}
local function reapBucket(B)
  if nextOf[B] ~= nil then return end
  nextOf[B] = reapDue(B .. 'res', function(id, info) giveBack(B, id, info) end) or false
end
-- due records a new open reservation's expiry in its slot's ~next.
local function due(B, exp) markDue(B .. 'res', nextOf, B, exp) end

-- Redis's own clock, read once per batch: leases expire by it, never by
-- a replica's.
local clock
local function time()
  if not clock then
    local t = redis.call('TIME')
    clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock
end
-- dayEntry appends a record to the day's stream by the ledger's rules
-- (luaLedger: numbered, trimmed, kept for export groups), and folds what
-- the append did into recorded, the batch's last three answers: backlog
-- (1: the 80% line was crossed), lost, unexported (-1: not counted).
local recorded = {0, 0, -1}
local function dayEntry(day, known, ...)
  local s = 'faregate:usage:{' .. day .. '}'
  local r = ledgerPut(s, s .. ':sums', keep, cap, lttl, groups, {...}, nil, nil, known)
  recorded = {math.max(recorded[1], r[1]), recorded[2] + r[2], math.max(recorded[3], r[3])}
end
-- expireLease charges what a lease still held when it expired (its
-- replica stopped reporting: it may have spent all of it), records the
-- charge in the day's stream and remembers it (x:<scope>) so that a
-- report the replica sends after all is not charged twice.
local function expireLease(D, day, id)
  local lk = D .. 'lease:' .. id
  local all = redis.call('HGETALL', lk)
  for i = 1, #all, 2 do
    local f, v = all[i], tonumber(all[i + 1]) or 0
    if string.sub(f, 1, 2) == 'g:' and v > 0 then
      local name = string.sub(f, 3)
      add(D .. name, 'settled', v)
      add(D .. name, 'outstanding', -v)
      add(D .. name, 'leased', -v)
      redis.call('HSET', lk, f, 0)
      redis.call('HINCRBY', lk, 'x:' .. name, int(v))
      dayEntry(day, false, 'kind', 'lease', 'lease', id, 'scope', name, 'amount', int(v), 'overage', '0',
        'explained', '0', 'expired', '1')
    end
  end
  redis.call('HSET', lk, 'dead', '1')
  expire(lk, ttl)
  redis.call('ZREM', D .. 'leases', id)
end
-- The day's reaper: expired leases (Redis's clock) and direct
-- reservations whose expiry (the caller's clock) has passed, as
-- reapBucket, on every batch that touches the day.
local reapedDay = {}
local function giveBackDirect(D, id, info)
  local tok, cost, tier = string.match(info, '^(%d+)|(%d+)|([^|]*)|')
  if tok then
    tok, cost = tonumber(tok), tonumber(cost)
    add(D .. 'site', 'outstanding', -tok)
    add(D .. 'spend', 'outstanding', -cost)
    if tier ~= '' then add(D .. 'tier:' .. tier, 'outstanding', -tok) end
  end
  redis.call('HDEL', D .. 'dres', id)
  redis.call('HSET', D .. 'ddone', id, 'R|0|0|0|0|0|' .. info)
  expire(D .. 'ddone', ttl)
end
local dayNext = {}
local function reapDay(D, day)
  if dayNext[D] ~= nil then return end
  -- Redis's clock is read only where leases exist (TIME needs its own
  -- ACL grant; a deployment without leases never asks for it).
  if redis.call('EXISTS', D .. 'leases') == 1 then
    local ids = redis.call('ZRANGEBYSCORE', D .. 'leases', '-inf', time(), 'LIMIT', 0, 16)
    for _, id in ipairs(ids) do expireLease(D, day, id) end
  end
  dayNext[D] = reapDue(D .. 'dres', function(id, info) giveBackDirect(D, id, info) end) or false
end
local function dueDay(D, exp) markDue(D .. 'dres', dayNext, D, exp) end

local ops = {}
-- refusedR are the ids whose R this batch refused: their D, sent at once
-- behind it (same batch on a single Redis), holds nothing.
local refusedR = {}

-- R: reserve in a principal's slot. f: id, day, bucket, principal, task,
-- tier, tokens, cost, principal limit, task limit, expiry; x: model.
-- Answers status (1 granted, 2 granted before, 0 refused, 3 id taken, 4
-- invalid), scope (5 task, 4 principal), remaining, first, principal
-- warned, principal used.
ops.R = function(f, x)
  local id, day, bk, p, task, tier = f[2], f[3], f[4], f[5], f[6], f[7]
  local tok, cost, plimit, tlimit, exp = amount(f[8]), amount(f[9]), amount(f[10]), amount(f[11]), amount(f[12])
  if not (tok and cost and plimit and tlimit and exp) then
    refusedR[id] = true
    return push(4, 0, 0, 0, 0, 0)
  end
  local B = bucketPrefix(day, bk)
  reapBucket(B)
  local info = int(tok) .. '|' .. int(cost) .. '|' .. p .. '|' .. tier .. '|' .. task .. '|' .. x[1]
  local tag, pk, tk = 'r:' .. id, B .. 'p:' .. p, B .. 'task:' .. task
  local function answer(st, sc, rem, fst)
    local w = 0
    if st == 1 or st == 2 then w = crossed(pk, used(pk), plimit, tag) else refusedR[id] = true end
    push(st, sc, rem, fst, w, used(pk))
  end
  -- The id is made before the call: a re-send whose first reply was lost
  -- meets the first success here, even one given back since.
  local prev = redis.call('HGET', B .. 'res', id)
  if prev then
    if string.match(prev, '^%d+|(.*)$') == info then return answer(2, 0, 0, 0) end
    return answer(3, 0, 0, 0)
  end
  local d = redis.call('HGET', B .. 'done', id)
  if d then
    if d == 'R|0|0|0|0|0|' .. info then return answer(2, 0, 0, 0) end
    return answer(3, 0, 0, 0)
  end
  if tlimit > 0 and used(tk) + tok > tlimit then return answer(0, 5, math.max(tlimit - used(tk), 0), 0) end
  if plimit > 0 and used(pk) + tok > plimit then return answer(0, 4, math.max(plimit - used(pk), 0), first(pk, tag)) end
  holdPrincipal(B, p, task, tok, cost)
  redis.call('HSET', B .. 'res', id, int(exp) .. '|' .. info)
  due(B, exp)
  expire(B .. 'res', ttl)
  return answer(1, 0, 0, 0)
end

-- S: settle in a principal's slot, with the call's ledger entry in the
-- slot's stream (luaLedger, as the day's layout writes it). f: id, day,
-- bucket, principal, task, tier, held tokens, held cost, tokens, cost,
-- ledger (1/0), principal limit, expiry known (1: skip the EXPIRE of
-- done); x: model, then with a ledger entry Ledger.argv's block, from
-- ARGV[xi + 1]. Answers status (1 settled, 2 settled before, 0 unknown, 4
-- invalid), tokens, cost, overage tokens, overage cost, late, principal
-- warned, principal used, then the entry's backlog, lost, unexported
-- (ledgerAppendArgv; 0, 0, -1 without an entry).
ops.S = function(f, x, xi)
  local id, day, bk, p, task, tier = f[2], f[3], f[4], f[5], f[6], f[7]
  local rt, rc, at, ac, plimit = amount(f[8]), amount(f[9]), amount(f[10]), amount(f[11]), amount(f[13])
  if not (rt and rc and at and ac and plimit) then return push(4, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1) end
  local B = bucketPrefix(day, bk)
  reapBucket(B)
  local info = int(rt) .. '|' .. int(rc) .. '|' .. p .. '|' .. tier .. '|' .. task .. '|' .. x[1]
  local tag, pk, tk = 's:' .. id, B .. 'p:' .. p, B .. 'task:' .. task
  -- known: this replica set the expiry of the slot's done and stream
  -- within the last minute (they are never deleted before it runs out).
  local known = f[14] == '1'
  local ledger = {0, 0, -1}
  local function answer(st, t, c, ot, oc, late)
    local w = 0
    if st ~= 0 then w = crossed(pk, used(pk), plimit, tag) end
    push(st, t, c, ot, oc, late, w, used(pk), ledger[1], ledger[2], ledger[3])
  end
  local function charge(t, c, ot, oc)
    for _, k in ipairs({pk, tk}) do
      add(k, 'settled', t)
      add(k, 'overage', ot)
      add(k, 'msettled', c)
      add(k, 'moverage', oc)
    end
  end
  -- The entry is written exactly when the settlement is first recorded.
  local function record(ot, oc, late)
    redis.call('HSET', B .. 'done', id, 'S|' .. int(at) .. '|' .. int(ac) .. '|' .. int(ot) .. '|' .. int(oc) .. '|' .. late .. '|' .. info)
    if not known then expire(B .. 'done', ttl) end
    if f[12] == '1' then
      local sk = 'faregate:usage:{' .. day .. ':b' .. bk .. '}'
      ledger = ledgerAppendArgv(sk, sk .. ':sums', xi + 1, ac, ot, oc, id, known)
    end
  end
  local open = redis.call('HGET', B .. 'res', id)
  if open then
    if string.match(open, '^%d+|(.*)$') ~= info then return answer(0, 0, 0, 0, 0, 0) end
    local ot, oc = math.max(at - rt, 0), math.max(ac - rc, 0)
    holdPrincipal(B, p, task, -rt, -rc)
    charge(at, ac, ot, oc)
    redis.call('HDEL', B .. 'res', id)
    record(ot, oc, 0)
    return answer(1, at, ac, ot, oc, 0)
  end
  local d = redis.call('HGET', B .. 'done', id)
  if not d then return answer(0, 0, 0, 0, 0, 0) end
  local st, t, c, ot, oc, late, rest = string.match(d, '^([RS])|(%d+)|(%d+)|(%d+)|(%d+)|(%d)|(.*)$')
  if rest ~= info then return answer(0, 0, 0, 0, 0, 0) end
  if st == 'S' then return answer(2, tonumber(t), tonumber(c), tonumber(ot), tonumber(oc), tonumber(late)) end
  -- Given back before the settle arrived: charged in full, all overage.
  charge(at, ac, at, ac)
  record(at, ac, 1)
  return answer(1, at, ac, at, ac, 1)
end

-- W: withdraw in a principal's slot. f: id, day, bucket, principal.
-- Answers given back (1/0), flags cleared.
ops.W = function(f)
  local id, day, bk, p = f[2], f[3], f[4], f[5]
  local B = bucketPrefix(day, bk)
  local d = redis.call('HGET', B .. 'done', id)
  if d and string.sub(d, 1, 1) == 'S' then return push(0, 0) end
  local back = 0
  local open = redis.call('HGET', B .. 'res', id)
  if open then
    giveBack(B, id, string.match(open, '^%d+|(.*)$'))
    back = 1
  end
  push(back, clear({B .. 'p:' .. p}, 'r:' .. id))
end

-- T: release a task's open reservations in its principal's slot. f: op
-- id, day, bucket, task. Answers released, still open; a re-sent op
-- answers its first count.
ops.T = function(f)
  local op, day, bk, task = 'op:' .. f[2], f[3], f[4], f[5]
  local B = bucketPrefix(day, bk)
  local prev = redis.call('HGET', B .. 'done', op)
  local all, n, left = redis.call('HGETALL', B .. 'res'), 0, 0
  for i = 1, #all, 2 do
    local id = all[i]
    local info = string.match(all[i + 1], '^%d+|(.*)$')
    if id ~= '~next' and info and select(5, parseInfo(info)) == task then
      if not prev and n < 256 then
        giveBack(B, id, info)
        n = n + 1
      else
        left = left + 1
      end
    end
  end
  if prev then return push(tonumber(prev), left) end
  if n > 0 then
    redis.call('HSET', B .. 'done', op, n)
    expire(B .. 'done', ttl)
  end
  push(n, left)
end

-- U: read a principal and a task. f: day, bucket, principal, task.
-- Answers the principal's and the task's settled, outstanding, overage
-- in tokens then in money, and the principal's open reservations.
ops.U = function(f)
  local day, bk, p, task = f[2], f[3], f[4], f[5]
  local B = bucketPrefix(day, bk)
  reapBucket(B)
  for _, k in ipairs({B .. 'p:' .. p, B .. 'task:' .. task}) do
    local v = fetch(k, 'settled', 'outstanding', 'overage', 'msettled', 'moutstanding', 'moverage')
    push(v.settled, v.outstanding, v.overage, v.msettled, v.moutstanding, v.moverage)
  end
  local all, n = redis.call('HGETALL', B .. 'res'), 0
  for i = 1, #all, 2 do
    local info = string.match(all[i + 1], '^%d+|(.*)$')
    if all[i] ~= '~next' and info and select(3, parseInfo(info)) == p then n = n + 1 end
  end
  push(n)
end

-- A: could a principal hold tokens now. f: tag, day, bucket, principal,
-- limit, tokens. Answers ok, remaining, first, used.
ops.A = function(f)
  local tag, day, bk, p, plimit, tok = f[2], f[3], f[4], f[5], tonumber(f[6]), tonumber(f[7])
  local B = bucketPrefix(day, bk)
  reapBucket(B)
  local pk = B .. 'p:' .. p
  local u = used(pk)
  if plimit > 0 and u + tok > plimit then return push(0, math.max(plimit - u, 0), first(pk, tag), u) end
  push(1, 0, 0, u)
end

-- Y: the day's layout, decided once by the first operation of the day:
-- 1 when a faregate of the day-tagged layout already wrote the site's
-- scope, else 2 (this one).
ops.Y = function(f)
  local site = dayPrefix(f[2]) .. 'site'
  local v = redis.call('HGET', site, 'layout')
  if not v then
    v = '2'
    if redis.call('EXISTS', site) == 1 then v = '1' end
    redis.call('HSET', site, 'layout', v)
    expire(site, ttl)
  end
  push(tonumber(v))
end

-- L: one replica's lease of the day's scopes: report what it spent,
-- give back what it asks to, and top up a scope whose unspent part is
-- short of a call. f: day, lease id, sequence, ttl ms, close (1/0), tag,
-- count, then per scope: name, limit (0: counted, never held), spent,
-- give back, need, unspent (frozen while the operation is on its way),
-- largest reservation, block in calls; then, when a call asked for the
-- operation, the call as D's header has it (id to task), with its model
-- in x. Answers status (1 done, 2 the lease expired meanwhile, 3 a
-- re-send: nothing done again), replicas, then per scope: what the lease
-- holds, fallback (1: per call from now), used, warned; then for the call
-- D's answer when a scope it needs went per call in this operation (it is
-- reserved per call here, in the same round trip), else 5 and nine zeros.
ops.L = function(f, x)
  local day, lease, seq, leaseMS, close, tag, n = f[2], f[3], tonumber(f[4]), tonumber(f[5]), f[6] == '1', f[7], tonumber(f[8])
  local D = dayPrefix(day)
  reapDay(D, day)
  local T, lk, lz = time(), D .. 'lease:' .. f[3], D .. 'leases'
  local st = redis.call('HMGET', lk, 'seq', 'dead')
  local status = 1
  if st[2] == '1' then status = 2 elseif seq <= num(st[1]) then status = 3 end
  -- Replicas: the live leases of the day, this one included.
  local replicas = redis.call('ZCOUNT', lz, '(' .. T, '+inf')
  local mine = redis.call('ZSCORE', lz, lease)
  if not (mine and tonumber(mine) > T) then replicas = replicas + 1 end
  push(status, replicas)
  local total, perCall = 0, false
  for i = 0, n - 1 do
    local b = 9 + i * 8
    local name = f[b]
    local limit, c, r, need, a, lg, calls = tonumber(f[b + 1]), tonumber(f[b + 2]), tonumber(f[b + 3]),
      tonumber(f[b + 4]), tonumber(f[b + 5]), tonumber(f[b + 6]), tonumber(f[b + 7])
    local key = D .. name
    local gx = redis.call('HMGET', lk, 'g:' .. name, 'x:' .. name)
    local g, x = num(gx[1]), num(gx[2])
    local fb, w = 0, 0
    if status == 2 and c > 0 then
      -- Spent under a lease the reaper already charged: what its charge
      -- covered is explained, the rest charged now, as overage.
      local e = math.min(c, x)
      add(key, 'settled', c - e)
      add(key, 'overage', c - e)
      redis.call('HSET', lk, 'x:' .. name, int(x - e))
      dayEntry(day, false, 'kind', 'lease', 'lease', lease, 'scope', name, 'amount', int(c - e), 'overage', int(c - e),
        'explained', int(e), 'expired', '1')
    elseif status == 1 then
      local s = fetch(key, 'settled', 'outstanding', 'largest')
      if c > 0 then
        -- What passes the lease's hold is overage; a scope that is only
        -- counted (no limit) holds nothing, and has none.
        local take = math.min(c, g)
        local over = c - take
        if limit <= 0 then over = 0 end
        add(key, 'settled', c)
        add(key, 'outstanding', -take)
        add(key, 'leased', -take)
        add(key, 'overage', over)
        g = g - take
        dayEntry(day, false, 'kind', 'lease', 'lease', lease, 'scope', name, 'amount', int(c), 'overage', int(over),
          'explained', '0', 'expired', '0')
      end
      if r > 0 then
        r = math.min(r, g)
        add(key, 'outstanding', -r)
        add(key, 'leased', -r)
        g = g - r
      end
      if lg > s.largest then add(key, 'largest', lg - s.largest) end
      if need > 0 and limit > 0 and not close then
        -- Blocks shrink with the headroom (a quarter of it shared among
        -- the replicas), never past calls × the largest reservation, and
        -- leave every other replica room for its largest call; below
        -- replicas × largest the scope goes per call, and this replica's
        -- unspent part goes back at once.
        local L = s.largest
        local free = limit - s.settled - s.outstanding + a
        local block = 0
        if free >= replicas * L then
          block = math.min(math.max(math.floor(free / (4 * replicas)), need), calls * L, free - (replicas - 1) * L)
        end
        if block < need then
          fb, perCall = 1, true
          local back = math.min(a, g)
          add(key, 'outstanding', -back)
          add(key, 'leased', -back)
          g = g - back
        elseif block > a then
          add(key, 'outstanding', block - a)
          add(key, 'leased', block - a)
          g = g + block - a
          w = crossed(key, used(key), limit, tag)
        end
      end
      redis.call('HSET', lk, 'g:' .. name, int(g))
    end
    total = total + g
    push(g, fb, used(key), w)
  end
  if status == 1 then
    redis.call('HSET', lk, 'seq', int(seq))
    expire(lk, ttl)
    if close and total == 0 then
      redis.call('ZREM', lz, lease)
    else
      redis.call('ZADD', lz, T + leaseMS, lease)
      expire(lz, ttl)
    end
  end
  -- The header's last field is its count of arguments: a call's ten
  -- fields come before it.
  local c = 9 + n * 8
  if #f >= c + 10 then
    if perCall then
      ops.D({'D', f[c], day, f[c + 1], f[c + 2], f[c + 3], f[c + 4], f[c + 5], f[c + 6], f[c + 7], f[c + 8], f[c + 9]}, x)
    else
      push(5, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    end
  end
end

-- The day's scopes a direct (per call) reservation holds: site tokens,
-- site money and the tier's tokens (scope numbers 1, 2, 3).
local function dayScopes(D, tier, tok, cost, slimit, mlimit, tlimit)
  return {D .. 'site', D .. 'spend', D .. 'tier:' .. tier}, {tok, cost, tok}, {slimit, mlimit, tlimit},
    {true, true, tier ~= ''}
end
local function pushDay(keys, lim, act, charged, tag)
  local w = {0, 0, 0}
  for i = 1, 3 do
    if act[i] and charged then w[i] = crossed(keys[i], used(keys[i]), lim[i], tag) end
  end
  push(w[1], w[2], w[3])
  for i = 1, 3 do
    if act[i] then push(used(keys[i])) else push(0) end
  end
end

-- D: a direct reservation of the day's scopes (a scope in per-call
-- fallback, or leasing off). f: id, day, tokens, cost, tier, site limit,
-- spend limit, tier limit, expiry, principal, task; x: model. Answers status (as R;
-- 6: not tried, this batch refused the call's R),
-- scope (3 tier, 1 site, 2 spend), remaining, first, then warned and used
-- of site, spend, tier.
ops.D = function(f, x)
  local id, day, tier, p, task = f[2], f[3], f[6], f[11], f[12]
  -- The call is refused already: holding the day's scopes until its
  -- withdraw would refuse calls they could afford.
  if refusedR[id] then return push(6, 0, 0, 0, 0, 0, 0, 0, 0, 0) end
  local tok, cost, sl, ml, tl, exp = amount(f[4]), amount(f[5]), amount(f[7]), amount(f[8]), amount(f[9]), amount(f[10])
  if not (tok and cost and sl and ml and tl and exp) then return push(4, 0, 0, 0, 0, 0, 0, 0, 0, 0) end
  local D = dayPrefix(day)
  reapDay(D, day)
  local keys, amt, lim, act = dayScopes(D, tier, tok, cost, sl, ml, tl)
  local info = int(tok) .. '|' .. int(cost) .. '|' .. tier .. '|' .. p .. '|' .. task .. '|' .. x[1]
  local tag = 'r:' .. id
  local function answer(st, sc, rem, fst)
    push(st, sc, rem, fst)
    pushDay(keys, lim, act, st == 1 or st == 2, tag)
  end
  local prev = redis.call('HGET', D .. 'dres', id)
  if prev then
    if string.match(prev, '^%d+|(.*)$') == info then return answer(2, 0, 0, 0) end
    return answer(3, 0, 0, 0)
  end
  local d = redis.call('HGET', D .. 'ddone', id)
  if d then
    if d == 'R|0|0|0|0|0|' .. info then return answer(2, 0, 0, 0) end
    return answer(3, 0, 0, 0)
  end
  for _, i in ipairs({3, 1, 2}) do
    if act[i] and lim[i] > 0 and used(keys[i]) + amt[i] > lim[i] then
      return answer(0, i, math.max(lim[i] - used(keys[i]), 0), first(keys[i], tag))
    end
  end
  for i = 1, 3 do
    if act[i] then add(keys[i], 'outstanding', amt[i]) end
  end
  redis.call('HSET', D .. 'dres', id, int(exp) .. '|' .. info)
  dueDay(D, exp)
  expire(D .. 'dres', ttl)
  answer(1, 0, 0, 0)
end

-- E: settle a direct reservation, with its record in the day's stream.
-- f: id, day, held tokens, held cost, tier, tokens, cost, principal, task,
-- site limit, spend limit, tier limit, force (1: charge a reservation
-- this slot never held, all as overage: a leased one settled by another
-- replica), expiry known (as S's, for ddone and the day's stream); x:
-- model. Answers status, tokens, cost, overage tokens, overage cost,
-- late (as S), then warned and used of site, spend, tier.
ops.E = function(f, x)
  local id, day, tier, p, task = f[2], f[3], f[6], f[9], f[10]
  local rt, rc, at, ac = amount(f[4]), amount(f[5]), amount(f[7]), amount(f[8])
  local sl, ml, tl = amount(f[11]), amount(f[12]), amount(f[13])
  if not (rt and rc and at and ac and sl and ml and tl) then return push(4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) end
  local D = dayPrefix(day)
  reapDay(D, day)
  local keys, _, lim, act = dayScopes(D, tier, 0, 0, sl, ml, tl)
  local info = int(rt) .. '|' .. int(rc) .. '|' .. tier .. '|' .. p .. '|' .. task .. '|' .. x[1]
  local tag = 's:' .. id
  local function answer(st, t, c, ot, oc, late)
    push(st, t, c, ot, oc, late)
    pushDay(keys, lim, act, st ~= 0, tag)
  end
  local function settle(ht, hc, ot, oc, late)
    local held, actual, over = {ht, hc, ht}, {at, ac, at}, {ot, oc, ot}
    for i = 1, 3 do
      if act[i] then
        add(keys[i], 'outstanding', -held[i])
        add(keys[i], 'settled', actual[i])
        add(keys[i], 'overage', over[i])
      end
    end
    redis.call('HDEL', D .. 'dres', id)
    redis.call('HSET', D .. 'ddone', id, 'S|' .. int(at) .. '|' .. int(ac) .. '|' .. int(ot) .. '|' .. int(oc) .. '|' .. late .. '|' .. info)
    dayEntry(day, f[15] == '1', 'kind', 'direct', 'reservation', id, 'principal', p, 'task', task, 'tier', tier,
      'tokens', int(at), 'cost_micro', int(ac), 'overage_tokens', int(ot), 'overage_cost_micro', int(oc), 'late', late)
    if f[15] ~= '1' then expire(D .. 'ddone', ttl) end
    answer(1, at, ac, ot, oc, late)
  end
  local open = redis.call('HGET', D .. 'dres', id)
  if open then
    if string.match(open, '^%d+|(.*)$') ~= info then return answer(0, 0, 0, 0, 0, 0) end
    return settle(rt, rc, math.max(at - rt, 0), math.max(ac - rc, 0), 0)
  end
  local d = redis.call('HGET', D .. 'ddone', id)
  if d then
    local st, t, c, ot, oc, late, rest = string.match(d, '^([RS])|(%d+)|(%d+)|(%d+)|(%d+)|(%d)|(.*)$')
    if rest ~= info then return answer(0, 0, 0, 0, 0, 0) end
    if st == 'S' then return answer(2, tonumber(t), tonumber(c), tonumber(ot), tonumber(oc), tonumber(late)) end
    return settle(0, 0, at, ac, 1)
  end
  if f[14] == '1' then return settle(0, 0, at, ac, 1) end
  answer(0, 0, 0, 0, 0, 0)
end

-- X: withdraw in the day's slot: a direct reservation is given back, and
-- the flags of site, spend and tier the reserve (or its lease operation)
-- set are cleared: both kinds, or with f[5] = 'w' its warnings only (a
-- reserve refused in the day's slot keeps the exhaustion it reports).
-- f: id, day, tier, which. Answers given back, flags cleared.
ops.X = function(f)
  local id, day, tier = f[2], f[3], f[4]
  local D = dayPrefix(day)
  local d = redis.call('HGET', D .. 'ddone', id)
  if d and string.sub(d, 1, 1) == 'S' then return push(0, 0) end
  local back = 0
  local open = redis.call('HGET', D .. 'dres', id)
  if open then
    giveBackDirect(D, id, string.match(open, '^%d+|(.*)$'))
    back = 1
  end
  local keys = {D .. 'site', D .. 'spend'}
  if tier ~= '' then keys[3] = D .. 'tier:' .. tier end
  push(back, clear(keys, 'r:' .. id, f[5] == 'w'))
end

-- Z: release a task's direct reservations. f: op id, day, task. Answers
-- released (a re-sent op: its first count).
ops.Z = function(f)
  local op, day, task = 'op:' .. f[2], f[3], f[4]
  local D = dayPrefix(day)
  local prev = redis.call('HGET', D .. 'ddone', op)
  if prev then return push(tonumber(prev)) end
  local all, n = redis.call('HGETALL', D .. 'dres'), 0
  for i = 1, #all, 2 do
    local info = string.match(all[i + 1], '^%d+|(.*)$')
    if all[i] ~= '~next' and info and n < 256 and select(5, string.match(info, '^(%d+)|(%d+)|([^|]*)|([^|]+)|([^|]+)|')) == task then
      giveBackDirect(D, all[i], info)
      n = n + 1
    end
  end
  if n > 0 then
    redis.call('HSET', D .. 'ddone', op, n)
    expire(D .. 'ddone', ttl)
  end
  push(n)
end

-- V: read the day's scopes. f: day, tier. Answers settled, outstanding,
-- overage and leased of site, spend and tier, the open direct
-- reservations, the live leases.
ops.V = function(f)
  local day, tier = f[2], f[3]
  local D = dayPrefix(day)
  reapDay(D, day)
  local keys = {D .. 'site', D .. 'spend', D .. 'tier:' .. tier}
  for i, k in ipairs(keys) do
    if i < 3 or tier ~= '' then
      local v = fetch(k, 'settled', 'outstanding', 'overage', 'leased')
      push(v.settled, v.outstanding, v.overage, v.leased)
    else
      push(0, 0, 0, 0)
    end
  end
  local n = redis.call('HLEN', D .. 'dres')
  if redis.call('HEXISTS', D .. 'dres', '~next') == 1 then n = n - 1 end
  local live = 0
  if redis.call('EXISTS', D .. 'leases') == 1 then live = redis.call('ZCOUNT', D .. 'leases', '(' .. time(), '+inf') end
  push(n, live)
end

-- F: could the day's scopes hold an amount now. f: tag, day, tokens,
-- cost, tier, site limit, spend limit, tier limit. Answers ok, scope,
-- remaining, first, site used, spend used.
ops.F = function(f)
  local tag, day, tier = f[2], f[3], f[6]
  local D = dayPrefix(day)
  reapDay(D, day)
  local keys, amt, lim, act = dayScopes(D, tier, tonumber(f[4]), tonumber(f[5]), tonumber(f[7]), tonumber(f[8]), tonumber(f[9]))
  for _, i in ipairs({3, 1, 2}) do
    if act[i] and lim[i] > 0 and used(keys[i]) + amt[i] > lim[i] then
      return push(0, i, math.max(lim[i] - used(keys[i]), 0), first(keys[i], tag), used(keys[1]), used(keys[2]))
    end
  end
  push(1, 0, 0, 0, used(keys[1]), used(keys[2]))
end

local i = 7 + ngroups
while i <= #ARGV do
  local f = split(ARGV[i])
  local nx = tonumber(f[#f]) or 0
  local x = {}
  for j = 1, nx do x[j] = ARGV[i + j] end
  ops[f[1]](f, x, i + 1)
  i = i + 1 + nx
end
writeback()
for j = 1, 3 do out[#out + 1] = recorded[j] end
return out
`)
