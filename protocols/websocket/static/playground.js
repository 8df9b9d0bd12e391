// tokenloom playground: chat over the WebSocket protocol (protocols/messages.py) and a
// live engine panel polled from GET /stats. Plain JS, no build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const STATS_INTERVAL_MS = 250;
const KEY_STORAGE = "tokenloom.apiKey";

const state = {
  ws: null,
  session: null,
  history: [],      // finished turns: [{role, content}]
  current: null,    // the request in flight: {id, user, el, text, tokens}
  nextId: 1,
  reconnectTimer: null,
  lastBlocks: null,
};

// ---- connection -------------------------------------------------------------------------
function apiKey() {
  return $("api-key").value.trim();
}

function connect() {
  clearTimeout(state.reconnectTimer);
  if (state.ws) {
    state.ws.onclose = null;
    state.ws.close();
  }
  const key = apiKey();
  // A browser WebSocket cannot set headers: the key travels as a subprotocol.
  const protocols = key ? ["tokenloom.v1", "tokenloom.bearer." + key] : ["tokenloom.v1"];
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  setStatus("connecting", "connecting…");
  let ws;
  try {
    ws = new WebSocket(scheme + location.host, protocols);
  } catch (err) {  // a key with characters a subprotocol cannot carry
    state.ws = null;
    setStatus("down", "invalid API key");
    return;
  }
  state.ws = ws;
  ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
  ws.onclose = (ev) => {
    if (state.ws !== ws) return;
    state.session = null;
    setStatus("down", ev.code === 1006 ? "disconnected (wrong API key?)" : "disconnected");
    if (state.current) finish({finish_reason: "aborted", usage: null, metrics: null}, "connection lost");
    updateButtons();
    state.reconnectTimer = setTimeout(connect, 3000);
  };
}

function setStatus(kind, text) {
  const el = $("conn-status");
  el.dataset.state = kind;
  el.textContent = text;
}

function onFrame(msg) {
  switch (msg.type) {
    case "session":
      state.session = msg;
      setStatus("ok", "connected");
      $("model-name").textContent = msg.model;
      $("limits").textContent = `context ${msg.limits.max_model_len} tokens · ` +
        `max_tokens default ${msg.limits.max_tokens_default}`;
      renderStrategies(msg.strategies);
      updateButtons();
      break;
    case "delta":
      if (state.current && msg.id === state.current.id) {
        state.current.text += msg.text;
        state.current.tokens += msg.token_ids.length;
        state.current.el.querySelector(".text").textContent = state.current.text;
        scrollChat();
      }
      break;
    case "done":
      if (state.current && msg.id === state.current.id) finish(msg);
      break;
    case "error":
      if (state.current && (msg.id === state.current.id || msg.id == null)) {
        finish(null, `${msg.code}: ${msg.message}`);
      } else {
        addNote(`${msg.code}: ${msg.message}`);
      }
      break;
    // accepted, pong: nothing to show
  }
}

// ---- chat -------------------------------------------------------------------------------
function numberOf(id, parse = parseFloat) {
  const raw = $(id).value.trim();
  if (raw === "") return null;
  const value = parse(raw, 10);
  return Number.isFinite(value) ? value : null;
}

function samplingParams() {
  const params = {};
  const fields = [["temperature", "temperature", parseFloat], ["top_p", "top-p", parseFloat],
    ["top_k", "top-k", parseInt], ["max_tokens", "max-tokens", parseInt], ["seed", "seed", parseInt]];
  for (const [name, id, parse] of fields) {
    const value = numberOf(id, parse);
    if (value !== null) params[name] = value;
  }
  const decoder = $("decoder").value;
  if (decoder) params.decoder = decoder;
  if ($("ignore-eos").checked) params.ignore_eos = true;
  return params;
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.current || !state.session) return;
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  const user = {role: "user", content: text};
  messages.push(...state.history, user);

  const id = "r" + state.nextId++;
  addMessage("user", text);
  const el = addMessage("assistant", "");
  el.classList.add("streaming");
  state.current = {id, user, el, text: "", tokens: 0};
  $("prompt").value = "";
  state.ws.send(JSON.stringify({type: "generate", id, messages, params: samplingParams()}));
  updateButtons();
}

