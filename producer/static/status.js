// The compactor status page: fetches the /api JSON routes every few seconds and renders them.
// No build step, no external assets. When api.token is set, the page itself is behind the token:
// the browser asks for it (HTTP Basic, any user name, the token as password) and sends the same
// credentials with these same-origin fetches, so the script never handles the token. A 401 here
// means the browser's credentials were refused; only a reload brings its prompt back.
"use strict";

const REFRESH_MS = 3000;
const ANSWER_WITHIN_MS = 10000; // a fetch not answered by then is an error (a hung API stopped the polling unsaid)
const HIDDEN_BY = { rollback: "undone by a rollback", summary: "replaced by a later summary" };
const $ = (id) => document.getElementById(id);
let previous = null; // the last overview sample, for rates
let timer = null;

// Unicode's bidirectional controls, shown as what they are: a cwd "/dl/\u202Eevil" read "/dl/live".
const BIDI = /[\u061C\u200E\u200F\u202A-\u202E\u2066-\u2069]/g;
const visible = (text) => String(text).replace(BIDI, (c) => `\u27E8U+${c.charCodeAt(0).toString(16).toUpperCase()}\u27E9`);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = visible(v);
    else if (k === "title") node.title = visible(v);
    else if (k === "style") node.style.cssText = v;  // (CSSOM: the page's policy refuses style attributes)
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function late(e) {  // a fetch the timeout aborted, named as such
  return e && e.name === "TimeoutError" ? new Error(`no answer from the API within ${ANSWER_WITHIN_MS / 1000} s`) : e;
}

async function api(path) {
  // (against the origin: a page opened as http://user:token@host/ had fetch refuse a relative path,
  // "a URL that includes credentials"; the browser still sends the credentials it was given)
  let response;
  try {
    response = await fetch(new URL(path, location.origin), { headers: { Accept: "application/json" },
                                                           cache: "no-store",
                                                           signal: AbortSignal.timeout(ANSWER_WITHIN_MS) });
  } catch (e) {
    throw late(e);
  }
  if (response.status === 401) throw new Error("token refused: reload the page to enter it again");
  const body = await response.json().catch((e) => {  // (a body cut short by the timeout is no answer either)
    if (e && e.name === "TimeoutError") throw late(e);
    return null;
  });
  if (!response.ok) {
    const message = body && body.error ? body.error.message : response.statusText;
    throw new Error(`${response.status}: ${message}`);
  }
  if (body === null) throw new Error(`${response.status}: the answer is no JSON`);  // (drawn, a TypeError)
  return body;
}

const fmt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
const pct = (part, whole) => (whole > 0 ? Math.min(100, (100 * part) / whole) : 0);
const share = (fraction) => `${Number((100 * fraction).toFixed(1))}\u00a0%`; // 0.25 -> "25 %"

