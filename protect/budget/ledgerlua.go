package budget

import "github.com/redis/go-redis/v9"

// luaLedger is the ledger's own Lua: appending an entry to a day's stream
// and keeping the stream's length, in one fragment that any script writing
// entries carries (the settle script, Ledger.Append's) and the export's
// acknowledgement runs too. It needs the prelude's int and num.
//
// Each stream has a counters hash beside it (sumsKey, same slot):
//
//	seq        entries ever appended; each entry carries its number
//	keep, cap  the shape its last writer gave it, which an export's
//	           acknowledgement keeps (LedgerOptions)
//	groups     1 while an export group reads the stream
//	m|<model>  the model's totals: calls errors cut estimated prompt
//	           completion reserved cost overage overage_cost
//	trimmed    entries trimmed after export, or with no export group
//	lost       entries dropped before any export group acknowledged them
//	backlog    set while the unexported entries are past 80% of the cap
//
// Entries leave a stream only from its head (XTRIM), so its entries are
// numbered n-L+1 … n (L its length, n the last seq), and how many of them
// no export group has acknowledged follows from the seq of the oldest one
// that some group has not.
//
// Without an export group a stream keeps its newest keep entries (today's
// trim, MAXLEN ~) and expires ttl after its last entry. With one, an entry
// no group has acknowledged is neither trimmed nor expired while the
// stream holds at most cap entries: past cap, the oldest are dropped
// (counted lost), never the write refused; acknowledged entries are
// trimmed as without a group. The stream and its counters expire ttl after
// everything was acknowledged.
//
// The numbers (and the 80% line) are computed when the stream holds more
// than keep, or more than 80% of cap, on one append in 16, or on every
// append once it holds more than cap, and after every acknowledgement; a
// stream shorter than that needs nothing but its append.
//
// ledgerPut(stream, sums, keep, cap, ttl, groups, fields, model, counts,
// known) appends any entry: a model call's (with its model and counts), or
// a record that is no call (the principals' layout's records of what
// leased blocks and direct reservations charged the day's scopes, with a
// kind field), numbered and trimmed by the same rules, so that an export
// group's unexported entries are counted the same way in every stream.
// known (optional) says the caller set the stream's expiry less than a
// minute ago: a stream without an export group is then not given it
// again (the principals' layout saves two commands a call so; the stream
// still expires ttl after its last entry, give or take that minute).
//
// ledgerAppendArgv(stream, sums, base, cost, ovtok, ovcost, reservation,
// known)
// reads the entry from ARGV[base] on, in the order Ledger.argv writes:
// keep, cap, ttl, task, model, principal, tier, request id, prompt,
// completion, reasoning, cache creation, cache read, reserved, latency ms,
// outcome, status, estimated (1/0), raw usage, implausible (1/0), error
// (1/0), cut (1/0), the number of registered export groups and their
// names. It returns {backlog (1 the first time the 80% line was crossed),
// lost (entries this append dropped), unexported (-1 when not computed)}.
const luaLedger = `
local function ledgerSeq(e, first)
  local f = e[2]
  for i = #f - 1, 1, -2 do
    if f[i] == 'seq' then return tonumber(f[i + 1]) or first end
  end
  return first
end
-- ledgerOldest is the seq of the oldest entry some export group has not
-- acknowledged (nil: none), and the number of groups.
local function ledgerOldest(stream, first)
  local gs = redis.call('XINFO', 'GROUPS', stream)
  local best
  for _, g in ipairs(gs) do
    local name, pending, last
    for i = 1, #g, 2 do
      local k = g[i]
      if k == 'name' then name = g[i + 1]
      elseif k == 'pending' then pending = tonumber(g[i + 1]) or 0
      elseif k == 'last-delivered-id' then last = g[i + 1] end
    end
    local from = '(' .. last
    if pending > 0 then from = redis.call('XPENDING', stream, name)[2] end
    local e = redis.call('XRANGE', stream, from, '+', 'COUNT', 1)[1]
    if e then
      local s = ledgerSeq(e, first)
      if not best or s < best then best = s end
    end
  end
  return best, #gs
end
-- ledgerTrim keeps the stream of an export group within keep acknowledged
-- entries and cap in all, and sets its expiry.
local function ledgerTrim(stream, sums, keep, cap, ttl)
  local n = num(redis.call('HGET', sums, 'seq'))
  local L = redis.call('XLEN', stream)
  local first = n - L + 1
  local oldest, groups = ledgerOldest(stream, first)
  if groups == 0 then
    redis.call('HSET', sums, 'groups', 0)
    local d = 0
    if L > keep then d = redis.call('XTRIM', stream, 'MAXLEN', '~', keep) end
    if d > 0 then redis.call('HINCRBY', sums, 'trimmed', d) end
    redis.call('EXPIRE', stream, ttl)
    redis.call('EXPIRE', sums, ttl)
    return {0, 0, 0}
  end
  local unacked = 0
  if oldest then unacked = math.min(math.max(n - oldest + 1, 0), L) end
  local acked = L - unacked
  -- Acknowledged entries past keep go; unacknowledged ones only past cap.
  local target = math.max(math.min(keep, cap), unacked)
  if target > cap then target = cap end
  local lost = 0
  if L > target then
    -- Approximate trimming (whole nodes) never removes more than asked,
    -- so it stays within the acknowledged entries; past cap it is exact.
    local how = '~'
    if L > cap then how = '=' end
    local d = redis.call('XTRIM', stream, 'MAXLEN', how, target)
    lost = math.max(d - acked, 0)
    if d - lost > 0 then redis.call('HINCRBY', sums, 'trimmed', d - lost) end
    if lost > 0 then redis.call('HINCRBY', sums, 'lost', lost) end
    unacked = unacked - lost
  end
  local backlog = 0
  if unacked * 5 >= cap * 4 then
    if redis.call('HSETNX', sums, 'backlog', 1) == 1 then backlog = 1 end
  elseif unacked * 2 < cap then
    -- Re-armed once the backlog has halved: a second one raises again.
    redis.call('HDEL', sums, 'backlog')
  end
  if unacked > 0 then
    redis.call('PERSIST', stream)
    redis.call('PERSIST', sums)
  else
    redis.call('EXPIRE', stream, ttl)
    redis.call('EXPIRE', sums, ttl)
  end
  return {backlog, lost, unacked}
end
-- ledgerPut appends fields (a flat list of names and values; its seq is
-- added) to stream as its next entry, the registered export groups
-- (a list of names) joining a new stream, and keeps the stream's shape.
-- With a model, counts (luaLedger's m|<model> order) are added to the
-- model's totals; without one (a record that is no call) no totals move.
local function ledgerPut(stream, sums, keep, cap, ttl, groups, fields, model, counts, known)
  local m
  if model then
    m = redis.call('HMGET', sums, 'seq', 'groups', 'm|' .. model)
  else
    m = redis.call('HMGET', sums, 'seq', 'groups')
  end
  local n = num(m[1]) + 1
  local grouped = num(m[2]) > 0
  fields[#fields + 1] = 'seq'
  fields[#fields + 1] = n
  redis.call('XADD', stream, '*', unpack(fields))
  if n == 1 then
    -- A new stream: every registered export group reads it from its
    -- first entry.
    for _, name in ipairs(groups) do
      local r = redis.pcall('XGROUP', 'CREATE', stream, name, '0')
      if type(r) ~= 'table' or not r.err then grouped = true end
    end
  end
  local g = 0
  if grouped then g = 1 end
  if model then
    local v, i = {}, 0
    for d in string.gmatch(m[3] or '', '%d+') do
      i = i + 1
      v[i] = tonumber(d)
    end
    for j = 1, #counts do v[j] = int((v[j] or 0) + counts[j]) end
    redis.call('HSET', sums, 'seq', n, 'groups', g, 'keep', keep, 'cap', cap, 'm|' .. model, table.concat(v, ' ', 1, #counts))
  else
    redis.call('HSET', sums, 'seq', n, 'groups', g, 'keep', keep, 'cap', cap)
  end
  local L = redis.call('XLEN', stream)
  if not grouped then
    local d = 0
    if L > keep then d = redis.call('XTRIM', stream, 'MAXLEN', '~', keep) end
    if d > 0 then redis.call('HINCRBY', sums, 'trimmed', d) end
    if not known or n == 1 then
      redis.call('EXPIRE', stream, ttl)
      redis.call('EXPIRE', sums, ttl)
    end
    return {0, 0, -1}
  end
  redis.call('PERSIST', stream)
  redis.call('PERSIST', sums)
  if L > cap or (n % 16 == 0 and (L > math.min(keep, cap) or L * 5 >= cap * 4)) then
    return ledgerTrim(stream, sums, keep, cap, ttl)
  end
  return {0, 0, -1}
end
local function ledgerAppendArgv(stream, sums, base, cost, ovtok, ovcost, reservation, known)
  local a = function(i) return ARGV[base + i] end
  local groups = {}
  for i = 1, tonumber(a(22)) do groups[i] = a(22 + i) end
  local fields = {'task', a(3), 'model', a(4), 'principal', a(5), 'tier', a(6),
    'request_id', a(7), 'prompt_tokens', a(8), 'completion_tokens', a(9), 'reasoning_tokens', a(10),
    'cache_creation_input_tokens', a(11), 'cache_read_input_tokens', a(12), 'reserved', a(13),
    'cost_micro', int(cost), 'overage_tokens', int(ovtok), 'overage_cost_micro', int(ovcost),
    'latency_ms', a(14), 'outcome', a(15), 'status', a(16), 'estimated', a(17),
    'usage_raw', a(18), 'implausible', a(19), 'reservation', reservation}
  local counts = {1, tonumber(a(20)), tonumber(a(21)), tonumber(a(17)), tonumber(a(8)), tonumber(a(9)),
    tonumber(a(13)), cost, ovtok, ovcost}
  return ledgerPut(stream, sums, tonumber(a(0)), tonumber(a(1)), tonumber(a(2)), groups, fields, a(4), counts, known)
end
`

