"""The Valkey index's atomic steps: Lua scripts that run inside the server, one call each.

Every step that reads and changes several keys runs as one script (Valkey runs a script
alone: no other client's command runs in between), so any number of hosts and processes
share one bound without over-committing it and never evict a pinned object or one in flight.

**Keys** (one root: ``hc:{<root id>}:``, the braces a hash tag, so that a Valkey Cluster keeps
all of them in one slot; ``KEYS[1]`` is the meta hash and every other key is named from it):

| key | type | holds |
|---|---|---|
| ``M`` | hash | ``ready``, ``format`` (``FORMAT``), ``seq`` (last change), ``total`` (bytes charged), ``count``, ``reserved`` (bytes of puts in flight), ``batches``, ``epoch``, ``rebuilt_at`` |
| ``P:<4 hex>`` | hash | page records: fingerprint -> prefix and ``\\n<suffix> <size>[ <charged>]`` per object (charged when it is not the size; ``_valkey_keys``) |
| ``R:<4 hex>`` | sorted set | the same bucket's pages: fingerprint -> rank |
| ``RB`` | sorted set | bucket (the fingerprints' first two bytes) -> the least rank in it |
| ``BP`` / ``BD`` | hash | object -> puts / deletes in flight on it |
| ``W`` | hash | writer -> who (host, pid) |
| ``H:<writer>`` | string | the writer's heartbeat, with a TTL (its lease) |
| ``Q:<writer>`` | hash | batch -> its changes in flight (msgpack) |
| ``T`` | hash | object -> its holds (msgpack: owner, until, pinned, priority) |
| ``N`` | hash | namespace digest -> bytes charged |
| ``F`` | stream | the change feed: entry ``<seq>-0`` = the changes numbered up to ``seq`` |

**Ranks in buckets.** The eviction order is every page by rank (smallest first, then by
fingerprint): a merge of the 65,536 bucket rank sets led by ``RB`` (``ranked``). Small sets
are what Valkey keeps compact (a listpack, under ``zset-max-listpack-entries``: 128 by default,
about 8 million pages): a page's rank costs about a third of what one member of a set of every
page costs (a skip list). Each step that changes a rank keeps its bucket's least rank in ``RB``.

**Rank** (a double, exact below 2^53): ``(ms since 2024 by the server's clock) * 4096 +
(4095 - depth)``: a later call ranks above an earlier one, and within a call a page deeper in
the chain ranks lower (``_lru.chain_ranks``' order with 12 bits of depth). Time is the
server's (``TIME``): no host's clock decides the order.

**Replies**: a table whose first element is ``OK`` or the condition (``NOINDEX``: no index
here, build it; ``FENCED``: the writer's lease lapsed; ``BUSY``: a key has a change in flight
that this step waits for; ``NOROOM``).
"""

from __future__ import annotations

#: the layout of the keys below (``M``'s ``format``): 1, one rank set ``R`` of every page (no
#: ``format`` field); 2, the bucketed rank sets. A process opens an index of its own format
#: only (``_valkey_pages.Builder``: an index of format 1 is migrated at open).
FORMAT = 2

