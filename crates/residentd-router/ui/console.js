// The node console: draws what /ui/events sends. Every string from the
// agent goes into the page as text (textContent, attribute values), never
// as markup.
"use strict";

// For the tests: when this script began (ms since the page was asked for).
const SCRIPT_BEGAN = performance.now();

const EVENTS_KEPT = 200;
const LOG_LINES_KEPT = 2000;
const SHADES = 6;

const $ = (id) => document.getElementById(id);

// An element with attributes and children (strings become text nodes).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(typeof c === "string" || typeof c === "number" ? String(c) : c);
  }
  return e;
}

// Bytes in decimal units, as the agent writes them ("4.0 GB").
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

// Each instance's colour, the same in every pool: by its place in the
// node's list, so that neighbours differ.
let shades = new Map();
function shade(id) {
  return `s${(shades.get(id) ?? 0) % SHADES}`;
}

function pct(part, whole) {
  return `${Math.max(0, Math.min(100, (100 * part) / whole))}%`;
}

function drawPool(p) {
  const scale = p.budget || p.effective || p.used || 1;
  const bar = el("div", { class: "bar", role: "img",
    "aria-label": `${p.name}: ${bytes(p.used)} used of ${bytes(p.budget)}` });
  const legend = el("ul", { class: "legend" });
  let held = 0;
  for (const h of p.held) {
    held += h.bytes;
    const asleep = h.state === "SLEEPING";
    const c = `${shade(h.id)}${asleep ? " asleep" : ""}`;
    const what = `${h.id}${asleep ? " (asleep)" : ""} ${bytes(h.bytes)}`;
    const seg = el("span", { class: c, title: what });
    seg.style.width = pct(h.bytes, scale);
    bar.append(seg);
    legend.append(el("li", { "data-id": h.id, "data-state": h.state }, el("i", { class: c }), what));
  }
  if (p.used > held) {
    const seg = el("span", { class: "other", title: `other: ${bytes(p.used - held)}` });
    seg.style.width = pct(p.used - held, scale);
    bar.append(seg);
    legend.append(el("li", {}, el("i", { class: "other" }), `other ${bytes(p.used - held)}`));
  }
  if (p.effective !== null && p.budget && p.effective < p.budget) {
    // The part of the budget a live reading says is not there, at its
    // end: held by processes outside the books, or beyond the memory the
    // machine has (a budget larger than it).
    const what = `not available ${bytes(p.unavailable)}`;
    const why = "budget beyond what the machine has free for it: memory other processes hold, or more than the machine has";
    const gone = el("div", { class: "unavailable", title: `${what}: ${why}` });
    gone.style.left = pct(p.effective, scale);
    bar.append(gone);
    legend.append(el("li", { "data-unavailable": p.unavailable, title: why }, el("i", { class: "unavailable" }), what));
  }
  const figures = [`used ${bytes(p.used)}`];
  figures.push(p.budget === null ? "no budget" : `budget ${bytes(p.budget)}`);
  if (p.effective !== null && p.effective !== p.budget) figures.push(`effective ${bytes(p.effective)}`);
  if (p.free !== null) figures.push(`free ${bytes(p.free)}`);
  if (p.available !== null) figures.push(`available now ${bytes(p.available)}`);
  return el("div", { class: "pool", "data-pool": p.name },
    el("div", { class: "head" }, el("strong", {}, p.name), el("span", { class: "figures" }, figures.join(" · "))),
    bar, legend);
}

let following = null;

// The rows by instance id, kept from one drawing to the next, so that a
// focused button stays focused while the figures change.
const rows = new Map();
// When an event named an instance not drawn yet, for the tests: its row
// says how long after that event it was drawn (data-shown-after-ms).
const heard = new Map();

