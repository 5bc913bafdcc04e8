// stallfree dashboard: live inter-token gaps, iterations and TTFT from /ws/telemetry;
// controls via PUT /api/config; chat and demo streams over /v1/stream.
"use strict";

const WINDOW_S = 30;         // seconds of history in the time charts
const SERIES = 12;           // streams drawn one by one (the server sends at most this many)
const TTFT_KEEP = 30;
const STEADY = ["#4cc9f0", "#48bfe3", "#56cfe1", "#64dfdf", "#72efdd", "#80ffdb",
                "#5390d9", "#5e60ce", "#6930c3", "#7400b8", "#4ea8de", "#8ecae6"];
const STALL = "#ff5d5d";
const WS_BASE = (location.protocol === "https:" ? "wss://" : "ws://") + location.host;

// what the browser tests read
const dash = window.dashboard = {
  connected: false, frames: 0, gapPoints: 0, stalledPoints: 0, iterations: 0,
  maxPrefill: 0, maxPrefillBesideDecodes: 0, prefillTokens: 0, demoDone: false, chatReplies: 0, predicted: 0,
  goodRequests: 0,
};
let apiKey = sessionStorage.getItem("stallfree-key") || "";
const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- charts
function axes(yLabel, y2Label, xLabel = "seconds since the server started") {
  const grid = { stroke: "#2a313b", width: 1 };
  const a = [
    { stroke: "#8b96a3", grid, ticks: grid, label: xLabel },
    { stroke: "#8b96a3", grid, ticks: grid, label: yLabel, size: 60 },
  ];
  if (y2Label) a.push({ scale: "ms", side: 1, stroke: "#ffb86b", grid: { show: false }, label: y2Label, size: 60 });
  return a;
}

function makeChart(el, height, series, extra = {}) {
  const opts = {
    width: el.clientWidth || 800, height, series, axes: extra.axes,
    scales: extra.scales || { x: { time: false } }, legend: { live: false, show: extra.legend !== false },
    cursor: { drag: { x: false, y: false } },
  };
  const chart = new uPlot(opts, series.map(() => []), el);
  new ResizeObserver(() => chart.setSize({ width: el.clientWidth, height })).observe(el);
  return chart;
}

const noLine = () => null;
const gapSeries = [{ label: "s" }];
for (let i = 0; i < SERIES; i++) {
  gapSeries.push({ label: `stream ${i + 1}`, stroke: STEADY[i], paths: noLine,
                   points: { show: true, size: 5, fill: STEADY[i] } });
}
gapSeries.push({ label: "stalled", stroke: STALL, paths: noLine, points: { show: true, size: 7, fill: STALL } });
const gapChart = makeChart($("gaps-chart"), 240, gapSeries, { axes: axes("gap ms"), legend: false });
const gapData = [[]].concat(gapSeries.slice(1).map(() => []));

const bars = uPlot.paths.bars({ size: [0.8, 14] });
const iterChart = makeChart($("iter-chart"), 220, [
  { label: "s" },
  { label: "prefill tokens", stroke: "#ffb86b", fill: "#ffb86b99", paths: bars, points: { show: false } },
  { label: "decode tokens", stroke: "#4cc9f0", fill: "#4cc9f0cc", paths: bars, points: { show: false } },
  { label: "token budget", stroke: "#7bd389", dash: [6, 4], points: { show: false } },
  { label: "iteration ms", stroke: "#e0e0e0", scale: "ms", width: 1.5, points: { show: false } },
  { label: "predicted ms", stroke: "#c77dff", scale: "ms", width: 1, dash: [3, 3], points: { show: false } },
  { label: "TBT target ms", stroke: "#ff5d5d", scale: "ms", width: 1, dash: [8, 4], points: { show: false } },
], { axes: axes("tokens", "ms"), scales: { x: { time: false }, ms: {} } });
const iterData = [[], [], [], [], [], [], []];

const ttftChart = makeChart($("ttft-chart"), 190, [
  { label: "request" },
  { label: "prefill", stroke: "#ffb86b", fill: "#ffb86b99", paths: bars, points: { show: false } },
  { label: "queue wait", stroke: "#c77dff", fill: "#c77dffcc", paths: bars, points: { show: false } },
], { axes: axes("ms", null, "request") });
const ttftData = [[], [], []];
let ttftCount = 0;

function trim(data, horizon) {
  let cut = 0;
  while (cut < data[0].length && data[0][cut] < horizon) cut++;
  if (cut) data.forEach((col) => col.splice(0, cut));
}

