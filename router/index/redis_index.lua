-- kvroute Redis block index: server-side scripts, one per "-- @script NAME" section.
--
-- Every key is derived from the namespace prefix P (ARGV[1]), e.g. "kvr:{3f2a9c0e11b4}";
-- the braces are a hash tag, so all keys of a namespace share one cluster slot.
--   P:b:<8-byte hash>  STRING  bitmap over columns (bit c = column c holds the block)
--   P:r:<col>          HASH    reverse index of a column: 8-byte hash -> refcount
--   P:i:<instance>     HASH    #<slot> -> column, ts/seq = cursor of the last applied batch
--   P:col              HASH    column -> "<slot>:<instance>" (live columns only)
--   P:insts            SET     instances with state
--   P:hb:<instance>    STRING  heartbeat, expires after the instance TTL
--   P:dead             LIST    retired columns whose bits are still being reclaimed
--   P:free             ZSET    reclaimed column ids, reused smallest first
--   P:meta             HASH    ncol (column counter), colver (column map version), epoch
--                              (server TIME when the namespace first got a column map),
--                              rcur:<col>
--   P:layouts          HASH    instance -> layout JSON
-- A column is one (instance, slot) pair, slot = group_idx * 2 + tier (0 GPU, 1 CPU).

-- @script common
-- Prepended to every script below. The column map version routers cache is
-- "<epoch>:<colver>": a Redis restarted empty (or a flushed namespace) counts colver up
-- from 0 again and may reach the very number a router cached while allocating columns to
-- other instances; the epoch makes that version new, so no router keeps crediting one
-- instance's blocks to another.
local function bump_colver(P)
  local meta = P .. ':meta'
  if redis.call('HEXISTS', meta, 'epoch') == 0 then
    local t = redis.call('TIME')
    redis.call('HSET', meta, 'epoch', t[1] .. '.' .. t[2])
  end
  redis.call('HINCRBY', meta, 'colver', '1')
end

-- @script apply
-- ARGV: P, instance, seq (-1: unconditional), ts, reset (0/1), heartbeat ms, block ttl ms,
--       then per event: op ("S" store, "R" remove, "C" clear all), slot, packed hashes.
-- Returns {applied, stored, removed, unknown, retired columns, cursor absent}; "cursor
-- absent" (a seq'd batch found no cursor) tells an ingester that believed the instance
-- synced that the index lost it (restarted empty, reaped).
-- Per block: one SETBIT per store, one GETDEL per release of a block no other column
-- holds; refcounts are read and written in bulk per event. Command arguments are strings:
-- a Lua number argument costs a float-to-string conversion per call.
local call, sub, sbyte, schar = redis.call, string.sub, string.byte, string.char
local P, inst = ARGV[1], ARGV[2]
local seq, ts = tonumber(ARGV[3]), tonumber(ARGV[4])
local hb_ms, block_ms = tonumber(ARGV[6]), tonumber(ARGV[7])
local ikey = P .. ':i:' .. inst

local absent = 0
if seq >= 0 then
  local cur = call('HMGET', ikey, 'ts', 'seq')
  if cur[1] then
    local cts, cseq = tonumber(cur[1]), tonumber(cur[2])
    if ts < cts or (ts == cts and seq <= cseq) then
      return {0, 0, 0, 0, 0, 0}
    end
  else
    absent = 1
  end
end

-- retire(tier): the instance's columns of that tier (0 GPU, 1 CPU), or all (nil); returns
-- how many CPU columns were left behind.
local retired = 0
local function retire(tier)
  local f = call('HGETALL', ikey)
  local kept = 0
  for i = 1, #f, 2 do
    if sub(f[i], 1, 1) == '#' then
      if tier == nil or tonumber(sub(f[i], 2)) % 2 == tier then
        call('HDEL', P .. ':col', f[i + 1])
        call('RPUSH', P .. ':dead', f[i + 1])
        call('HDEL', ikey, f[i])
        retired = retired + 1
      else
        kept = kept + 1
      end
    end
  end
  bump_colver(P)
  return kept
end

local cols = {}
local function column(slot, create)
  local c = cols[slot]
  if c then return c end
  c = call('HGET', ikey, '#' .. slot)
  if not c then
    if not create then return nil end
    local free = call('ZPOPMIN', P .. ':free')
    if #free > 0 then
      c = free[1]
    else
      c = tostring(call('HINCRBY', P .. ':meta', 'ncol', '1') - 1)
    end
    call('HSET', ikey, '#' .. slot, c)
    call('HSET', P .. ':col', c, slot .. ':' .. inst)
    bump_colver(P)
  end
  cols[slot] = c
  return c
end