function stop() {
  if (state.current && state.ws && state.ws.readyState === WebSocket.OPEN) {
    state.ws.send(JSON.stringify({type: "cancel", id: state.current.id}));
  }
}

// Ends the request in flight: with its `done` frame, or with an error message.
function finish(done, errorText) {
  const cur = state.current;
  state.current = null;
  cur.el.classList.remove("streaming");
  if (errorText) {
    cur.el.classList.add("failed");
    cur.el.querySelector(".text").textContent = cur.text || "";
    cur.el.append(el("p", "error", errorText));
  }
  if (done && done.metrics) cur.el.append(figures(done, cur));
  if (cur.text && done && done.finish_reason !== "error") {
    state.history.push(cur.user, {role: "assistant", content: cur.text});
  }
  updateButtons();
  scrollChat();
  $("prompt").focus();
}

function figures(done, cur) {
  const m = done.metrics;
  const n = done.usage ? done.usage.completion_tokens : cur.tokens;
  const fmt = (v) => (v == null ? "–" : v.toFixed(1));
  const items = [
    ["finish", done.finish_reason, "finish-reason"],
    ["TTFT", fmt(m.ttft_ms) + " ms"],
    ["TPOT", fmt(m.tpot_ms) + " ms"],
    ["tokens", String(n), "tokens"],
    ["tok/s", m.e2e_ms > 0 ? (n / (m.e2e_ms / 1000)).toFixed(1) : "–"],
  ];
  if (done.usage) {
    const cached = done.usage.cached_tokens ? ` (${done.usage.cached_tokens} cached)` : "";
    items.push(["prompt", done.usage.prompt_tokens + cached, "prompt"]);
  }
  if (m.num_draft_tokens > 0) {
    const rate = (100 * m.num_accepted_tokens / m.num_draft_tokens).toFixed(0);
    items.push(["accepted", `${m.num_accepted_tokens}/${m.num_draft_tokens} (${rate}%)`, "acceptance"]);
    // which decoders drafted (auto chooses per step): "eagle 40, ngram 12"
    const by = Object.entries(m.drafted_by || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    if (by) items.push(["drafted by", by, "drafted-by"]);
  }
  const box = el("div", "figures");
  for (const [label, value, cls] of items) {
    const item = el("span", cls || "", "");
    item.append(el("small", "", label + " "), el("b", "", value));
    box.append(item);
  }
  if (done.error) box.append(el("span", "error", done.error));
  return box;
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text) node.textContent = text;
  return node;
}

function addMessage(role, text) {
  const empty = $("messages").querySelector(".empty");
  if (empty) empty.remove();
  const msg = el("div", "msg " + role);
  msg.append(el("div", "role", role), el("div", "text", text));
  $("messages").append(msg);
  scrollChat();
  return msg;
}

function addNote(text) {
  $("messages").append(el("p", "note error", text));
  scrollChat();
}

function scrollChat() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function updateButtons() {
  const open = state.session && state.ws && state.ws.readyState === WebSocket.OPEN;
  $("send").disabled = !open || state.current !== null;
  $("stop").disabled = state.current === null;
}

function clearChat() {
  if (state.current) return;
  state.history = [];
  $("messages").replaceChildren(el("p", "empty", "New chat. Enter sends, Shift+Enter adds a line."));
}

// ---- engine panel -----------------------------------------------------------------------
async function pollStats() {
  const headers = apiKey() ? {Authorization: "Bearer " + apiKey()} : {};
  try {
    const res = await fetch("/stats", {headers, cache: "no-store"});
    if (!res.ok) throw new Error(res.status === 401 ? "/stats needs the API key" : `/stats: HTTP ${res.status}`);
    renderStats(await res.json());
    $("stats-error").hidden = true;
  } catch (err) {
    $("stats-error").textContent = err.message;
    $("stats-error").hidden = false;
    $("engine-health").textContent = "unreachable";
    $("engine-health").dataset.state = "down";
  }
  setTimeout(pollStats, STATS_INTERVAL_MS);
}