// ---------------------------------------------------------------- telemetry
function onFrame(f) {
  dash.frames++;
  const now = f.t / 1000;
  const gaps = f.gaps.slice().sort((a, b) => a[1] - b[1]);
  for (const [slot, t, gap, stalled] of gaps) {
    gapData[0].push(t / 1000);
    for (let s = 1; s < gapData.length; s++) gapData[s].push(null);
    const col = stalled ? gapData.length - 1 : slot + 1;
    gapData[col][gapData[0].length - 1] = gap;
    dash.gapPoints++;
    if (stalled) dash.stalledPoints++;
  }
  for (const [t, dur, decode, prefill, budget, predicted, tbt] of f.iterations) {
    iterData[0].push(t / 1000);
    iterData[1].push(decode + prefill);  // drawn behind the decode bar: its visible top part is prefill
    iterData[2].push(decode);
    iterData[3].push(budget);
    iterData[4].push(dur);
    iterData[5].push(predicted || null);
    iterData[6].push(tbt || null);
    if (predicted) dash.predicted++;
    dash.iterations++;
    dash.prefillTokens += prefill;
    dash.maxPrefill = Math.max(dash.maxPrefill, prefill);
    if (decode) dash.maxPrefillBesideDecodes = Math.max(dash.maxPrefillBesideDecodes, prefill);
  }
  for (const [, queue, prefill] of f.ttft) {
    ttftData[0].push(ttftCount++);
    ttftData[1].push(queue + prefill);
    ttftData[2].push(queue);
  }
  trim(gapData, now - WINDOW_S);
  trim(iterData, now - WINDOW_S);
  if (ttftData[0].length > TTFT_KEEP) ttftData.forEach((c) => c.splice(0, c.length - TTFT_KEEP));
  gapChart.setData(gapData);
  iterChart.setData(iterData);
  ttftChart.setData(ttftData);

  const st = f.stats, s = f.state;
  $("p50").textContent = st.count ? `${st.p50.toFixed(1)} ms` : "–";
  $("p99").textContent = st.count ? `${st.p99.toFixed(1)} ms` : "–";
  $("max").textContent = st.count ? `${st.max.toFixed(0)} ms` : "–";
  $("counts").textContent = `${s.running} / ${s.waiting} / ${s.partial_prefills}`;
  $("kv").textContent = `${s.kv_used} / ${s.kv_cached} / ${s.kv_free}`;
  $("mode").textContent = `${s.chunking} · ${s.token_budget}` + (s.tbt_slo_ms ? ` · TBT ${s.tbt_slo_ms} ms` : "") +
                          (s.ttft_slo_ms ? ` · TTFT ${s.ttft_slo_ms} ms` : "");
  $("missed").textContent = `${s.target_missed}`;
  $("drafts").textContent = s.speculate === "off" ? "off" : s.draft_tokens
    ? `${(100 * s.accepted_tokens / s.draft_tokens).toFixed(0)}% · ${s.tokens_per_step.toFixed(2)} (declined ${s.drafts_declined})`
    : `none yet (declined ${s.drafts_declined})`;
  showGoodput(f.goodput);
  showReplicas(f.replicas);
}

const percent = (n, of) => `${(100 * n / of).toFixed(0)}%`;

function showGoodput({ recent: r, total: t }) {
  dash.goodRequests = r.requests;
  $("good-of").textContent = `good, of the last ${r.requests} requests`;
  $("good").textContent = r.requests ? percent(r.good, r.requests) : "–";
  $("good-targets").textContent = r.requests
    ? `TTFT met ${percent(r.ttft_met, r.requests)}, TBT met ${percent(r.tbt_met, r.requests)}; ` +
      `since start ${percent(t.good, t.requests)} of ${t.requests}`
    : "";
}

function showReplicas(replicas) {
  $("replicas").hidden = !replicas;
  if (!replicas) return;
  const rows = replicas.map((r) => {
    const tr = document.createElement("tr");
    for (const v of [r.replica, r.running, r.waiting, r.kv_used, r.kv_cached, r.kv_blocks]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.append(td);
    }
    return tr;
  });
  $("replica-rows").replaceChildren(...rows);
}

function setConnected(on) {
  dash.connected = on;
  $("conn").className = "conn " + (on ? "on" : "off");
  $("conn").textContent = on ? "live" : "disconnected";
}

function connectTelemetry() {
  const ws = new WebSocket(WS_BASE + "/ws/telemetry");
  ws.onopen = () => {
    if (apiKey) ws.send(JSON.stringify({ type: "auth", api_key: apiKey }));
    setConnected(true);
  };
  ws.onmessage = (e) => {
    const f = JSON.parse(e.data);
    if (f.type === "telemetry") onFrame(f);
    else if (f.type === "error" && f.code === "unauthorized") needKey();
  };
  ws.onclose = () => { setConnected(false); setTimeout(connectTelemetry, 1000); };
}

// ---------------------------------------------------------------- API key
function needKey() {
  $("auth").hidden = false;
  status("this server needs an API key");
}
$("key-save").onclick = () => {
  apiKey = $("key").value.trim();
  sessionStorage.setItem("stallfree-key", apiKey);
  $("auth").hidden = true;
  if (api) api.close();
  status("key set");
  loadConfig();
};

// ---------------------------------------------------------------- controls
function status(text) { $("status").textContent = text; }

async function loadConfig() {
  const r = await fetch("/api/config");
  const view = await r.json();
  if (view.auth_required && !apiKey) needKey();
  const c = view.scheduler;
  $("chunking").value = c.chunking;
  $("budget").value = c.token_budget;
  $("tbt").value = c.tbt_slo_ms;
  $("ttft").value = c.ttft_slo_ms;
  $("policy").value = c.policy;
  $("speculate").value = c.speculate;
}

