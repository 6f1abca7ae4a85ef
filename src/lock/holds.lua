-- Whether a lock's value, "<token>[:<fence>][!]" (false when there is no
-- lock), is `token`'s: the token, then the end, ':' (58) or '!' (33).
local function holds(value, token)
  if not value or string.sub(value, 1, #token) ~= token then return false end
  local after = string.byte(value, #token + 1)
  return after == nil or after == 58 or after == 33
end
