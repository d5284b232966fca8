// Pygmy dashboard. Polls /dashboard/state about once a second; everything over time (rates,
// percentiles per second, chart history, events) is computed here from successive answers, so the
// page shows what happened since it was opened.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 300; // the charts' last five minutes
const STATE_TIMEOUT_MS = 4000;
const OPS = ["search", "lookup", "buy"];
const COLORS = { search: "#1f77b4", lookup: "#2ca02c", buy: "#d62728" };
const MARK = { election: "#1f6feb", down: "#d1242f", fault: "#d1242f" };

const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, text = "") => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
};

// ---- what the page remembers ----------------------------------------------------------------
let prev = null;                 // the previous answer
const lastHeard = {};            // replica -> server time it last answered
const replicaState = {};         // replica -> up | down | recovering | failed
const leaders = {};              // tier -> leader name
const marks = [];                // {t, color, label} drawn on the charts
const series = { t: [], rate: OPS.map(() => []), p50: OPS.map(() => []), p99: OPS.map(() => []) };

// ---- events ---------------------------------------------------------------------------------
function addEvent(t, kind, text, mark) {
  const li = el("li", { class: kind, "data-kind": kind });
  li.append(el("time", {}, new Date(t * 1000).toLocaleTimeString()), document.createTextNode(text));
  $("#events").prepend(li);
  while ($("#events").children.length > 200) $("#events").lastChild.remove();
  if (mark) marks.push({ t, color: MARK[kind] || "#888", label: mark });
}

// ---- replicas -------------------------------------------------------------------------------
function stateOf(r) {
  if (!r.alive) return "down";
  if (r.role === "failed") return "failed";
  if (r.role === "recovering") return "recovering";
  return "up";
}

// ---- the timers ----------------------------------------------------------------------------
// Each replica's own /status carries `timers` (ms): the ones in force on it and, on a leader, the
// round trips to each follower they follow. An older replica has none, and one started less than a
// second ago an empty object (it has not derived them yet): shown as such, never as zeros.
const TIMERS = ["heartbeat", "election", "lease", "probe"];

const num = v => (typeof v === "number" && isFinite(v) ? String(+v.toFixed(1)) : "-");  // 0.1 ms at most

function timersOf(r) {
  // What a card shows of a replica's timers: how they are set (`mode`) and each timer's value.
  const none = mode => ({ mode, values: Object.fromEntries(TIMERS.map(k => [k, "-"])) });
  if (!r.alive) return none("-");
  const t = r.timers;
  if (t === undefined || t === null) return none("not reported");
  if (!TIMERS.some(k => `${k}_ms` in t)) return none("not yet");
  const mode = t.adapt === false ? "fixed" : t.adapt === true ? "adaptive" : "";
  return { mode: mode ? `${mode}, in ms` : "in ms", values: Object.fromEntries(TIMERS.map(k => [k, num(t[`${k}_ms`])])) };
}

function rttOf(view, r) {
  // Median / p99 round trip of the tier leader's heartbeats to `r`: only a leader measures them.
  if (!r.alive) return "-";
  if (r.name === view.leader) return "leader";
  if (!view.leader) return "no leader";
  const leader = view.replicas.find(x => x.name === view.leader);
  const t = leader ? leader.timers : undefined;
  if (t === undefined || t === null) return "not reported";
  const median = (t.rtt_ms || {})[r.name], tail = (t.rtt_tail_ms || {})[r.name];
  if (typeof median !== "number") return "no samples yet";
  return `${num(median)} / ${num(tail)} ms`;
}

function card(tier, name) {
  let c = $(`.replica[data-name="${name}"]`);
  if (c) return c;
  c = el("div", { class: "replica", "data-name": name, "data-tier": tier });
  const head = el("div", { class: "name" });
  head.append(el("span", {}, name), el("span", { class: "role" }, "?"));
  const dl = el("dl");
  for (const [key, label, title] of [["term", "term"], ["commit", "commit"], ["applied", "applied"], ["lag", "lag"],
                                     ["digest", "digest"], ["heard", "heard"],
                                     ["rtt", "rtt", "the leader's heartbeats to this replica and back: median / p99"],
                                     ["timers", "timers", "in force on this replica: adaptive (follow the round trips) or fixed"]]) {
    dl.append(el("dt", title ? { title } : {}, label), el("dd", { "data-field": key }, "-"));
  }
  const timers = el("div", { class: "timers" });
  for (const k of TIMERS) {
    const cell = el("div");
    cell.append(el("span", {}, k), el("b", { "data-timer": k }, "-"));
    timers.append(cell);
  }
  const buttons = el("div", { class: "buttons", hidden: "" });
  for (const action of ["kill", "pause", "start"]) {
    const b = el("button", { type: "button", "data-action": action }, action);
    b.addEventListener("click", () => fault(action, name));
    buttons.append(b);
  }
  c.append(head, dl, timers, buttons);
  $(`#tier-${tier} .replicas`).append(c);
  return c;
}