// A duration in its largest unit or two ("3 h 12 min", "45 s").
function span(ms) {
  const s = Math.floor(ms / 1000);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

// The last cell, the row's buttons, stays at the table's right edge while
// the rest scrolls (console.css: .tools), so they are on screen at any
// width: logs, then the actions when they are on.
function newRow(id) {
  const logs = el("button", { type: "button", "aria-pressed": "false", "data-logs": "",
    "aria-label": `follow the logs of ${id}` }, "logs");
  logs.addEventListener("click", () => follow(id));
  const td = (cls) => el("td", { class: cls });
  const tools = el("td", { class: "tools" }, logs);
  for (const action of ["stop", "sleep", "wake"]) {
    const b = el("button", { type: "button", class: "act", "data-action": action, "aria-label": `${action} ${id}` }, action);
    b.addEventListener("click", () => act(action, b.closest("tr").dataset.workload, id));
    tools.append(b);
  }
  return el("tr", { "data-id": id }, el("th", { scope: "row" }, id), td(""), td(""),
    td("num"), td("num"), td("num"), td("num"), td("num"), td("num"), td("num"), td("num"), td("msg"),
    tools);
}

// Which actions an instance in `state` offers.
const OFFERS = {
  stop: (s) => !["EXITED", "FAILED", "STOPPING"].includes(s),
  sleep: (s) => s === "READY",
  wake: (s) => s === "SLEEPING",
};

function fillRow(row, i) {
  const cells = row.cells;
  const put = (k, text) => { if (cells[k].textContent !== text) cells[k].textContent = text; };
  const n = (v) => (v ? String(v) : "–");
  row.dataset.state = i.state;
  row.dataset.workload = i.workload;
  for (const b of row.querySelectorAll("button[data-action]")) b.hidden = !OFFERS[b.dataset.action](i.state);
  cells[2].className = `st-${i.state}`;
  put(1, i.workload); put(2, i.state); put(3, n(i.pid)); put(4, n(i.port));
  put(5, bytes(i.reserved)); put(6, bytes(i.measured));
  put(7, i.started_ms ? span(Math.max(0, Date.now() - i.started_ms)) : "–");
  put(8, String(i.restarts)); put(9, i.hold_left_ms ? span(i.hold_left_ms) : "–");
  put(10, i.lease_left_ms ? span(i.lease_left_ms) : "–");
  put(11, i.message);
}

function drawInstances(list) {
  const body = $("instances").tBodies[0];
  const seen = new Set();
  let before = body.firstChild;
  for (const i of list) {
    let row = rows.get(i.id);
    if (!row) {
      row = newRow(i.id);
      rows.set(i.id, row);
      if (heard.has(i.id)) row.dataset.shownAfterMs = (performance.now() - heard.get(i.id)).toFixed(0);
    }
    fillRow(row, i);
    seen.add(i.id);
    if (row === before) before = row.nextSibling;
    else body.insertBefore(row, before);
  }
  for (const [id, row] of rows) {
    if (!seen.has(id)) {
      row.remove();
      rows.delete(id);
    }
  }
}

function drawNode(n) {
  const began = performance.now();
  $("node").textContent = n.node;
  shades = new Map(n.instances.map((i, k) => [i.id, k]));
  $("pools").replaceChildren(...n.pools.map(drawPool));
  drawInstances(n.instances);
  $("count").textContent = `(${n.instances.length})`;
  drawTraffic(n.traffic);
  // For the tests: how long a drawing takes, when the first one ended
  // (milliseconds since the page was asked for), and how many there were.
  const now = performance.now();
  document.body.dataset.renderMs = (now - began).toFixed(1);
  document.body.dataset.firstDrawnMs ??= now.toFixed(0);
  document.body.dataset.scriptBeganMs ??= SCRIPT_BEGAN.toFixed(0);
  document.body.dataset.draws = String(Number(document.body.dataset.draws || 0) + 1);
  up(`${n.node} · agent ${n.version} · live`);
}

// Milliseconds as the page writes them: "850 ms", "2.4 s".
function ms(v) {
  if (v === null || v === undefined) return "–";
  return v < 1000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(1)} s`;
}

function drawTraffic(t) {
  const traffic = [];
  const models = new Set([...Object.keys(t.in_flight), ...Object.keys(t.waiting)]);
  for (const model of [...models].sort()) {
    traffic.push(el("dt", {}, model),
      el("dd", { "data-model": model, "data-in-flight": t.in_flight[model] ?? 0, "data-waiting": t.waiting[model] ?? 0 },
        `${t.in_flight[model] ?? 0} in flight · ${t.waiting[model] ?? 0} waiting for a swap`));
  }
  if (!traffic.length) traffic.push(el("dt", {}, "no requests yet"), el("dd", {}, ""));
  $("traffic").replaceChildren(...traffic);
  const rows = t.recent.map((r) => el("tr", { "data-model": r.model, "data-status": r.status },
    el("td", {}, new Date(r.arrived_unix_ms).toLocaleTimeString()),
    el("td", {}, r.model),
    el("td", { class: "num" }, `${r.status}${r.cut_off ? " (cut off)" : ""}`),
    el("td", { class: "num" }, ms(r.first_token_ms)),
    el("td", { class: "num" }, ms(r.total_ms)),
    el("td", { class: "num" }, r.tokens === null ? "–" : String(r.tokens)),
    el("td", { class: "num" }, r.tokens_per_s === null ? "–" : r.tokens_per_s.toFixed(1))));
  $("recent").tBodies[0].replaceChildren(...rows);
}

// Place's answer for the workload chosen, in the agent's words.
function drawPlacement(p) {
  const out = [];
  if (p.admitted) {
    out.push(el("p", { class: "ok" }, `A start of ${p.workload} would be admitted.`));
    if (p.sleep.length) out.push(el("p", {}, `It would put to sleep: ${p.sleep.join(", ")}.`));
    if (p.evict.length) {
      out.push(el("p", {}, `It would evict: ${p.evict.map((v) => `${v.id} (${v.workload}, ${bytes(v.bytes)})`).join(", ")}.`));
    }
    if (p.wait_for.length) out.push(el("p", {}, `It would wait for: ${p.wait_for.join(", ")}.`));
    if (!p.sleep.length && !p.evict.length && !p.wait_for.length) out.push(el("p", {}, "It fits as the node is."));
    if (p.free_after !== null) out.push(el("p", { class: "muted" }, `Left free after it: ${bytes(p.free_after)}.`));
  } else {
    out.push(el("p", { class: "bad" }, `A start of ${p.workload} would be refused:`));
    // The agent's words name the holders and their bytes.
    for (const r of p.refusals) out.push(el("p", { class: "why" }, r.message));
  }
  $("whatif-answer").replaceChildren(...out);
}

async function place(e) {
  e.preventDefault();
  const workload = $("whatif-workload").value;
  if (!workload) return;
  const r = await fetch(`/ui/place?workload=${encodeURIComponent(workload)}`);
  const body = await r.json();
  if (r.ok) drawPlacement(body);
  else $("whatif-answer").replaceChildren(el("p", { class: "bad" }, body.message));
}

// One action, as the router's call to the agent; its answer in words.
async function act(action, workload, id) {
  const token = $("token").value.trim();
  sessionStorage.setItem("residentd-console-token", token);
  const answer = $("act-answer");
  answer.textContent = `asking the agent: ${action} ${id || workload}…`;
  answer.className = "muted";
  delete answer.dataset.status;
  const r = await fetch("/ui/act", {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` },
    body: JSON.stringify({ action, workload, id }),
  });
  const body = await r.json();
  answer.textContent = body.message;
  answer.className = r.ok ? "ok" : "bad";
  answer.dataset.status = String(r.status);
}