function renderStats(data) {
  const s = data.stats;
  const panel = $("engine");
  panel.dataset.polls = String(Number(panel.dataset.polls) + 1);
  panel.dataset.peakRunning = String(Math.max(Number(panel.dataset.peakRunning), s.running));
  panel.dataset.peakUsed = String(Math.max(Number(panel.dataset.peakUsed), s.kv_blocks_used));

  $("engine-health").textContent = data.health;
  $("engine-health").dataset.state = data.health === "ok" ? "ok" : "warn";
  const pct = (x) => (100 * x).toFixed(1) + " %";
  $("kv-usage").textContent = `${pct(s.kv_usage)} used · ${data.block_size} tokens/block`;
  $("kv-free").textContent = s.kv_blocks_free;
  $("kv-used").textContent = s.kv_blocks_used;
  $("kv-cached").textContent = s.kv_blocks_cached;
  $("stat-running").textContent = s.running;
  $("stat-waiting").textContent = s.waiting;
  $("stat-hit-rate").textContent = pct(s.prefix_hit_rate);
  $("stat-preemptions").textContent = s.preemptions;
  $("stat-generated").textContent = s.generated_tokens;
  $("stat-peak-kv").textContent = pct(s.peak_kv_usage);
  $("stat-acceptance").textContent = acceptance(s);
  $("stat-uptime").textContent = data.uptime_s.toFixed(0) + " s";
  if (data.model && $("model-name").textContent === "–") $("model-name").textContent = data.model;
  renderStrategies(data.strategies);
  if (data.blocks !== state.lastBlocks) drawBlocks(data.blocks);
}

// Speculative acceptance from the decoders' counters: decoder_<name>_drafted / _accepted.
function acceptance(stats) {
  let drafted = 0, accepted = 0;
  for (const [key, value] of Object.entries(stats)) {
    if (/^decoder_(.+_)?drafted$/.test(key)) drafted += value;
    if (/^decoder_(.+_)?accepted$/.test(key)) accepted += value;
  }
  if (drafted === 0) return "no drafts";
  return `${(100 * accepted / drafted).toFixed(1)} % (${accepted}/${drafted})`;
}

function renderStrategies(cfg) {
  if (!cfg) return;
  const name = (role) => (cfg[role] ? cfg[role].name : "none");
  const rows = [
    ["scheduler", name("scheduler")],
    ["cache manager", name("cache_manager")],
    ["decoder", name("decoder")],
    ["backend", name("backend")],
    ["quantizer", cfg.quantizer ? cfg.quantizer.name : "from checkpoint"],
    ["dtype", cfg.dtype],
    ["kv cache dtype", cfg.kv_cache_dtype],
  ];
  const box = $("strategies");
  const html = rows.map(([k, v]) => `<dt>${k}</dt><dd>${escapeHtml(String(v ?? "–"))}</dd>`).join("");
  if (box.innerHTML !== html) box.innerHTML = html;
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

// One cell per KV block (0 free, 1 used, 2 cached); the cells shrink as the pool grows.
function drawBlocks(blocks) {
  state.lastBlocks = blocks;
  const canvas = $("kv-map");
  const n = blocks.length;
  const width = canvas.clientWidth || 320;
  const gap = 1;
  const cell = Math.max(2, Math.min(16, Math.floor(Math.sqrt((width * 220) / Math.max(n, 1)))));
  const cols = Math.max(1, Math.floor((width + gap) / cell));
  const rows = Math.ceil(n / cols);
  const height = Math.max(cell, rows * cell);
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  const css = getComputedStyle(document.documentElement);
  const colours = ["--kv-free", "--kv-used", "--kv-cached"].map((v) => css.getPropertyValue(v).trim());
  ctx.clearRect(0, 0, width, height);
  const inner = cell > 3 ? cell - gap : cell;
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = colours[Number(blocks[i])] || colours[0];
    ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, inner, inner);
  }
}

// ---- wiring -----------------------------------------------------------------------------
function init() {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, apiKey());
    connect();
  });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  window.addEventListener("resize", () => state.lastBlocks !== null && drawBlocks(state.lastBlocks));
  connect();
  pollStats();
}

document.addEventListener("DOMContentLoaded", init);