function renderTier(tier, view, now, faults) {
  const leader = view.replicas.find(r => r.name === view.leader);
  const leaderCommit = leader ? leader.commit_index : null;
  $(`#tier-${tier} .leader-name`).textContent = view.leader ? `leader ${view.leader}` : "no leader";
  for (const r of view.replicas) {
    const c = card(tier, r.name);
    const state = stateOf(r);
    if (r.alive) lastHeard[r.name] = now;
    const lag = r.alive && leaderCommit !== null ? Math.max(0, leaderCommit - r.applied_index) : null;
    const isLeader = r.name === view.leader;
    c.classList.toggle("leader", isLeader);
    c.dataset.state = state;
    c.dataset.role = state === "down" ? "down" : r.role;
    c.dataset.lag = lag === null ? "" : String(lag);
    c.dataset.applied = r.alive ? String(r.applied_index) : "";
    $(".role", c).textContent = state === "down" ? "down" : r.role;
    const set = (k, v) => { $(`[data-field=${k}]`, c).textContent = v; };
    set("term", r.alive ? r.term : "-");
    set("commit", r.alive ? r.commit_index : "-");
    set("applied", r.alive ? r.applied_index : "-");
    set("lag", lag === null ? "-" : lag);
    set("digest", r.alive && r.state_digest ? r.state_digest.slice(0, 12) : "-");
    const heard = lastHeard[r.name];
    set("heard", heard === undefined ? "never" : `${Math.max(0, now - heard).toFixed(1)} s ago`);
    set("rtt", rttOf(view, r));
    const timers = timersOf(r);
    set("timers", timers.mode);
    for (const k of TIMERS) $(`[data-timer=${k}]`, c).textContent = timers.values[k];
    $(".buttons", c).hidden = !faults;
    noteTransition(tier, r, state, now);
  }
  if (prev !== null && view.leader !== leaders[tier]) {
    if (view.leader) {
      const term = leader ? leader.term : "?";
      addEvent(now, "election", `${view.leader} leads ${tier} (term ${term})`, `${view.leader} leads`);
    } else {
      addEvent(now, "down", `${tier} has no leader`, null);
    }
  }
  leaders[tier] = view.leader;
}

function noteTransition(tier, r, state, now) {
  const before = replicaState[r.name];
  replicaState[r.name] = state;
  if (prev === null || before === undefined || before === state) return;
  if (state === "down") addEvent(now, "down", `${r.name} down (not answering)`, `${r.name} down`);
  else if (state === "failed") addEvent(now, "down", `${r.name} failed: ${r.error || "storage fault"}`, `${r.name} failed`);
  else if (state === "recovering") addEvent(now, "recovering", `${r.name} recovering (catching up)`, null);
  else if (before === "recovering" || before === "down") addEvent(now, "up", `${r.name} caught up`, null);
  else addEvent(now, "up", `${r.name} up`, null);
}

// ---- workers --------------------------------------------------------------------------------
function renderWorkers(workers, now) {
  const before = {};
  if (prev) for (const w of prev.workers) before[w.pid] = w;
  const dt = prev ? now - prev.now : 0;
  const rows = workers.map(w => {
    const tr = el("tr", { "data-pid": w.pid });
    const lookups = w.hits + w.misses;
    const ratio = lookups ? `${(100 * w.hits / lookups).toFixed(1)}%` : "-";
    const lease = w.lease_valid ? `held, ${w.lease_left_ms} ms left (term ${w.lease_term})` : "none";
    const b = before[w.pid];
    const inval = b && dt > 0 && w.invalidations >= b.invalidations ? ((w.invalidations - b.invalidations) / dt).toFixed(1) : "-";
    for (const v of [w.pid, w.entries, ratio, lease, inval]) tr.append(el("td", {}, String(v)));
    return tr;
  });
  $("#workers tbody").replaceChildren(...rows);
}