PRELUDE = r"""
local M = KEYS[1]
local P = string.sub(M, 1, #M - 1)
local EPOCH = 1704067200000
local FORMAT = "%FORMAT%"
local function bucket(fp) return P .. "P:" .. string.format("%02x%02x", string.byte(fp, 1, 2)) end
local function now_ms()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function score(ms, depth)
  if depth > 4095 then depth = 4095 end
  return (ms - EPOCH) * 4096 + (4095 - depth)
end
local function ready()
  local r = redis.call("HMGET", M, "ready", "format")
  return r[1] ~= false and r[2] == FORMAT
end
local function alive(w) return redis.call("EXISTS", P .. "H:" .. w) == 1 end
local function load(fp)
  local v = redis.call("HGET", bucket(fp), fp)
  if not v then return nil, nil end
  local n = string.byte(v, 1)
  local prefix = string.sub(v, 2, 1 + n)
  local objs = {}
  for s, a, b in string.gmatch(string.sub(v, 2 + n), "\n([^ \n]*) (%d+) ?(%d*)") do
    local size = tonumber(a)
    objs[s] = {size, tonumber(b) or size}
  end
  return prefix, objs
end
local function fmt(x) return string.format("%d", x) end
-- the rank of a page lives in its bucket's rank set (R:<4 hex>, as its record); the top set RB
-- holds each bucket's least rank (member: the fingerprint's first two bytes)
local function rank_key(fp) return P .. "R:" .. string.format("%02x%02x", string.byte(fp, 1, 2)) end
local function rank_top(rk, b)
  local least = redis.call("ZRANGE", rk, 0, 0, "WITHSCORES")
  if #least == 0 then redis.call("ZREM", P .. "RB", b)
  else redis.call("ZADD", P .. "RB", least[2], b) end
end
-- ZADD (flag: "GT", "NX" or nil) of a page's rank, its bucket's least rank kept in RB
local function rank_set(fp, s, flag)
  local rk = rank_key(fp)
  if flag then redis.call("ZADD", rk, flag, s, fp) else redis.call("ZADD", rk, s, fp) end
  rank_top(rk, string.sub(fp, 1, 2))
end
local function rank_del(fp)
  local rk = rank_key(fp)
  if redis.call("ZREM", rk, fp) == 1 then rank_top(rk, string.sub(fp, 1, 2)) end
end
local function rank_of(fp) return redis.call("ZSCORE", rank_key(fp), fp) end
-- every ranked page in eviction order (rank, then fingerprint), one at a time (fp, rank): a
-- merge of the bucket rank sets, each opened when its least rank (RB) comes up, read a chunk
-- at a time; nothing may change the rank sets while it runs
local function ranked()
  local heap = {}  -- cursors {rank, fp, rank set, its entries read, at, offset of the next read}
  local function before(a, b)  -- (fingerprints in byte order: Lua's < follows the locale)
    if a[1] ~= b[1] then return a[1] < b[1] end
    local x, y = a[2], b[2]
    for i = 1, math.min(#x, #y) do
      local u, v = string.byte(x, i), string.byte(y, i)
      if u ~= v then return u < v end
    end
    return #x < #y
  end
  local function push(c)
    heap[#heap + 1] = c
    local i = #heap
    while i > 1 do
      local up = math.floor(i / 2)
      if not before(heap[i], heap[up]) then break end
      heap[i], heap[up] = heap[up], heap[i]
      i = up
    end
  end
  local function pop()
    local top = heap[1]
    heap[1] = heap[#heap]
    heap[#heap] = nil
    local i = 1
    while true do
      local l, r, m = 2 * i, 2 * i + 1, i
      if l <= #heap and before(heap[l], heap[m]) then m = l end
      if r <= #heap and before(heap[r], heap[m]) then m = r end
      if m == i then break end
      heap[i], heap[m] = heap[m], heap[i]
      i = m
    end
    return top
  end
  local function advance(c)  -- the cursor's next entry, or false when its set is done
    c[5] = c[5] + 2
    if c[5] > #c[4] then
      c[4] = redis.call("ZRANGE", c[3], c[6], c[6] + 127, "WITHSCORES")
      c[6] = c[6] + 128
      c[5] = 1
      if #c[4] == 0 then return false end
    end
    c[1], c[2] = tonumber(c[4][c[5] + 1]), c[4][c[5]]
    return true
  end
  -- RB is read in growing chunks: most steps need the first few buckets only
  local tops, at, offset, chunk = {}, 1, 0, 8
  return function()
    while true do
      if at > #tops and offset >= 0 then
        tops = redis.call("ZRANGE", P .. "RB", offset, offset + chunk - 1, "WITHSCORES")
        offset, at, chunk = offset + chunk, 1, math.min(chunk * 2, 256)
        if #tops == 0 then offset = -1 end  -- (every bucket opened)
      end
      local b = tops[at]
      if b and (#heap == 0 or before({tonumber(tops[at + 1]), b}, heap[1])) then
        at = at + 2
        local c = {0, "", P .. "R:" .. string.format("%02x%02x", string.byte(b, 1, 2)), {}, -1, 0}
        if advance(c) then push(c) end
      elseif #heap == 0 then
        return nil
      else
        local c = pop()
        local fp, s = c[2], c[1]
        if advance(c) then push(c) end
        return fp, s
      end
    end
  end
end
local function save(fp, prefix, objs)
  local parts = {string.char(#prefix), prefix}
  for s, o in pairs(objs) do
    local entry = "\n" .. s .. " " .. fmt(o[1])
    if o[2] ~= o[1] then entry = entry .. " " .. fmt(o[2]) end  -- (charged: when it differs)
    parts[#parts + 1] = entry
  end
  if #parts > 2 then
    redis.call("HSET", bucket(fp), fp, table.concat(parts))
  else
    redis.call("HDEL", bucket(fp), fp)
    rank_del(fp)
  end
end
local function ns_of(prefix)
  local kind = string.byte(prefix, 1)
  if kind == 0 then return "" end
  local hl = 32
  if kind == 1 or kind == 3 then hl = 16 end
  return string.sub(prefix, 2 + hl)
end
local function charged_of(objs)
  local n = 0
  for _, o in pairs(objs) do n = n + o[2] end
  return n
end
-- a change of what is stored: one object of a page, with the bytes it is charged (tallied
-- here, written once at the end of the step: ``flush_tallies``)
local tally_total, tally_count, tally_ns = 0, 0, {}
local function account(prefix, delta_bytes, delta_count)
  tally_total = tally_total + delta_bytes
  tally_count = tally_count + delta_count
  if delta_bytes ~= 0 then
    local ns = ns_of(prefix)
    tally_ns[ns] = (tally_ns[ns] or 0) + delta_bytes
  end
end
local function flush_tallies()
  if tally_total ~= 0 then redis.call("HINCRBY", M, "total", fmt(tally_total)) end
  if tally_count ~= 0 then redis.call("HINCRBY", M, "count", fmt(tally_count)) end
  for ns, delta in pairs(tally_ns) do
    if delta ~= 0 then redis.call("HINCRBY", P .. "N", ns, fmt(delta)) end
  end
  tally_total, tally_count, tally_ns = 0, 0, {}
end
-- the feed: changes gathered in order, written as one stream entry per run of one presence
local changes = {}
local function change(present, prefix, suffix)
  changes[#changes + 1] = {present, string.char(#prefix) .. prefix .. string.char(#suffix) .. suffix}
end
local function flush_feed(maxlen)
  flush_tallies()
  local i = 1
  while i <= #changes do
    local present = changes[i][1]
    local names = {}
    while i <= #changes and changes[i][1] == present do
      names[#names + 1] = changes[i][2]
      i = i + 1
    end
    local seq = redis.call("HINCRBY", M, "seq", #names)
    redis.call("XADD", P .. "F", "MAXLEN", "~", maxlen, fmt(seq) .. "-0",
               "p", present and "1" or "0", "n", fmt(#names), "k", table.concat(names))
  end
  changes = {}
end
-- make one object of page fp match a measurement (size < 0: absent); returns whether present
local function set_object(fp, prefix, suffix, size, charged)
  local known, objs = load(fp)
  objs = objs or {}
  local old = objs[suffix]
  if size < 0 then
    if old then
      objs[suffix] = nil
      account(known, -old[2], -1)
      redis.call("HDEL", P .. "T", fp .. suffix)
      change(false, known, suffix)
      save(fp, known, objs)
    end
    return false
  end
  if known and known ~= prefix then return false end  -- a fingerprint collision: not indexed
  objs[suffix] = {size, charged}
  if old then
    account(prefix, charged - old[2], 0)
  else
    account(prefix, charged, 1)
    change(true, prefix, suffix)
  end
  save(fp, prefix, objs)
  return true
end
-- remove a whole page (an eviction): its objects leave the index, each in the feed
local function remove_page(fp, prefix, objs)
  for s, o in pairs(objs) do
    account(prefix, -o[2], -1)
    redis.call("HDEL", P .. "T", fp .. s)
    change(false, prefix, s)
  end
  redis.call("HDEL", bucket(fp), fp)
  rank_del(fp)
end
local function busy(oid)
  return redis.call("HEXISTS", P .. "BP", oid) == 1 or redis.call("HEXISTS", P .. "BD", oid) == 1
end
local function count_busy(table_name, oid, by)
  local n = redis.call("HINCRBY", P .. table_name, oid, fmt(by))
  if n <= 0 then redis.call("HDEL", P .. table_name, oid) end
end
-- holds of one object at time now: pinned, retained, highest priority (expired entries go)
local function holds_of(oid, now)
  local v = redis.call("HGET", P .. "T", oid)
  if not v then return false, false, 0 end
  local entries = cmsgpack.unpack(v)
  local live, pinned, prio = {}, false, nil
  for _, e in ipairs(entries) do
    if e[2] == false or e[2] > now then
      live[#live + 1] = e
      if e[3] == 1 then pinned = true end
      if prio == nil or e[4] > prio then prio = e[4] end
    end
  end
  if #live == 0 then
    redis.call("HDEL", P .. "T", oid)
    return false, false, 0
  end
  if #live < #entries then redis.call("HSET", P .. "T", oid, cmsgpack.pack(live)) end
  return pinned, true, prio
end
-- bytes pinned at now: the charged size of every object with a holding pin, plus what puts in
-- flight reserved to grow them (BG: object -> growth)
local function pinned_bytes(now)
  local used, pinned = 0, {}
  local all = redis.call("HGETALL", P .. "T")
  for i = 1, #all, 2 do
    local oid = all[i]
    if holds_of(oid, now) then
      pinned[oid] = true
      local _, objs = load(string.sub(oid, 1, 8))
      local o = objs and objs[string.sub(oid, 9)]
      if o then used = used + o[2] end
      used = used + tonumber(redis.call("HGET", P .. "BG", oid) or "0")
    end
  end
  return used, pinned
end
-- the pages worth need bytes first in eviction order (unheld by rank, then retained by
-- priority and rank; never a page with a pinned object or an object in flight or excluded)
local function pick(need, exclude, now)
  local victims, freed, retained, dangling = {}, 0, {}, {}
  local nxt = ranked()
  while freed < need do
    local fp, rank = nxt()
    if not fp then break end
    local prefix, objs = load(fp)
    if not prefix then
      dangling[#dangling + 1] = fp
    else
      local skip, held, prio = false, false, nil
      for s, _ in pairs(objs) do
        local oid = fp .. s
        if exclude[oid] or busy(oid) then skip = true break end
        local pinned, ret, p = holds_of(oid, now)
        if pinned then skip = true break end
        if ret then
          held = true
          if prio == nil or p > prio then prio = p end
        end
      end
      if not skip then
        if held then
          retained[#retained + 1] = {prio, rank, fp, prefix, objs}
        else
          victims[#victims + 1] = {fp, prefix, objs}
          freed = freed + charged_of(objs)
        end
      end
    end
  end
  for _, fp in ipairs(dangling) do rank_del(fp) end
  if freed < need then
    table.sort(retained, function(a, b)
      if a[1] ~= b[1] then return a[1] < b[1] end
      return a[2] < b[2]
    end)
    for _, r in ipairs(retained) do
      if freed >= need then break end
      victims[#victims + 1] = {r[3], r[4], r[5]}
      freed = freed + charged_of(r[5])
    end
  end
  return victims, freed
end
-- take the victims out of the index; their objects are announced as deletes of the batch
local function evict(victims, batch)
  local blob = {}
  for _, v in ipairs(victims) do
    local fp, prefix, objs = v[1], v[2], v[3]
    remove_page(fp, prefix, objs)
    for s, _ in pairs(objs) do
      count_busy("BD", fp .. s, 1)
      batch.victims[#batch.victims + 1] = {fp, prefix, s}
      blob[#blob + 1] = string.char(#prefix) .. prefix .. string.char(#s) .. s
    end
  end
  return table.concat(blob)
end
local function clock(arg) if arg == "" then return now_ms() / 1000 end return tonumber(arg) end
""".replace("%FORMAT%", str(FORMAT))