function ago(value) {
  if (!value) return "";
  const t = typeof value === "number" ? value * 1000 : Date.parse(value);
  if (Number.isNaN(t)) return String(value);
  const s = Math.max(0, (Date.now() - t) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function card(label, value, alert = false, name = "") {
  return el("div", { class: "card" + (alert ? " alert" : ""), "data-card": name },
    el("div", { class: "value", text: value }), el("div", { class: "label", text: label }));
}

function fillBar(estimate, micro, llm, window) {
  const level = estimate > llm ? "llm" : estimate > micro ? "micro" : "ok";
  const fill = pct(estimate, window);
  const bar = el("div", {
    class: "bar " + level, "data-level": level, "data-fill": fill.toFixed(1),
    title: `${fmt(estimate)} of ${fmt(window)} tokens (${fill.toFixed(1)} %); ` +
           `micro at ${fmt(micro)}, LLM at ${fmt(llm)}`,
  });
  bar.append(el("div", { class: "fill", style: `width:${fill}%` }));
  bar.append(el("div", { class: "mark micro-mark", style: `left:${pct(micro, window)}%` }));
  bar.append(el("div", { class: "mark llm-mark", style: `left:${pct(llm, window)}%` }));
  return bar;
}

function rate(name, now) {
  if (!previous || now.serverTime <= previous.serverTime) return null;
  const delta = now.counters[name] - previous.counters[name];
  return (60 * Math.max(0, delta)) / (now.serverTime - previous.serverTime);
}

function perMinute(value) {
  return value === null ? "– /min" : `${value.toFixed(value < 10 ? 1 : 0)} /min`;
}

function heldCard(o) {  // names them: one whose log cannot be read has no row below
  const node = card("sessions held back", fmt(o.sessionsHeldBack), o.sessionsHeldBack > 0, "held");
  if (o.heldBack.length) {
    node.title = visible(o.heldBack.map((h) => `${h.sessionId}: ${h.error} (${ago(h.since)})`).join("\n"));
  }
  return node;
}

function renderOverview(o, sessions) {
  const c = o.counters;
  $("totals").replaceChildren(
    card("sessions", fmt(o.sessions), false, "sessions"),
    card("breakers open", (o.breakersTruncated ? "≥ " : "") + fmt(o.breakersOpen), o.breakersOpen > 0, "breakers"),
    card("jobs queued", fmt(o.queuedJobs), false, "queued"),
    card("jobs failed (kept)", fmt(o.failedJobs), o.failedJobs > 0, "failed"),
    card("stream backlog", `${fmt(o.streamBacklog)} (${o.oldestUnappliedSeconds.toFixed(1)} s)`,
         o.oldestUnappliedSeconds > 30, "backlog"),
    card("dead letters", fmt(o.deadLetters), o.deadLetters > 0, "dead"),
    heldCard(o),
    card("events ingested", `${fmt(c.eventsIngested)} · ${perMinute(rate("eventsIngested", o))}`,
         false, "events"),
    card("jobs succeeded", `${fmt(c.jobsSucceeded)} · ${perMinute(rate("jobsSucceeded", o))}`,
         false, "succeeded"),
    card("jobs failed", `${fmt(c.jobsFailed)} · ${perMinute(rate("jobsFailed", o))}`,
         c.jobsFailed > 0, "jobs-failed"),
    card("tokens released", `${fmt(c.tokensReleased)} · ${perMinute(rate("tokensReleased", o))}`,
         false, "released"),
  );
  previous = o;
  $("micro-share").textContent = share(o.thresholds.micro);
  $("llm-share").textContent = share(o.thresholds.llm);
  const rows = sessions.map((s) => {
    const href = `#/session/${encodeURIComponent(s.sessionId)}?cwd=${encodeURIComponent(s.cwd)}`;
    const last = s.lastCompaction;
    const saved = s.lastSavings;
    const failures = el("td", { class: "num" }, String(s.failures));
    if (s.breakerOpen) failures.append(" ", el("span", { class: "badge open", text: "breaker open" }));
    const pending = s.pendingJob ? `${s.pendingJob.status || "pending"} · ${s.pendingJob.jobId}` : "";
    const name = el("td", {}, el("a", { href, text: s.sessionId }));
    if (s.heldBack) {
      name.append(" ", el("span", { class: "badge open", "data-held": "",
                                    title: `${s.heldBack.error} (first failed ${ago(s.heldBack.since)})`,
                                    text: "held back" }));
    }
    name.append(el("div", { class: "muted", text: s.cwd }));
    return el("tr", { "data-session": s.sessionId },
      name,
      el("td", { class: "num", text: String(s.currentTurnId) }),
      el("td", {}, fillBar(s.promptEstimate, s.microThreshold, s.compactionThreshold, s.contextWindow)),
      el("td", { class: "num", text: `${fmt(s.promptEstimate)} / ${fmt(s.contextWindow)}` }),
      el("td", { text: last ? `${last.kind} · ${ago(last.timestamp)}` : "" }),
      el("td", { class: "num saved", text: saved ? `${fmt(saved.released)} (${fmt(saved.tokensBefore)} → ${fmt(saved.tokensAfter)})` : "" }),
      failures,
      el("td", { class: "pending", text: pending }),
    );
  });
  $("sessions").tBodies[0].replaceChildren(...rows);
  $("no-sessions").hidden = sessions.length > 0;
  // the list holds the most recently active only; one shorter than its limit left out only
  // sessions whose log is gone (the API skips them), which a larger ?limit would not list
  const unlisted = o.sessions - sessions.length;
  const cut = sessions.length >= sessionsLimit();
  $("sessions-shown").hidden = unlisted <= 0;
  $("sessions-shown").textContent = unlisted <= 0 ? ""
    : cut ? `Showing the ${fmt(sessions.length)} most recently active of ${fmt(o.sessions)} sessions ` +
      "(open the page with ?limit=N, up to 1000, to list more)."
    : `${fmt(unlisted)} more session(s) without a log are not listed.`;
}

function sessionsLimit() {  // ?limit=, else the API's default (written on the element)
  const limit = new URLSearchParams(window.location.search).get("limit");
  return Number(limit || $("sessions-shown").dataset.defaultLimit);
}

function sessionsPath() {
  const limit = new URLSearchParams(window.location.search).get("limit");
  return limit ? `/api/sessions?limit=${encodeURIComponent(limit)}` : "/api/sessions";
}

function renderSession(state, history) {
  $("session-id").textContent = history.sessionId;
  $("session-cwd").textContent = visible(history.cwd);
  $("session-state").replaceChildren(
    card("turn", fmt(state.currentTurnId)),
    card("estimate / window", `${fmt(state.promptEstimate)} / ${fmt(state.contextWindow)}`),
    el("div", { class: "card" },
      fillBar(state.promptEstimate, state.microThreshold, state.compactionThreshold, state.contextWindow),
      el("div", { class: "label", text: "context fill" })),
    card("failures", state.breakerOpen ? `${state.failures} · breaker open` : String(state.failures),
         state.breakerOpen),
    card("pending job", state.pendingJob ? (state.pendingJob.status || "pending") : "none"),
  );
  if (state.heldBack) {  // its log cannot be written: its new events wait in the stream
    $("session-state").append(card(`held back: first failed ${ago(state.heldBack.since)}`,
                                   state.heldBack.error, true, "held"));
  }
  const rows = history.compactions.slice().reverse().map((h) => el("tr", { "data-kind": h.kind },
    el("td", { text: `${h.timestamp || ""} (${ago(h.timestamp)})` }),
    el("td", { text: h.kind === "llm" ? `summary (replaces ${h.replaced})` : "micro" }),
    el("td", { text: h.kind === "micro" ? `${h.startTurnId}–${h.endTurnId}` : `≤ ${h.endTurnId}` }),
    el("td", { class: "num before", text: fmt(h.tokensBefore) }),
    el("td", { class: "num after", text: fmt(h.tokensAfter) }),
    el("td", { class: "num released", text: fmt(h.released) }),
    el("td", { class: "muted", text: h.visible ? "" : HIDDEN_BY[h.hiddenBy] || "not in the view" }),
  ));
  $("history").tBodies[0].replaceChildren(...rows);
  $("no-history").hidden = rows.length > 0;
  const ctx = history.context;
  const elided = new Map(ctx.elided.map((e) => [e.messageIndex, e]));
  $("context-summary").textContent =
    `${ctx.messages.length} messages · ${fmt(ctx.promptEstimate)} tokens · ${ctx.elided.length} outputs elided`;
  $("messages").replaceChildren(...ctx.messages.map((m, index) => {
    const cut = elided.get(index);
    const li = el("li", { class: m.role + (cut ? " elided" : "") });
    li.append(el("span", { class: "role", text: m.role + (m.name ? `:${m.name}` : "") }));
    if (cut) {
      li.append(" ", el("span", { class: "badge elided",
        text: `elided: ${fmt(cut.hiddenChars)} of ${fmt(cut.originalChars)} characters hidden` }));
    }
    li.append(el("pre", { text: m.content || "" }));
    for (const call of m.tool_calls || []) {
      li.append(el("div", { class: "muted", text: `→ ${call.function.name}(${call.function.arguments})` }));
    }
    return li;
  }));
}

function route() {
  const match = location.hash.match(/^#\/session\/([^?]+)\?cwd=(.*)$/);
  if (!match) return null;
  try {
    return { id: decodeURIComponent(match[1]), cwd: decodeURIComponent(match[2]) };
  } catch (e) {  // (a cut link: the page stayed at "loading…" for good, no refresh scheduled)
    throw new Error("this link's session or cwd is cut or mangled: open it again from the overview");
  }
}

let generation = 0;  // each refresh's; one that a newer one (a hashchange) overtook draws nothing

async function refresh() {
  const mine = ++generation;
  try {
    const session = route();
    let held = false;  // text selected when the answers came: not drawn (drawn, it was lost every 3 s)
    if (session) {
      const q = `?cwd=${encodeURIComponent(session.cwd)}`;
      const id = encodeURIComponent(session.id);
      const [state, history] = await Promise.all([api(`/api/sessions/${id}${q}`),
                                                  api(`/api/sessions/${id}/history${q}`)]);
      if (mine !== generation) return;  // (the overview, answered late, was drawn over a session's page)
      held = selecting();
      if (!held) renderSession(state, history);
    } else {
      const [o, sessions] = await Promise.all([api("/api/overview"), api(sessionsPath())]);
      if (mine !== generation) return;
      held = selecting();
      if (!held) renderOverview(o, sessions);
    }
    if (held) {
      $("updated").textContent = "not redrawn while text is selected";
      return;
    }
    $("overview-page").hidden = !!session;
    $("session-page").hidden = !session;
    $("error").hidden = true;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (mine !== generation) return;
    $("error").textContent = visible(e.message || e);
    $("error").hidden = false;
  } finally {
    if (mine === generation) schedule();
  }
}

function selecting() {  // text selected on the page shown (a hashchange draws the other page all the same)
  const selection = window.getSelection();
  return !!selection && !selection.isCollapsed && selection.toString() !== "";
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(refresh, REFRESH_MS);
}

window.addEventListener("hashchange", () => { previous = null; window.getSelection().removeAllRanges(); refresh(); });
refresh();