// ---- charts ---------------------------------------------------------------------------------
function quantile(q, lo, hi) {
  // Like Prometheus' histogram_quantile, over the requests between two answers: bucket deltas,
  // linear within the bucket the rank falls in. Seconds, or null without requests.
  if (!lo || !hi || !hi.buckets.length || hi.buckets.length !== lo.buckets.length) return null;
  const d = hi.buckets.map((b, i) => [b[0], b[1] - lo.buckets[i][1]]);
  const total = d[d.length - 1][1];
  if (total <= 0) return null;
  const rank = q * total;
  let prevLe = 0, prevCount = 0;
  for (const [le, count] of d) {
    if (count >= rank) {
      if (le === null) return prevLe;  // in +Inf: the largest finite bound is all we know
      return prevLe + (le - prevLe) * (count > prevCount ? (rank - prevCount) / (count - prevCount) : 1);
    }
    prevLe = le === null ? prevLe : le;
    prevCount = count;
  }
  return prevLe;
}

const markerPlugin = {
  hooks: {
    draw: [u => {
      const ctx = u.ctx, dpr = devicePixelRatio || 1;
      ctx.save();
      ctx.font = `${11 * dpr}px system-ui, sans-serif`;
      let lastEnd = -Infinity, row = 0;  // labels of marks close together go on rows below each other
      for (const m of marks) {
        if (m.t < u.scales.x.min || m.t > u.scales.x.max) continue;
        const x = Math.round(u.valToPos(m.t, "x", true));
        ctx.strokeStyle = m.color; ctx.fillStyle = m.color; ctx.lineWidth = 1.5 * dpr;
        ctx.setLineDash([4 * dpr, 3 * dpr]);
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        row = x + 3 * dpr < lastEnd ? (row + 1) % 5 : 0;
        ctx.fillText(m.label, x + 3 * dpr, u.bbox.top + (12 + 13 * row) * dpr);
        lastEnd = Math.max(row ? lastEnd : 0, x + 3 * dpr + ctx.measureText(m.label).width);
      }
      ctx.restore();
    }],
  },
};

function makeChart(target, seriesDefs, yOpts) {
  const box = $(target);
  return new uPlot({
    width: Math.max(300, box.clientWidth), height: 220, plugins: [markerPlugin],
    scales: { x: { time: true }, y: yOpts },
    axes: [{}, { size: 55 }],
    series: [{}, ...seriesDefs.map(s => ({ points: { show: false }, ...s }))],
    legend: { live: false },
  }, [[], ...seriesDefs.map(() => [])], box);
}

const rateChart = makeChart("#chart-rate", OPS.map(op => ({ label: op, stroke: COLORS[op], width: 2 })),
                            { range: (u, min, max) => [0, Math.max(5, max * 1.1)] });
const latencyChart = makeChart("#chart-latency", OPS.flatMap(op => [
  { label: `${op} p50`, stroke: COLORS[op], width: 2 },
  { label: `${op} p99`, stroke: COLORS[op], width: 1, dash: [6, 4] },
]), { distr: 3 });

function pushSample(state) {
  if (!prev) return;
  const dt = state.now - prev.now;
  if (dt <= 0) return;
  series.t.push(state.now);
  OPS.forEach((op, i) => {
    const a = prev.operations[op], b = state.operations[op];
    const n = b.count - a.count;
    const fresh = n >= 0;  // a restarted frontend starts its counters over
    series.rate[i].push(fresh ? n / dt : null);
    const p50 = fresh ? quantile(0.5, a, b) : null, p99 = fresh ? quantile(0.99, a, b) : null;
    series.p50[i].push(p50 === null ? null : Math.max(0.05, p50 * 1000));
    series.p99[i].push(p99 === null ? null : Math.max(0.05, p99 * 1000));
  });
  while (series.t.length && series.t[0] < state.now - WINDOW_S) {
    series.t.shift();
    for (const k of ["rate", "p50", "p99"]) series[k].forEach(a => a.shift());
  }
  while (marks.length && marks[0].t < state.now - WINDOW_S) marks.shift();
  rateChart.setData([series.t, ...series.rate]);
  latencyChart.setData([series.t, ...OPS.flatMap((op, i) => [series.p50[i], series.p99[i]])]);
}

window.addEventListener("resize", () => {
  for (const [chart, sel] of [[rateChart, "#chart-rate"], [latencyChart, "#chart-latency"]]) {
    chart.setSize({ width: Math.max(300, $(sel).clientWidth), height: 220 });
  }
});

// ---- polling --------------------------------------------------------------------------------
let lastOk = null;

