-- Health of a finetune.dev/FinetuneJob (finetune-operator), for Argo CD.
--
-- Written for Argo CD's Lua VM with the standard libraries closed (argocd-cm's default): it uses only
-- the base and table libraries, so it needs no resource.customizations.useOpenLibs key.
--
--   status missing, or of an older metadata.generation  Progressing  (the operator has not acted yet)
--   phase Succeeded                                      Healthy
--   phase Failed                                         Degraded     (status.message)
--   phase Suspended                                      Suspended
--   condition Stalled=True                               Degraded     (training stopped reporting)
--   condition NetworkHealthy=False                       Degraded     (e.g. EFA expected, sockets used)
--   phase Pending / Provisioning / Running (or other)    Progressing  (what it waits for, or step n/N, loss x)
local hs = {}

local function condition(ctype)
  if obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == ctype then
        return c
      end
    end
  end
  return nil
end

-- The condition's message, else its reason, else the default ("" counts as absent).
local function explain(c, default)
  if c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return default
end

-- x with at most 3 decimals, as text (no string or math library: integer arithmetic on floats).
local function decimal(x)
  local sign = ""
  if x < 0 then
    sign = "-"
    x = -x
  end
  local m = x * 1000 + 0.5
  m = m - m % 1
  local int = (m - m % 1000) / 1000
  local frac = m % 1000
  if frac == 0 then
    return sign .. int
  end
  local digits = 3
  while frac % 10 == 0 do
    frac = frac / 10
    digits = digits - 1
  end
  local pad = ""
  if digits == 3 and frac < 10 then
    pad = "00"
  elseif (digits == 3 and frac < 100) or (digits == 2 and frac < 10) then
    pad = "0"
  end
  return sign .. int .. "." .. pad .. frac
end

-- "step n/N, loss x" from status.training, or nil before the first progress report.
local function progress()
  local t = obj.status.training
  if t == nil or t.step == nil then
    return nil
  end
  local text = "step " .. t.step
  if t.totalSteps ~= nil then
    text = text .. "/" .. t.totalSteps
  end
  if t.loss ~= nil then
    text = text .. ", loss " .. decimal(t.loss)
  end
  return text
end

local function message_or(default)
  if obj.status.message ~= nil and obj.status.message ~= "" then
    return obj.status.message
  end
  return default
end

local function with_progress(text)
  local p = progress()
  if p ~= nil then
    return text .. " (" .. p .. ")"
  end
  return text
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for finetune-operator to act on the job"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for finetune-operator to observe generation " .. generation
  return hs
end

local phase = obj.status.phase

if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = with_progress(message_or("Fine-tuning succeeded"))
  return hs
end

if phase == "Failed" then
  hs.status = "Degraded"
  local failed = condition("Failed")
  local default = "FinetuneJob failed"
  if failed ~= nil then
    default = explain(failed, default)
  end
  hs.message = message_or(default)
  return hs
end

if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true (" .. message_or("suspended") .. ")"
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = "Stalled: " .. explain(stalled, "training stopped reporting progress")
  return hs
end

local network = condition("NetworkHealthy")
if network ~= nil and network.status == "False" then
  hs.status = "Degraded"
  hs.message = "Network unhealthy: " .. explain(network, "collectives are not on the expected transport")
  return hs
end

hs.status = "Progressing"
if phase == "Running" then
  hs.message = "Running: " .. (progress() or message_or("training"))
else
  -- Pending, Provisioning (and any phase a newer operator adds): the operator's message says what
  -- the job waits for (the RayJob, the Ray cluster, schedulable nodes, an older job of the same name).
  hs.message = phase .. ": " .. message_or("waiting")
end
return hs