-- Runs of up to 7000 fields per variadic call (Lua's unpack has a stack limit).
local function bulk(cmd, key, list)
  for j = 1, #list, 7000 do
    call(cmd, key, unpack(list, j, math.min(j + 6999, #list)))
  end
end

if ARGV[5] == '1' then
  retire()
  call('HDEL', ikey, 'cpuq')
end
-- "cpuq": an AllBlocksCleared left the CPU tier standing, unconfirmed (see MemoryIndex).
local cpuq = call('HEXISTS', ikey, 'cpuq') == 1

local stored, removed, unknown = 0, 0, 0
local bp = P .. ':b:'
for i = 8, #ARGV, 3 do
  local op, slot, hs = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if op == 'S' then
    if cpuq and tonumber(slot) % 2 == 1 then
      -- A CPU store of a key the column holds: vLLM never stores a key it holds, so its
      -- CPU tier was emptied by that reset (reset_external): drop ours too.
      -- The chunk key is the event's last hash (the blocks before it may be shared with
      -- a sibling chunk that branched inside the chunk).
      local c0 = column(slot, false)
      if c0 and #hs >= 8 and call('GETBIT', bp .. sub(hs, #hs - 7, #hs), c0) == 1 then
        retire(1)
        cols = {}
        cpuq = false
        call('HDEL', ikey, 'cpuq')
      end
    end
    -- SETBIT says whether the column held the block: new entries get refcount 1 in one
    -- HSET per event, then every repeat (held before, or earlier in this event) is
    -- counted on top with HINCRBY.
    local c = column(slot, true)
    local rv = P .. ':r:' .. c
    local new, nn, again = {}, 0, nil
    for j = 1, #hs, 8 do
      local h = sub(hs, j, j + 7)
      local bk = bp .. h
      if call('SETBIT', bk, c, '1') == 0 then
        new[nn + 1] = h
        new[nn + 2] = '1'
        nn = nn + 2
      else
        again = again or {}
        again[#again + 1] = h
      end
      if block_ms > 0 then call('PEXPIRE', bk, ARGV[7]) end
    end
    stored = stored + #hs / 8
    bulk('HSET', rv, new)
    if again then
      for k = 1, #again do call('HINCRBY', rv, again[k], '1') end
    end
  elseif op == 'R' then
    -- Refcounts are read with one HMGET and released ones dropped with one HDEL per
    -- event; only blocks whose last reference goes touch their bitmap.
    local c = column(slot, false)
    if not c then
      unknown = unknown + #hs / 8
    else
      local ci, rv = tonumber(c), P .. ':r:' .. c
      local byte, bit = math.floor(ci / 8) + 1, 2 ^ (7 - ci % 8)
      local hl = {}
      for j = 1, #hs, 8 do hl[#hl + 1] = sub(hs, j, j + 7) end
      local counts = {}
      for j = 1, #hl, 7000 do
        local part = call('HMGET', rv, unpack(hl, j, math.min(j + 6999, #hl)))
        for k = 1, #part do counts[#counts + 1] = part[k] end
      end
      local left, gone = {}, {}
      for k = 1, #hl do
        local h = hl[k]
        local n = left[h] or tonumber(counts[k])
        if not n or n <= 0 then
          unknown = unknown + 1
        else
          n = n - 1
          left[h] = n
          removed = removed + 1
          if n == 0 then
            gone[#gone + 1] = h
            local bk = bp .. h
            if block_ms > 0 then
              -- Edit in place: the block's TTL stays.
              local v = call('GET', bk)
              local only = v and #v >= byte and sbyte(v, byte) == bit
              if only then
                for i2 = 1, #v do
                  if i2 ~= byte and sbyte(v, i2) ~= 0 then only = false break end
                end
              end
              if only then
                call('DEL', bk)
              elseif v then
                call('SETBIT', bk, c, '0')
              end
            else
              -- Take the bitmap; put it back without this column's bit unless that bit
              -- was its only one (the common case: one call per released block).
              local v = call('GETDEL', bk)
              if v then
                local b = sbyte(v, byte)
                if b and math.floor(b / bit) % 2 == 1 then b = b - bit end
                local rest = b ~= nil and b ~= 0
                if not rest then
                  for i2 = 1, #v do
                    if i2 ~= byte and sbyte(v, i2) ~= 0 then rest = true break end
                  end
                end
                if rest then
                  if b then v = sub(v, 1, byte - 1) .. schar(b) .. sub(v, byte + 1) end
                  call('SET', bk, v)
                end
              end
            end
          end
        end
      end
      local upd = {}
      for h, n in pairs(left) do
        if n > 0 then
          upd[#upd + 1] = h
          upd[#upd + 1] = tostring(n)
        end
      end
      bulk('HSET', rv, upd)
      bulk('HDEL', rv, gone)
    end
  elseif op == 'C' then
    -- vLLM's reset_prefix_cache: the GPU tier goes; the CPU tier stays unless the reset
    -- also emptied it (reset_external), which the same event cannot tell.
    if retire(0) > 0 then
      cpuq = true
      call('HSET', ikey, 'cpuq', '1')
    end
    cols = {}
  end
end

if seq >= 0 then call('HSET', ikey, 'ts', ARGV[4], 'seq', ARGV[3]) end
call('SADD', P .. ':insts', inst)
if hb_ms > 0 then call('SET', P .. ':hb:' .. inst, '1', 'PX', ARGV[6]) end
return {1, stored, removed, unknown, retired, absent}

-- @script lookup
-- ARGV: P, the caller's column map version, check heartbeats (0/1), the request's block
-- hashes packed (8 bytes each, big-endian). Returns {colver, column map (or {} when the
-- caller's is current), live instances, row width, every block's bitmap zero-padded to
-- the row width and concatenated}. Keys are built here and the rows joined here: passing
-- 512 keys and reading 512 replies costs the client more than the lookup costs Redis.
local P = ARGV[1]
local mv = redis.call('HMGET', P .. ':meta', 'epoch', 'colver')
local ver = (mv[1] or '') .. ':' .. (mv[2] or '0')
local colmap = {}
if ver ~= ARGV[2] then colmap = redis.call('HGETALL', P .. ':col') end
local live = {}
for _, inst in ipairs(redis.call('SMEMBERS', P .. ':insts')) do
  if ARGV[3] ~= '1' or redis.call('EXISTS', P .. ':hb:' .. inst) == 1 then
    live[#live + 1] = inst
  end
end
local hs, bp = ARGV[4], P .. ':b:'
local n = #hs / 8
local vals, width = {}, 0
for i = 1, n, 4000 do
  local keys = {}
  for j = i, math.min(i + 3999, n) do
    keys[#keys + 1] = bp .. string.sub(hs, j * 8 - 7, j * 8)
  end
  local part = redis.call('MGET', unpack(keys))
  for k = 1, #part do
    local v = part[k] or ''
    if #v > width then width = #v end
    vals[#vals + 1] = v
  end
end
if width == 0 then return {ver, colmap, live, 0, ''} end
for i = 1, n do
  local v = vals[i]
  if #v < width then vals[i] = v .. string.rep('\0', width - #v) end
end
return {ver, colmap, live, width, table.concat(vals)}

-- @script drop
-- ARGV: P, instance. Retires all the instance's columns and forgets its cursor (O(1) in
-- its blocks; the bits are reclaimed in chunks by "reclaim"). Returns retired columns.
local P, inst = ARGV[1], ARGV[2]
local ikey = P .. ':i:' .. inst
local f = redis.call('HGETALL', ikey)
local n = 0
for i = 1, #f, 2 do
  if string.sub(f[i], 1, 1) == '#' then
    redis.call('HDEL', P .. ':col', f[i + 1])
    redis.call('RPUSH', P .. ':dead', f[i + 1])
    n = n + 1
  end
end
redis.call('DEL', ikey, P .. ':hb:' .. inst)
redis.call('SREM', P .. ':insts', inst)
bump_colver(P)
return n

-- @script reap
-- ARGV: P. Drops every instance whose heartbeat expired; returns their names.
local P = ARGV[1]
local gone = {}
for _, inst in ipairs(redis.call('SMEMBERS', P .. ':insts')) do
  if redis.call('EXISTS', P .. ':hb:' .. inst) == 0 then
    local ikey = P .. ':i:' .. inst
    local f = redis.call('HGETALL', ikey)
    for i = 1, #f, 2 do
      if string.sub(f[i], 1, 1) == '#' then
        redis.call('HDEL', P .. ':col', f[i + 1])
        redis.call('RPUSH', P .. ':dead', f[i + 1])
      end
    end
    redis.call('DEL', ikey)
    redis.call('SREM', P .. ':insts', inst)
    gone[#gone + 1] = inst
  end
end
if #gone > 0 then bump_colver(P) end
return gone

-- @script reclaim
-- ARGV: P, max entries. Clears up to that many bits of the oldest retired column (a dead
-- column's reverse index no longer changes, so one HSCAN pass sees every entry); frees
-- the column after the last pass. Returns {entries cleared, columns left}.
local P, count = ARGV[1], tonumber(ARGV[2])
local col = redis.call('LINDEX', P .. ':dead', 0)
if not col then return {0, 0} end
local rv, ci, bp = P .. ':r:' .. col, tonumber(col), P .. ':b:'
local byte, bit = math.floor(ci / 8) + 1, 2 ^ (7 - ci % 8)
local cur = redis.call('HGET', P .. ':meta', 'rcur:' .. col) or '0'
local r = redis.call('HSCAN', rv, cur, 'COUNT', count)
local n = 0
for i = 1, #r[2], 2 do
  local bk = bp .. r[2][i]
  local v = redis.call('GET', bk)
  if v and #v >= byte and math.floor(string.byte(v, byte) / bit) % 2 == 1 then
    local only = string.byte(v, byte) == bit
    if only then
      for k = 1, #v do
        if k ~= byte and string.byte(v, k) ~= 0 then only = false break end
      end
    end
    if only then redis.call('DEL', bk) else redis.call('SETBIT', bk, ci, 0) end
  end
  n = n + 1
end
if r[1] == '0' then
  redis.call('DEL', rv)
  redis.call('HDEL', P .. ':meta', 'rcur:' .. col)
  if redis.call('LREM', P .. ':dead', 1, col) > 0 then
    redis.call('ZADD', P .. ':free', ci, col)
  end
else
  redis.call('HSET', P .. ':meta', 'rcur:' .. col, r[1])
end
return {n, redis.call('LLEN', P .. ':dead')}