async function roster() {
  const r = await fetch("/ui/workloads");
  if (!r.ok) return setTimeout(roster, 2000);
  const w = await r.json();
  $("whatif-workload").replaceChildren(...w.workloads.map((name) => el("option", { value: name }, name)));
  document.body.classList.toggle("actions-on", w.actions);
  $("token-form").hidden = !w.actions;
  $("token").value = sessionStorage.getItem("residentd-console-token") || "";
  $("mode").textContent = w.actions
    ? "Actions on: start, stop, sleep and wake reach the agent as the router's calls (the agent's roles decide; its audit log records them)."
    : "Read-only: this page shows the node; it starts and stops nothing.";
  document.body.dataset.roster = "1";
}

function drawEvent(e) {
  const live = e.time_ms !== null;
  if (live && e.instance && !rows.has(e.instance) && !heard.has(e.instance)) heard.set(e.instance, performance.now());
  // An event from before the router heard it live has no time.
  const time = live ? new Date(e.time_ms).toLocaleTimeString() : "earlier";
  const item = el("li", { class: e.kind, "data-kind": e.kind, "data-revision": e.revision, "data-live": String(live) },
    el("time", {}, time), el("span", { class: "k" }, e.kind));
  if (e.kind === "REFUSED" && e.refusal) {
    item.append(`start of ${e.workload}`, el("span", { class: "why" }, e.refusal.message));
    if (e.refusal.holders.length) {
      const held = e.refusal.holders.map((h) => `${h.id} (${bytes(h.bytes)})`).join(", ");
      item.append(el("span", { class: "holders" },
        `held by ${held}${e.refusal.temporary ? " · may pass once their holds end" : ""}`));
    }
  } else if (e.kind === "POOL") {
    item.append(`${e.pool}: ${e.message}`);
  } else {
    item.append(`${e.instance} (${e.workload}) → ${e.state}`);
    if (e.message) item.append(el("span", { class: "why" }, e.message));
  }
  const feed = $("events");
  feed.prepend(item);
  while (feed.children.length > EVENTS_KEPT) feed.lastElementChild.remove();
}

