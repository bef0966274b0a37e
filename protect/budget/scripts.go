package budget

import "github.com/redis/go-redis/v9"

// luaReap is the prelude of every script. It gives back each reservation of
// the day whose expiry (unix ms by the caller's clock, ARGV[1]) has passed:
// the amount leaves "outstanding" in exactly the three scopes recorded in
// resinfo, then the reservation is deleted, so a second reaper (or a late
// settle) finds nothing and nothing is returned twice.
//
// The visitor and task keys of a reaped reservation are built here rather
// than declared in KEYS because the script cannot know them in advance. They
// carry the same {day} hash tag as the declared keys, so on Redis Cluster they
// live in the same slot and the script stays single-slot.
//
// At most reapBatch reservations are reaped per call, which bounds the time
// one script blocks Redis; a larger backlog drains over the next calls, and
// until then the old reservations still count, which errs on the safe side.
const luaReap = `
local prefix = string.sub(KEYS[1], 1, -5)
local function reap(res, info, now)
  local ids = redis.call('ZRANGEBYSCORE', res, '-inf', now, 'LIMIT', 0, 256)
  for _, id in ipairs(ids) do
    local v = redis.call('HGET', info, id)
    if v then
      local amount, vis, task = string.match(v, '^(%d+)|([^|]+)|([^|]+)$')
      if amount then
        redis.call('HINCRBY', prefix .. 'site', 'outstanding', '-' .. amount)
        redis.call('HINCRBY', prefix .. 'ip:' .. vis, 'outstanding', '-' .. amount)
        redis.call('HINCRBY', prefix .. 'task:' .. task, 'outstanding', '-' .. amount)
      end
      redis.call('HDEL', info, id)
    end
    redis.call('ZREM', res, id)
  end
end
local function used(key)
  local v = redis.call('HMGET', key, 'settled', 'outstanding')
  return tonumber(v[1] or 0), tonumber(v[2] or 0)
end
`

// reserveScript: KEYS site, visitor, task, res, resinfo; ARGV now, expiry,
// id, amount, site limit, visitor limit, task limit, ttl seconds, info.
// Returns {ok, scope, remaining, site settled, site outstanding, reservations}.
// The narrowest exhausted scope is named (task, then visitor, then site), the
// same precedence the quota gives the visitor over the whole site.
var reserveScript = redis.NewScript(luaReap + `
reap(KEYS[4], KEYS[5], ARGV[1])
local amount = tonumber(ARGV[4])
for _, i in ipairs({3, 2, 1}) do
  local s, o = used(KEYS[i])
  local limit = tonumber(ARGV[4 + i])
  if s + o + amount > limit then
    local rem = limit - s - o
    if rem < 0 then rem = 0 end
    local ss, so = used(KEYS[1])
    return {0, i, rem, ss, so, redis.call('ZCARD', KEYS[4])}
  end
end
if redis.call('HEXISTS', KEYS[5], ARGV[3]) == 1 then
  return redis.error_reply('budget: duplicate reservation id')
end
for i = 1, 3 do
  redis.call('HINCRBY', KEYS[i], 'outstanding', ARGV[4])
end
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[5], ARGV[3], ARGV[9])
for i = 1, 5 do
  redis.call('EXPIRE', KEYS[i], ARGV[8])
end
local ss, so = used(KEYS[1])
return {1, 0, 0, ss, so, redis.call('ZCARD', KEYS[4])}
`)

// settleScript: KEYS site, visitor, task, res, resinfo; ARGV now, id,
// actual, info, ttl seconds. The stored info must equal the caller's, so a
// Reservation whose fields were altered cannot move tokens between scopes.
// Returns {ok, 0, charged, site settled, site outstanding, reservations}.
var settleScript = redis.NewScript(luaReap + `
reap(KEYS[4], KEYS[5], ARGV[1])
local v = redis.call('HGET', KEYS[5], ARGV[2])
if (not v) or v ~= ARGV[4] then
  local ss, so = used(KEYS[1])
  return {0, 0, 0, ss, so, redis.call('ZCARD', KEYS[4])}
end
local amount = string.match(v, '^(%d+)|')
local charged = ARGV[3]
if tonumber(charged) > tonumber(amount) then charged = amount end
for i = 1, 3 do
  redis.call('HINCRBY', KEYS[i], 'outstanding', '-' .. amount)
  redis.call('HINCRBY', KEYS[i], 'settled', charged)
  redis.call('EXPIRE', KEYS[i], ARGV[5])
end
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('HDEL', KEYS[5], ARGV[2])
local ss, so = used(KEYS[1])
return {1, 0, tonumber(charged), ss, so, redis.call('ZCARD', KEYS[4])}
`)

// canAffordScript: KEYS site, visitor, res, resinfo; ARGV now, amount, site
// limit, visitor limit. Reaps, then only reads.
// Returns {ok, scope, remaining, site settled, site outstanding, reservations}
// with scope 2 (visitor) checked before 1 (site).
var canAffordScript = redis.NewScript(luaReap + `
reap(KEYS[3], KEYS[4], ARGV[1])
local amount = tonumber(ARGV[2])
local ss, so = used(KEYS[1])
local n = redis.call('ZCARD', KEYS[3])
for _, i in ipairs({2, 1}) do
  local s, o = used(KEYS[i])
  local limit = tonumber(ARGV[2 + i])
  if s + o + amount > limit then
    local rem = limit - s - o
    if rem < 0 then rem = 0 end
    return {0, i, rem, ss, so, n}
  end
end
return {1, 0, 0, ss, so, n}
`)

// usageScript: KEYS site, visitor, task, res, resinfo; ARGV now. Reaps, then
// reads all three scopes in the same atomic step so the numbers agree.
// Returns {site settled, site outstanding, visitor settled, visitor
// outstanding, task settled, task outstanding, reservations}.
var usageScript = redis.NewScript(luaReap + `
reap(KEYS[4], KEYS[5], ARGV[1])
local out = {}
for i = 1, 3 do
  local s, o = used(KEYS[i])
  out[#out + 1] = s
  out[#out + 1] = o
end
out[#out + 1] = redis.call('ZCARD', KEYS[4])
return out
`)