async function applyConfig(changes) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = "Bearer " + apiKey;
  const r = await fetch("/api/config", { method: "PUT", headers, body: JSON.stringify(changes) });
  const body = await r.json();
  if (r.status === 401 || r.status === 403) {  // 403: a key that generates but may not change settings
    needKey();
    status(body.error.message);
    return;
  }
  if (!r.ok) { status(body.error.message); return; }
  const c = body.scheduler;
  if ("token_budget" in changes) $("budget").value = c.token_budget;  // shows a clamp
  status(`applied: ${c.chunking}, budget ${c.token_budget}, TBT target ${c.tbt_slo_ms || "off"}, ` +
         `TTFT target ${c.ttft_slo_ms || "off"}, ${c.policy}, ` +
         `speculate ${c.speculate}` +
         (body.warnings.length ? ` (${body.warnings.join("; ")})` : ""));
}

$("chunking").onchange = () => applyConfig({ chunking: $("chunking").value });
$("policy").onchange = () => applyConfig({ policy: $("policy").value });
$("speculate").onchange = () => applyConfig({ speculate: $("speculate").value });
$("apply").onclick = () => applyConfig({ chunking: $("chunking").value, policy: $("policy").value,
                                         token_budget: Number($("budget").value),
                                         tbt_slo_ms: Number($("tbt").value),
                                         ttft_slo_ms: Number($("ttft").value) });

// ---------------------------------------------------------------- streams
let api = null;
const handlers = new Map();
let nextId = 0;

function apiSocket() {
  if (api && api.readyState <= WebSocket.OPEN) return api;
  const ws = new WebSocket(WS_BASE + "/v1/stream");
  ws.ready = new Promise((resolve) => ws.addEventListener("open", () => {
    if (apiKey) ws.send(JSON.stringify({ type: "auth", api_key: apiKey }));
    resolve();
  }));
  api = ws;
  api.onmessage = (e) => {
    const f = JSON.parse(e.data);
    if (f.type === "error" && f.code === "unauthorized") { needKey(); return; }
    const h = handlers.get(f.id);
    if (h) h(f);
  };
  api.onclose = () => { for (const h of handlers.values()) h({ type: "error", message: "connection closed" }); };
  return api;
}

async function generate(body, onFrame) {
  const ws = apiSocket();
  await ws.ready;
  const id = `ui${nextId++}`;
  return new Promise((resolve) => {
    handlers.set(id, (f) => {
      onFrame(f);
      if (f.type === "done" || f.type === "error") { handlers.delete(id); resolve(f); }
    });
    ws.send(JSON.stringify({ type: "generate", id, ...body }));
  });
}

// chat panel
const history = [];
$("chat-form").onsubmit = async (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  history.push({ role: "user", content: text });
  const log = $("chat-log");
  const you = document.createElement("div");
  you.className = "you";
  you.textContent = "you: " + text;
  const reply = document.createElement("div");
  log.append(you, reply);
  let answer = "";
  await generate({ messages: history, max_tokens: 200, temperature: 0 }, (f) => {
    if (f.type === "token") { answer += f.text; reply.textContent = answer; log.scrollTop = log.scrollHeight; }
    if (f.type === "error") reply.textContent = "error: " + f.message;
  });
  history.push({ role: "assistant", content: answer });
  dash.chatReplies++;
};

// demo: background chats, then one long prompt arriving while they decode
const TOPICS = ["the sea", "a lighthouse keeper", "a city at night", "a mountain storm", "an old library", "a robot"];
$("demo").onclick = async () => {
  $("demo").disabled = true;
  dash.demoDone = false;
  status("demo: 6 chats decoding…");
  const chats = TOPICS.map((topic) => generate(
    { messages: [{ role: "user", content: `Tell me a long story about ${topic}.` }],
      max_tokens: 160, temperature: 0.8, ignore_eos: true }, () => {}));
  await new Promise((r) => setTimeout(r, 1500));
  const passage = "The quarterly report covers revenue, staffing, logistics and the plans for next year. ";
  status("demo: long prompt (~3,000 tokens) injected; watch the gaps and the iterations");
  // a fresh first line each time, so no run is served from the prefix cache
  const header = `Summarize report ${Date.now()}-${Math.random().toString(36).slice(2)}:\n`;
  const long = generate({ prompt: header + passage.repeat(190), max_tokens: 8 }, () => {});
  const results = await Promise.all([...chats, long]);
  const done = results[results.length - 1];
  status(done.type === "done"
    ? `demo finished: long prompt TTFT ${done.timings.ttft_ms.toFixed(0)} ms (queue ${done.timings.queue_wait_ms.toFixed(0)}, ` +
      `prefill ${done.timings.prefill_ms.toFixed(0)})`
    : `demo: ${done.message}`);
  dash.demoDone = true;
  $("demo").disabled = false;
};

loadConfig();
connectTelemetry();