#: ARGV: writer, capacity, feed maxlen, now (unix s, "" for the server's), pin budget (""
#: none), then per key: fp, prefix, suffix, charge, depth. Announces the puts and makes room
#: for them at once; a rewrite that grows a pinned object is charged as a pin (past the
#: budget: {"BUDGET", budget, used, asked} and nothing reserved).
RESERVE = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local w, capacity, maxlen, now = ARGV[1], tonumber(ARGV[2]), ARGV[3], clock(ARGV[4])
local budget = tonumber(ARGV[5])
if not alive(w) then return {"FENCED"} end
local keys, growth, exclude, pinned_growth = {}, 0, {}, {}
local asked = 0
for i = 6, #ARGV, 5 do
  local fp, prefix, suffix = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local charge, depth = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local oid = fp .. suffix
  if redis.call("HEXISTS", P .. "BD", oid) == 1 then return {"BUSY"} end
  local known, objs = load(fp)
  local old = 0
  if objs and objs[suffix] then old = objs[suffix][2] end
  local g = charge - old
  if g < 0 then g = 0 end
  growth = growth + g
  exclude[oid] = true
  keys[#keys + 1] = {fp, prefix, suffix, g, depth}
  if budget and g > 0 and old > 0 and holds_of(oid, now) then
    pinned_growth[#pinned_growth + 1] = {oid, g}
    asked = asked + g
  end
end
if asked > 0 then
  local used = pinned_bytes(now)
  if used + asked > budget then return {"BUDGET", fmt(budget), fmt(used), fmt(asked)} end
end
local total = tonumber(redis.call("HGET", M, "total") or "0")
local reserved = tonumber(redis.call("HGET", M, "reserved") or "0")
local need = total + reserved + growth - capacity
local batch = {op = "put", g = growth, keys = keys, victims = {}, pg = pinned_growth}
local blob = ""
if need > 0 then
  local victims, freed = pick(need, exclude, now)
  if freed < need then return {"NOROOM", fmt(need), fmt(reserved)} end
  blob = evict(victims, batch)
end
for _, k in ipairs(keys) do count_busy("BP", k[1] .. k[3], 1) end
for _, pg in ipairs(pinned_growth) do redis.call("HINCRBY", P .. "BG", pg[1], fmt(pg[2])) end
redis.call("HINCRBY", M, "reserved", fmt(growth))
local id = redis.call("HINCRBY", M, "batches", 1)
redis.call("HSET", P .. "Q:" .. w, id, cmsgpack.pack(batch))
flush_feed(maxlen)
return {"OK", id, blob}
"""

#: ARGV: writer, batch, feed maxlen, then per key of the batch (its order): size (-1:
#: absent), charged; then per victim of the batch: size (-1: removed), charged. Sets every
#: key from the store and releases the batch; victims that stayed are indexed again, last in
#: line. FENCED (nothing recorded) when the writer's lease lapsed or the batch was reclaimed.
SETTLE = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local w, id, maxlen = ARGV[1], ARGV[2], ARGV[3]
if not alive(w) then return {"FENCED"} end
local raw = redis.call("HGET", P .. "Q:" .. w, id)
if not raw then return {"FENCED"} end
local batch = cmsgpack.unpack(raw)
local now = now_ms()
local at = 4
local pages = {}
for _, k in ipairs(batch.keys or {}) do
  local size, charged = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  at = at + 2
  if set_object(k[1], k[2], k[3], size, charged) then
    local s = score(now, k[5] or 0)
    if not pages[k[1]] or pages[k[1]] < s then pages[k[1]] = s end
  end
  count_busy("BP", k[1] .. k[3], -1)
end
for _, v in ipairs(batch.victims or {}) do
  local size, charged = tonumber(ARGV[at] or "-1"), tonumber(ARGV[at + 1] or "0")
  at = at + 2
  if size >= 0 and set_object(v[1], v[2], v[3], size, charged) then
    pages[v[1]] = score(now, 0)
  end
  count_busy("BD", v[1] .. v[3], -1)
end
for fp, s in pairs(pages) do rank_set(fp, s, "GT") end
for _, pg in ipairs(batch.pg or {}) do count_busy("BG", pg[1], -pg[2]) end
redis.call("HINCRBY", M, "reserved", fmt(-(batch.g or 0)))
redis.call("HDEL", P .. "Q:" .. w, id)
flush_feed(maxlen)
return {"OK"}
"""

#: ARGV: writer, batch, capacity, feed maxlen, now, then per victim of the batch that could
#: not be removed: its index in the batch's victims, size, charged. They are indexed again
#: (last in line) and room is made once more from other pages: never from an object that
#: failed to go for this batch (``batch.stuck``), so the step ends in room or ``NOROOM``.
ROOM = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local w, id, capacity, maxlen, now = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], clock(ARGV[5])
if not alive(w) then return {"FENCED"} end
local raw = redis.call("HGET", P .. "Q:" .. w, id)
if not raw then return {"FENCED"} end
local batch = cmsgpack.unpack(raw)
local ms = now_ms()
local kept = {}
batch.stuck = batch.stuck or {}
for i = 6, #ARGV, 3 do
  local v = batch.victims[tonumber(ARGV[i])]
  kept[tonumber(ARGV[i])] = true
  batch.stuck[#batch.stuck + 1] = v[1] .. v[3]
  if set_object(v[1], v[2], v[3], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])) then
    rank_set(v[1], score(ms, 0), "GT")
  end
  count_busy("BD", v[1] .. v[3], -1)