async function poll() {
  try {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), STATE_TIMEOUT_MS);
    const resp = await fetch("/dashboard/state", { cache: "no-store", signal: ctl.signal });
    clearTimeout(timer);
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const state = await resp.json();
    render(state);
    lastOk = Date.now();
    $("#conn").className = "conn";
    $("#conn").textContent = `live · tiers as of ${Math.round(state.age_ms)} ms before ${new Date(state.now * 1000).toLocaleTimeString()}`;
  } catch (err) {
    $("#conn").className = "conn bad";
    const since = lastOk ? ` for ${((Date.now() - lastOk) / 1000).toFixed(0)} s` : "";
    $("#conn").textContent = `frontend not answering${since} (${err.message || err})`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function render(state) {
  $("#frontend").textContent = state.frontend;
  $("#fault-controls").hidden = !state.faults;
  $("#pause-seconds").max = String(state.max_pause);
  if (prev === null) {
    const who = ["catalog", "order"].map(t => `${t} leader ${state.tiers[t].leader || "none"}`).join(", ");
    addEvent(state.now, "info", `page opened: ${who}`, null);
  }
  for (const tier of ["catalog", "order"]) renderTier(tier, state.tiers[tier], state.now, state.faults);
  renderWorkers(state.workers, state.now);
  pushSample(state);
  prev = state;
}

// ---- fault buttons --------------------------------------------------------------------------
const tokenInput = $("#token");
tokenInput.value = sessionStorage.getItem("pygmy-admin-token") || "";
tokenInput.addEventListener("change", () => sessionStorage.setItem("pygmy-admin-token", tokenInput.value));
$("#fault-controls").addEventListener("submit", ev => ev.preventDefault());

async function fault(action, name) {
  const note = $("#fault-note");
  const body = { action, name };
  if (action === "pause") body.seconds = Number($("#pause-seconds").value) || 5;
  note.className = "note";
  note.textContent = `${action} ${name}…`;
  try {
    const resp = await fetch("/dashboard/faults", {
      method: "POST", headers: { "Content-Type": "application/json", Authorization: `Bearer ${tokenInput.value}` },
      body: JSON.stringify(body),
    });
    const answer = await resp.json();
    if (!resp.ok) throw new Error(answer.error ? answer.error.message : `HTTP ${resp.status}`);
    note.textContent = answer.message;
    const t = prev ? prev.now : Date.now() / 1000;
    addEvent(t, action === "start" ? "info" : "fault", `${answer.message} (this page)`,
             action === "start" ? null : `${action} ${name}`);
  } catch (err) {
    note.className = "note bad";
    note.textContent = `${action} ${name} refused: ${err.message || err}`;
  }
}

// ---- storefront (the public API) ------------------------------------------------------------
async function api(method, path, headers = {}) {
  const resp = await fetch(path, { method, headers, cache: "no-store" });
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error ? body.error.message : `HTTP ${resp.status}`);
  return body;
}

function show(text) { $("#store-out").textContent = text; }

$("#store-search-form").addEventListener("submit", async ev => {
  ev.preventDefault();
  const topic = $("#store-topic").value.trim();
  try {
    const page = await api("GET", `/search/${encodeURIComponent(topic)}?limit=20`);
    const items = page.items.map(b => {
      const li = el("li", { "data-item": b.item_number }, `${b.item_number}: ${b.title}`);
      li.addEventListener("click", () => { $("#store-item").value = b.item_number; });
      return li;
    });
    $("#store-results").replaceChildren(...items);
    show(`${page.items.length} book(s) on ${topic}${page.next ? " (more follow)" : ""}`);
  } catch (err) { show(`search failed: ${err.message}`); }
});

$("#store-item-form").addEventListener("submit", async ev => {
  ev.preventDefault();
  try {
    const b = await api("GET", `/lookup/${$("#store-item").value}`);
    show(`${b.title}\n${b.topic} · ${b.stock} in stock · $${b.cost}`);
  } catch (err) { show(`lookup failed: ${err.message}`); }
});

$("#store-buy").addEventListener("click", async () => {
  const item = $("#store-item").value;
  try {
    const key = crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
    const o = await api("POST", `/buy/${item}`, { "Idempotency-Key": `dashboard-${key}` });
    const order = await api("GET", `/orders/${o.order_number}`);
    show(`order ${order.order_number}: ${order.quantity} × ${order.title}, total $${order.total}`);
  } catch (err) { show(`buy failed: ${err.message}`); }
});

poll();