// ledgerAppendScript is Ledger.Append's: KEYS stream, counters; ARGV
// cost, overage tokens, overage cost, then Ledger.argv's block. Returns
// ledgerAppendArgv's answer.
var ledgerAppendScript = redis.NewScript(luaHelpers + luaLedger + `
return ledgerAppendArgv(KEYS[1], KEYS[2], 4, tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), '')
`)

// ledgerAckScript acknowledges an export's entries and keeps the stream
// in the shape its writers gave it (the reader's keep and cap when they
// gave none): KEYS stream, counters; ARGV group, keep, cap, ttl, then the
// entry ids. Returns {acknowledged, then ledgerTrim's answer}.
var ledgerAckScript = redis.NewScript(luaHelpers + luaLedger + `
local ids = {}
for i = 5, #ARGV do ids[#ids + 1] = ARGV[i] end
local acked = 0
if #ids > 0 then acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids)) end
local shape = redis.call('HMGET', KEYS[2], 'keep', 'cap')
local keep, cap = tonumber(shape[1]) or tonumber(ARGV[2]), tonumber(shape[2]) or tonumber(ARGV[3])
local r = ledgerTrim(KEYS[1], KEYS[2], keep, cap, tonumber(ARGV[4]))
return {acked, r[1], r[2], r[3]}
`)

// ledgerJoinScript puts export group ARGV[1] on an existing stream, from
// its first entry: KEYS stream, counters. Its entries are unacknowledged
// from then on, so the stream stops expiring. Returns 1 when the stream
// exists (the group is on it), 0 when it does not.
var ledgerJoinScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0')
redis.call('HSET', KEYS[2], 'groups', 1)
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
return 1
`)