function up(text) {
  $("status").textContent = text;
  $("status").classList.remove("down");
}

function down(text) {
  document.body.dataset.downs = `${document.body.dataset.downs || ""}${Math.round(performance.now())} ms: ${text}\n`;
  $("status").textContent = text;
  $("status").classList.add("down");
}

let logSource = null;

// Follows one instance's output in the logs pane (lines are numbered, so
// a reconnection's repeated tail is skipped).
function follow(id) {
  if (logSource) logSource.close();
  following = id;
  for (const b of document.querySelectorAll("#instances button[data-logs]")) {
    b.setAttribute("aria-pressed", String(b.closest("tr").dataset.id === id));
  }
  $("logs-of").textContent = `of ${id}`;
  const pane = $("logs");
  pane.replaceChildren();
  let last = 0;
  logSource = new EventSource(`/ui/logs/${encodeURIComponent(id)}`);
  logSource.addEventListener("line", (m) => {
    const l = JSON.parse(m.data);
    if (l.seq <= last) return;
    last = l.seq;
    const atEnd = pane.scrollTop + pane.clientHeight >= pane.scrollHeight - 4;
    pane.append(el("span", { class: l.stream, "data-seq": l.seq }, `${l.line}\n`));
    while (pane.childElementCount > LOG_LINES_KEPT) pane.firstElementChild.remove();
    if (atEnd) pane.scrollTop = pane.scrollHeight;
  });
  logSource.addEventListener("status", (m) => {
    pane.append(el("span", { class: "STDERR" }, `${JSON.parse(m.data).message}\n`));
    logSource.close();
  });
}

function connect() {
  const source = new EventSource("/ui/events");
  source.addEventListener("node", (m) => drawNode(JSON.parse(m.data)));
  source.addEventListener("agent", (m) => drawEvent(JSON.parse(m.data)));
  source.addEventListener("status", (m) => down(`agent out of reach: ${JSON.parse(m.data).message}`));
  source.addEventListener("error", () => down("router out of reach; reconnecting…"));
}

$("whatif").addEventListener("submit", place);
$("token-form").addEventListener("submit", (e) => e.preventDefault());
$("start").addEventListener("click", () => act("start", $("whatif-workload").value, ""));
roster();
connect();