end
local victims = {}
for i, v in ipairs(batch.victims) do if not kept[i] then victims[#victims + 1] = v end end
batch.victims = victims
local exclude = {}
for _, k in ipairs(batch.keys) do exclude[k[1] .. k[3]] = true end
-- an object that could not be removed is not picked again for this put (it would fail
-- again, and the step would go round for ever): the room comes from other pages, or none
for _, oid in ipairs(batch.stuck) do exclude[oid] = true end
flush_tallies()  -- (the objects indexed again count before the room is measured)
local total = tonumber(redis.call("HGET", M, "total") or "0")
local reserved = tonumber(redis.call("HGET", M, "reserved") or "0")
local need = total + reserved - capacity
local blob = ""
local status = "OK"
if need > 0 then
  local picked, freed = pick(need, exclude, now)
  if freed < need then status = "NOROOM" end
  blob = evict(picked, batch)
end
redis.call("HSET", P .. "Q:" .. w, id, cmsgpack.pack(batch))
flush_feed(maxlen)
return {status, blob}
"""

#: ARGV: writer, feed maxlen, mode, group sizes ("n1,n2,..."), now (unix s, "" for the
#: server's), then per key: fp, prefix, suffix. Takes keys out of the index and announces their deletes (BUSY while one has a
#: change in flight). Mode "0": every key; "1" (gc's reconcile): only keys neither indexed
#: nor busy; "2" (``delete_until_held``): the groups, in order, up to the first one with a
#: held key (a pin or a retention that holds now), checked in this same step. Replies
#: {OK, batch, indexes of the keys taken (1-based), groups taken}.
DELETE = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local w, maxlen, mode = ARGV[1], ARGV[2], ARGV[3]
if not alive(w) then return {"FENCED"} end
local strays_only = mode == "1"
local batch = {op = "del", g = 0, keys = {}, victims = {}}
local chosen = {}
local keys = {}
for i = 6, #ARGV, 3 do keys[#keys + 1] = {ARGV[i], ARGV[i + 1], ARGV[i + 2]} end
for _, k in ipairs(keys) do
  if busy(k[1] .. k[3]) and not strays_only then return {"BUSY"} end
end
local take = #keys
local groups = 0
if mode == "2" then
  local now = clock(ARGV[5])
  take, groups = 0, 0
  for size in string.gmatch(ARGV[4], "%d+") do
    local n = tonumber(size)
    local held = false
    for j = take + 1, take + n do
      local _, retained = holds_of(keys[j][1] .. keys[j][3], now)
      if retained then held = true break end
    end
    if held then break end
    take = take + n
    groups = groups + 1
  end
end
for j = 1, take do
  local fp, prefix, suffix = keys[j][1], keys[j][2], keys[j][3]
  local oid = fp .. suffix
  local skip = false
  if strays_only then
    local known, objs = load(fp)
    skip = busy(oid) or (objs ~= nil and objs[suffix] ~= nil and known == prefix)
  end
  if not skip then
    chosen[#chosen + 1] = j
    batch.victims[#batch.victims + 1] = {fp, prefix, suffix}
  end
end
for _, v in ipairs(batch.victims) do
  set_object(v[1], v[2], v[3], -1, 0)
  count_busy("BD", v[1] .. v[3], 1)
end
local id = redis.call("HINCRBY", M, "batches", 1)
redis.call("HSET", P .. "Q:" .. w, id, cmsgpack.pack(batch))
flush_feed(maxlen)
return {"OK", id, chosen, groups}
"""

#: ARGV[1]: the keys as one string, each its fp (8 bytes), its suffix's length (1 byte) and
#: its suffix (one argument: a client encodes one string faster than thousands). {OK, a
#: string of "1" / "0"} (or NOINDEX).
EXISTS = "#!lua flags=no-writes\n" + PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local blob = ARGV[1]
local out = {}
local at = 1
while at <= #blob do
  local fp = string.sub(blob, at, at + 7)
  local n = string.byte(blob, at + 8)
  local suffix = string.sub(blob, at + 9, at + 8 + n)
  at = at + 9 + n
  local v = redis.call("HGET", bucket(fp), fp)
  local hit = "0"
  if v and string.find(v, "\n" .. suffix .. " ", 2 + string.byte(v, 1), true) then hit = "1" end
  out[#out + 1] = hit
end
return {"OK", table.concat(out)}
"""

#: ARGV: per page: fp, depth. Makes each indexed page as recent as now (never less recent).
TOUCH = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local now = now_ms()
for i = 1, #ARGV, 2 do
  if redis.call("HEXISTS", bucket(ARGV[i]), ARGV[i]) == 1 then
    rank_set(ARGV[i], score(now, tonumber(ARGV[i + 1])), "GT")
  end
end
return {"OK"}
"""

#: ARGV: feed maxlen, a repair's look ("": none; else the server's ms before the store was
#: asked), mode ("build" or ""), then per key: fp, prefix, suffix, size (-1: absent),
#: charged, mtime (ms). Sets each key from the store (a repair, an adoption, a build); a new
#: page ranks by its mtime. A repair leaves alone a key with a change in flight and a key
#: whose page was settled or read since its look (the look is stale: a put came after it).
SET = PRELUDE + r"""
if not ready() and ARGV[3] ~= "build" then return {"NOINDEX"} end
local maxlen, look = ARGV[1], tonumber(ARGV[2])
local function changed_since(fp)
  local s = rank_of(fp)
  return s ~= false and s ~= nil and math.floor(tonumber(s) / 4096) + EPOCH >= look
end
local n = 0
for i = 4, #ARGV, 6 do
  local fp, prefix, suffix = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if not (look and (busy(fp .. suffix) or changed_since(fp))) then
    local fresh = redis.call("HEXISTS", bucket(fp), fp) == 0
    if set_object(fp, prefix, suffix, tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])) then
      n = n + 1
      if fresh then rank_set(fp, score(tonumber(ARGV[i + 5]), 0), "NX") end
    end
  end
end
if ARGV[3] == "build" then
  changes = {}  -- (a build is no change: a feed reader starts over from a listing)
  flush_tallies()
else
  flush_feed(maxlen)
end
return {"OK", n}
"""

#: ARGV: writer, batch, feed maxlen, then per victim of the delete batch that stayed: its
#: index, size, charged. Releases a delete batch.
SETTLE_DELETE = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local w, id, maxlen = ARGV[1], ARGV[2], ARGV[3]
local raw = redis.call("HGET", P .. "Q:" .. w, id)
if not raw then return {"FENCED"} end
local batch = cmsgpack.unpack(raw)
local ms = now_ms()
for i = 4, #ARGV, 3 do
  local v = batch.victims[tonumber(ARGV[i])]
  if set_object(v[1], v[2], v[3], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])) then
    rank_set(v[1], score(ms, 0), "NX")
  end
