// specdec playground: a chat page over this server's own OpenAI endpoints, in plain JavaScript (no
// build step, nothing to install). It streams /v1/chat/completions with "specdec": {"provenance":
// true}, so each chunk names the source of each of its tokens (docs/server-provenance.md): a draft
// token the target accepted ("draft") or the target's own ("target"). Every token is a
// <span class="tok" data-source="..."> that tests and users' own tools can read.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const state = { model: null, spec: { method: null, num_speculative_tokens: 0, per_request: {} },
                  messages: [], busy: false, abort: null };
  const KEY_STORE = "specdec-playground-api-key";

  // ---- talking to the server ------------------------------------------------------------------
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = $("api-key").value.trim();
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  // The server's error message (OpenAI's {"error": {"message", "param"}}), or the status line.
  async function errorText(resp) {
    const text = await resp.text();
    try {
      const e = JSON.parse(text).error;
      if (e && e.message) return `${resp.status}: ${e.message}`;
    } catch (_) { /* not JSON */ }
    return `${resp.status} ${resp.statusText}${text ? ": " + text.slice(0, 500) : ""}`;
  }

  async function loadInfo() {
    $("info-error")?.remove();
    try {
      const resp = await fetch("/v1/models", { headers: headers() });
      if (!resp.ok) throw new Error(await errorText(resp));
      const card = (await resp.json()).data[0];
      state.model = card.id;
      state.spec = card.speculative || state.spec;
      $("model-name").textContent = card.id;
      $("method-name").textContent = methodLabel(state.spec.method, state.spec.num_speculative_tokens);
      buildControls();
    } catch (e) {
      const box = errorBox(`Could not read the server's model: ${e.message}`);
      box.id = "info-error";
      $("log").prepend(box);
    }
  }

  // One streamed answer into ``view``; returns what it saw. Throws the server's message on a 4xx/5xx,
  // an error event, or a stream cut short.
  async function stream(body, view, signal) {
    const run = { text: "", stats: null, usage: null, finish: null, t0: performance.now() };
    run.tLast = run.t0;
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
                                                         body: JSON.stringify(body), signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return run;
          const msg = JSON.parse(data);
          if (msg.error) throw new Error(`${msg.error.code || msg.error.type}: ${msg.error.message}`);
          onChunk(msg, run, view);
        }
      }
    }
    throw new Error("the stream ended before the answer finished");
  }

  function onChunk(msg, run, view) {
    if (msg.usage) run.usage = msg.usage;
    for (const c of msg.choices || []) {
      const delta = c.delta || {};
      if (c.specdec) {
        for (const t of c.specdec.tokens) appendToken(view.answer, t.text, t.source);
        run.stats = c.specdec;
      } else if (delta.content) {
        appendToken(view.answer, delta.content, null);
      }
      run.text += delta.content || "";
      if (c.finish_reason) run.finish = c.finish_reason;
    }
    run.tLast = performance.now();
    view.update(run);
  }

  function appendToken(parent, text, source) {
    if (!text) return;
    if (!source) { parent.append(text); return; }
    const span = document.createElement("span");
    span.className = "tok";
    span.dataset.source = source;
    span.textContent = text;
    parent.append(span);
    const log = $("log");
    if (log.scrollHeight - log.scrollTop - log.clientHeight < 120) log.scrollTop = log.scrollHeight;
  }

  // ---- the request ----------------------------------------------------------------------------
  function numberField(id) {
    const v = $(id).value.trim();
    return v === "" ? undefined : Number(v);  // empty: the server's default; the server judges the rest
  }

  function speculative() {
    if (!state.spec.method) return undefined;
    if ($("method").value === "off") return { enabled: false };
    const out = { enabled: true };
    for (const el of document.querySelectorAll("[data-option]")) {
      const name = el.dataset.option, type = state.spec.per_request[name].type;
      if (type === "boolean") out[name] = el.checked;
      else if (el.value.trim() !== "") {
        out[name] = type === "integer" || type === "number" ? Number(el.value) : el.value;
      }
    }
    return out;
  }

  function requestBody(spec) {
    const body = { model: state.model, messages: state.messages, stream: true,
                   stream_options: { include_usage: true }, specdec: { provenance: true },
                   temperature: numberField("temperature"), max_tokens: numberField("max-tokens") };
    if (spec) body.speculative = spec;
    return body;
  }

  // ---- the page -------------------------------------------------------------------------------
  function methodLabel(method, k) {
    return method && k ? `${method} · K ${k}` : "speculation off";
  }

  function buildControls() {
    const sel = $("method"), box = $("spec-options"), spec = state.spec;
    sel.innerHTML = "";
    if (spec.method) sel.append(new Option(`${spec.method}`, spec.method));
    sel.append(new Option("off: plain decoding", "off"));
    sel.disabled = !spec.method;
    $("method-summary").textContent = spec.method ? spec.summary || "" : "This server runs no speculative decoding.";
    box.innerHTML = "";
    for (const [name, o] of Object.entries(spec.per_request || {})) {
      const label = document.createElement("label");
      label.htmlFor = `opt-${name}`;
      label.textContent = name === "num_speculative_tokens" ? "K: draft tokens per step" : name.replaceAll("_", " ");
      label.title = o.help;
      const input = document.createElement("input");
      input.id = `opt-${name}`;
      input.dataset.option = name;
      if (o.type === "boolean") { input.type = "checkbox"; input.checked = !!o.default; }
      else {
        input.type = o.type === "integer" || o.type === "number" ? "number" : "text";
        if (o.minimum != null) input.min = o.minimum;
        if (o.maximum != null) input.max = o.maximum;
        if (o.type === "integer") input.step = 1;
        input.value = o.default ?? "";
      }
      box.append(label, input);
    }
    sel.onchange = () => { box.hidden = sel.value === "off"; };
  }

  function showStats(run, method) {
    const s = run.stats;
    const tokens = s ? s.completion_tokens : (run.usage ? run.usage.completion_tokens : 0);
    const secs = (run.tLast - run.t0) / 1000;
    $("stat-tps").textContent = secs > 0 && tokens ? (tokens / secs).toFixed(1) : "–";
    $("stat-tokens").textContent = tokens || "–";
    if (!s) return;
    $("stat-tps-step").textContent = s.steps ? (s.completion_tokens / s.steps).toFixed(2) : "–";
    $("stat-acceptance").textContent = s.draft_tokens
      ? `${Math.round(100 * s.accepted_tokens / s.draft_tokens)}%` : "no drafts";
    $("stat-k").textContent = s.speculation_off ? `off: ${s.speculation_off}` : methodLabel(method, s.k);
    drawChart(s.drafted_at, s.accepted_at);
  }

  function drawChart(drafted, accepted) {
    const svg = $("accept-chart"), ns = "http://www.w3.org/2000/svg", H = 44, room = 32;
    const n = drafted.length, step = 24, W = Math.max(n * step, 120);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "xMinYMid meet");
    svg.innerHTML = "";
    const el = (tag, attrs, text) => {
      const e = document.createElementNS(ns, tag);
      for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
      if (text !== undefined) e.textContent = text;
      svg.append(e);
      return e;
    };
    if (!n) { el("text", { x: 0, y: 24 }, "no drafts yet"); return; }
    drafted.forEach((d, j) => {
      const rate = d ? accepted[j] / d : 0, x = j * step + 3, w = step - 6;
      el("rect", { class: "back", x, y: 0, width: w, height: room, rx: 2 });
      const bar = el("rect", { class: "bar", x, y: room * (1 - rate), width: w, height: room * rate, rx: 2 });
      const tip = document.createElementNS(ns, "title");
      tip.textContent = `draft position ${j + 1}: ${accepted[j]} of ${d} accepted (${Math.round(100 * rate)}%)`;
      bar.append(tip);
      el("text", { x: x + w / 2, y: H - 2, "text-anchor": "middle" }, String(j + 1));
    });
  }

  function resetStats() {
    for (const id of ["stat-tps", "stat-tps-step", "stat-acceptance", "stat-tokens", "stat-k"]) {
      $(id).textContent = "–";
    }
    $("accept-chart").innerHTML = "";
  }

  function errorBox(text) {
    const box = document.createElement("div");
    box.className = "error";
    box.setAttribute("role", "alert");
    box.textContent = text;
    return box;
  }

  function message(role, label) {
    $("empty")?.remove();
    const msg = document.createElement("div");
    msg.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = label;
    msg.append(who);
    $("log").append(msg);
    return msg;
  }

  function lane(parent, label) {
    const wrap = document.createElement("div");
    const head = document.createElement("div");
    head.className = "lane-head";
    const name = document.createElement("span");
    name.textContent = label;
    const speed = document.createElement("b");
    speed.className = "lane-tps";
    head.append(name, speed);
    const answer = document.createElement("div");
    answer.className = "answer";
    const meta = document.createElement("div");
    meta.className = "meta";
    wrap.append(head, answer, meta);
    parent.append(wrap);
    return { answer, speed, meta, update: () => {} };
  }

  async function runLane(view, spec, method, signal) {
    view.answer.classList.add("streaming");
    view.update = (run) => {
      showStats(run, method);
      const tokens = run.stats ? run.stats.completion_tokens : 0, secs = (run.tLast - run.t0) / 1000;
      run.tps = secs > 0 ? tokens / secs : 0;
      view.speed.textContent = tokens ? `${run.tps.toFixed(1)} tok/s` : "";
      if (run.stats && run.stats.steps) {
        view.meta.textContent = `${tokens} tokens in ${run.stats.steps} target steps, ${secs.toFixed(2)} s`;
      }
    };
    try {
      const run = await stream(requestBody(spec), view, signal);
      if (run.finish === "length") view.meta.textContent += " · cut at max tokens";
      return run;
    } finally {
      view.answer.classList.remove("streaming");
    }
  }

  function badge(parent, text, kind, attrs = {}) {
    const b = document.createElement("span");
    b.className = `badge ${kind}`;
    b.textContent = text;
    for (const [k, v] of Object.entries(attrs)) b.dataset[k] = v;
    parent.append(b);
    return b;
  }

  async function send() {
    const prompt = $("prompt").value;
    if (state.busy || !prompt.trim()) return;
    if (!state.model) await loadInfo();
    state.messages.push({ role: "user", content: prompt });
    const said = document.createElement("div");
    said.className = "body";
    said.textContent = prompt;
    message("user", "you").append(said);
    $("prompt").value = "";
    const race = $("race").checked, spec = speculative();
    const method = spec && spec.enabled ? state.spec.method : null;
    const label = methodLabel(method, method ? spec.num_speculative_tokens || state.spec.num_speculative_tokens : 0);
    const msg = message("assistant", race ? "race: plain decoding vs speculative decoding" : "assistant");
    setBusy(true);
    resetStats();
    try {
      let run;
      if (race) {
        const lanes = document.createElement("div");
        lanes.className = "lanes";
        msg.append(lanes);
        const plain = lane(lanes, "plain decoding (speculation off)");
        const fast = lane(lanes, `speculative decoding: ${label}`);
        const slow = await runLane(plain, state.spec.method ? { enabled: false } : undefined, null, state.abort.signal);
        run = await runLane(fast, spec, method, state.abort.signal);
        verdict(msg, slow, run);
      } else {
        run = await runLane(lane(msg, method ? label : "plain decoding"), spec, method, state.abort.signal);
      }
      state.messages.push({ role: "assistant", content: run.text });
    } catch (e) {
      if (e.name === "AbortError") {
        msg.append(errorBox("stopped"));
        state.messages.pop();
      } else {
        msg.append(errorBox(e.message || String(e)));
        state.messages.pop();  // the turn failed: the conversation goes on without it
        $("prompt").value = prompt;
      }
    } finally {
      setBusy(false);
    }
  }

  function verdict(msg, plain, spec) {
    const row = document.createElement("div");
    row.className = "verdict";
    msg.append(row);
    if (plain.tps && spec.tps) {
      const x = spec.tps / plain.tps;
      badge(row, `speculative: ${x.toFixed(2)}x the plain speed`, "", { speedup: x.toFixed(3) });
    }
    if (Number($("temperature").value) === 0) {
      const same = plain.text === spec.text;
      badge(row, same ? "✓ identical greedy output" : "✗ outputs differ", same ? "ok" : "bad",
            { identical: String(same) });
    } else {
      badge(row, "sampled (temperature > 0): outputs differ by design, from the same distribution", "",
            { identical: "n/a" });
    }
  }

  function setBusy(busy) {
    state.busy = busy;
    state.abort = busy ? new AbortController() : null;
    const b = $("send");
    b.textContent = busy ? "Stop" : "Send";
    b.classList.toggle("stop", busy);
  }

  // ---- wiring ---------------------------------------------------------------------------------
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    if (state.busy) state.abort.abort(); else send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); }
  });
  $("new-chat").addEventListener("click", () => {
    if (state.busy) state.abort.abort();
    state.messages = [];
    $("log").innerHTML = "";
    resetStats();
  });
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => { localStorage.setItem(KEY_STORE, key.value.trim()); loadInfo(); });
  loadInfo();
})();