end
for _, v in ipairs(batch.victims) do count_busy("BD", v[1] .. v[3], -1) end
redis.call("HDEL", P .. "Q:" .. w, id)
flush_feed(maxlen)
return {"OK"}
"""

#: ARGV: the lapsed writer, the claimer. Moves the lapsed writer's batches to the claimer
#: (renumbered) when its heartbeat is gone; returns {OK, id, batch, id, batch, ...}.
CLAIM = PRELUDE + r"""
local dead, me = ARGV[1], ARGV[2]
if alive(dead) then return {"ALIVE"} end
local out = {"OK"}
local batches = redis.call("HGETALL", P .. "Q:" .. dead)
for i = 1, #batches, 2 do
  local id = redis.call("HINCRBY", M, "batches", 1)
  redis.call("HSET", P .. "Q:" .. me, id, batches[i + 1])
  out[#out + 1] = id
  out[#out + 1] = batches[i + 1]
end
redis.call("DEL", P .. "Q:" .. dead)
redis.call("HDEL", P .. "W", dead)
return out
"""

#: ARGV: writer, info, lease ms. Registers a writer incarnation with its heartbeat.
REGISTER = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
redis.call("HSET", P .. "W", ARGV[1], ARGV[2])
redis.call("SET", P .. "H:" .. ARGV[1], "1", "PX", ARGV[3])
return {"OK"}
"""

#: ARGV: owner, until ("" none), pinned ("1"/"0"), priority, budget, now ("" server), then
#: per key: fp, suffix. Sets the owner's entry on each indexed key; a holding pin past the
#: budget: {"BUDGET", budget, used, asked} and nothing set.
RETAIN = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local owner, until_s, pinned, prio = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local budget, now = tonumber(ARGV[5]), clock(ARGV[6])
local until_v = false
if until_s ~= "" then until_v = tonumber(until_s) end
local stored = {}
for i = 7, #ARGV, 2 do
  local fp, suffix = ARGV[i], ARGV[i + 1]
  local _, objs = load(fp)
  if objs and objs[suffix] then stored[#stored + 1] = {fp .. suffix, objs[suffix][2]} end
end
if #stored == 0 then return {"OK"} end
local holds = until_v == false or until_v > now
if pinned == 1 and holds then
  local used, pinned_now = pinned_bytes(now)
  local asked = 0
  for _, s in ipairs(stored) do
    if not pinned_now[s[1]] then
      asked = asked + s[2] + tonumber(redis.call("HGET", P .. "BG", s[1]) or "0")
    end
  end
  if used + asked > budget then return {"BUDGET", fmt(budget), fmt(used), fmt(asked)} end
end
for _, s in ipairs(stored) do
  local v = redis.call("HGET", P .. "T", s[1])
  local entries = {}
  if v then entries = cmsgpack.unpack(v) end
  local kept = {}
  for _, e in ipairs(entries) do if e[1] ~= owner then kept[#kept + 1] = e end end
  kept[#kept + 1] = {owner, until_v, pinned, prio}
  redis.call("HSET", P .. "T", s[1], cmsgpack.pack(kept))
end
return {"OK"}
"""

#: ARGV: owner, then per key: fp, suffix. Drops the owner's entry on each key.
RELEASE = PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local owner = ARGV[1]
for i = 2, #ARGV, 2 do
  local oid = ARGV[i] .. ARGV[i + 1]
  local v = redis.call("HGET", P .. "T", oid)
  if v then
    local kept = {}
    for _, e in ipairs(cmsgpack.unpack(v)) do if e[1] ~= owner then kept[#kept + 1] = e end end
    if #kept == 0 then redis.call("HDEL", P .. "T", oid)
    else redis.call("HSET", P .. "T", oid, cmsgpack.pack(kept)) end
  end
end
return {"OK"}
"""

#: ARGV: now ("" server), then per key: fp, suffix (none: every held key). The holding
#: entries of each, msgpack; and the bytes pinned now.
HOLDS = "#!lua flags=no-writes\n" + PRELUDE + r"""
if not ready() then return {"NOINDEX"} end
local now = clock(ARGV[1])
local function live(v)
  local out = {}
  for _, e in ipairs(cmsgpack.unpack(v)) do
    if e[2] == false or e[2] > now then out[#out + 1] = e end
  end
  return out
end
local out = {"OK"}
for i = 2, #ARGV, 2 do
  local v = redis.call("HGET", P .. "T", ARGV[i] .. ARGV[i + 1])
  if v then out[#out + 1] = cmsgpack.pack(live(v)) else out[#out + 1] = "" end
end
local pinned = 0
local all = redis.call("HGETALL", P .. "T")
for i = 1, #all, 2 do
  for _, e in ipairs(live(all[i + 1])) do
    if e[3] == 1 then
      local _, objs = load(string.sub(all[i], 1, 8))
      local o = objs and objs[string.sub(all[i], 9)]
      if o then pinned = pinned + o[2] end
      break
    end
  end
end
out[#out + 1] = fmt(pinned)
return out
"""

#: ARGV: seq base, epoch, rebuilt ("1": objects were found). Ends a build: the index is
#: ready, its change numbers start above any an earlier index of this root gave.
BUILT = PRELUDE + r"""
redis.call("HSET", M, "seq", ARGV[1], "epoch", ARGV[2], "reserved", "0", "format", FORMAT)
if ARGV[3] == "1" then redis.call("HSET", M, "rebuilt_at", fmt(now_ms())) end
redis.call("HSET", M, "ready", "1")
return {"OK"}
"""

#: ARGV: how many pages. Moves the ranks of up to that many pages from format 1's rank set
#: ``R`` into their buckets' rank sets; the last call (``R`` empty) sets the format. {OK,
#: pages left}.
MIGRATE = PRELUDE + r"""
local moved = redis.call("ZRANGE", P .. "R", 0, tonumber(ARGV[1]) - 1, "WITHSCORES")
for i = 1, #moved, 2 do
  rank_set(moved[i], moved[i + 1], "GT")
  redis.call("ZREM", P .. "R", moved[i])
end
local left = redis.call("ZCARD", P .. "R")
if left == 0 then redis.call("HSET", M, "format", FORMAT) end
return {"OK", left}
"""

SCRIPTS = {
    "reserve": RESERVE, "settle": SETTLE, "room": ROOM, "delete": DELETE, "exists": EXISTS,
    "touch": TOUCH, "set": SET, "settle_delete": SETTLE_DELETE, "claim": CLAIM,
    "register": REGISTER, "retain": RETAIN, "release": RELEASE, "holds": HOLDS,
    "built": BUILT, "migrate": MIGRATE,
}

__all__ = ["FORMAT", "SCRIPTS"]
