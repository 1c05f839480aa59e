// The chat playground: streamed replies (SSE over fetch), Stop, settings, per-reply stats, the conversation kept in
// localStorage. Model output reaches the DOM only through renderMarkdown (textContent).
import { api, errorMessage } from "/web/api.js";
import { renderMarkdown } from "/web/markdown.js";

const $ = (id) => document.getElementById(id);
const CHAT = "pagedserve.chat";
const SETTINGS = "pagedserve.settings";
const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "ignore_eos", "json", "schema", "tools",
  "tools-json"];

let messages = [];  // [{role, content, stats?, state?}]
let controller = null;  // the reply in flight

function load() {
  try {
    messages = JSON.parse(localStorage.getItem(CHAT) || "[]");
    if (!Array.isArray(messages)) messages = [];
  } catch {
    messages = [];
  }
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
    for (const f of FIELDS) {
      const input = $(`set-${f}`);
      if (!(f in saved)) continue;
      if (input.type === "checkbox") input.checked = !!saved[f]; else input.value = saved[f];
    }
  } catch { /* defaults */ }
}

const save = () => localStorage.setItem(CHAT, JSON.stringify(messages));

function saveSettings() {
  const out = {};
  for (const f of FIELDS) {
    const input = $(`set-${f}`);
    out[f] = input.type === "checkbox" ? input.checked : input.value;
  }
  localStorage.setItem(SETTINGS, JSON.stringify(out));
  $("set-schema").hidden = !$("set-json").checked;
  $("set-tools-json").hidden = !$("set-tools").checked;
}

function statsText(s) {
  if (!s) return "";
  const parts = [];
  if (s.tokens != null) parts.push(`${s.tokens} tokens`);
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tok_s != null) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  if (s.cached != null) parts.push(`${s.cached} cached prompt tokens`);
  if (s.finish) parts.push(s.finish);
  return parts.join(" · ");
}

// One message's element; `update` re-renders it (coalesced to one render per frame while streaming)
function view(msg) {
  const article = document.createElement("article");
  article.className = `msg ${msg.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = msg.role;
  const body = document.createElement("div");
  body.className = "body";
  const foot = document.createElement("div");
  foot.className = "foot";
  const stats = document.createElement("span");
  stats.className = "stats";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "quiet small copy";
  copy.textContent = "Copy";
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(msg.content);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  foot.append(stats, copy);
  article.append(who, body, foot);
  let pending = false;
  const render = () => {
    pending = false;
    if (msg.role === "assistant") renderMarkdown(msg.content, body); else body.textContent = msg.content;
    stats.textContent = msg.error ? msg.error : statsText(msg.stats);
    stats.classList.toggle("error", !!msg.error);
    article.dataset.state = msg.state || "done";
    article.dataset.chars = String(msg.content.length);
  };
  render();
  return {
    element: article,
    update(now = false) {
      if (now) render();
      else if (!pending) {
        pending = true;
        requestAnimationFrame(render);
      }
    },
  };
}

function renderAll() {
  $("messages").replaceChildren(...messages.map((m) => view(m).element));
}

function number(id, parse = parseFloat) {
  const v = $(id).value.trim();
  return v === "" ? undefined : parse(v);
}

function requestBody() {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  const system = $("set-system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of messages) {
    if (m.role === "assistant" && m.state === "error") continue;
    body.messages.push({ role: m.role, content: m.content });
  }
  body.temperature = number("set-temperature");
  body.top_p = number("set-top_p");
  body.max_tokens = number("set-max_tokens", (v) => parseInt(v, 10));
  body.seed = number("set-seed", (v) => parseInt(v, 10));
  if ($("set-ignore_eos").checked) body.ignore_eos = true;
  if ($("set-json").checked) {
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema: JSON.parse($("set-schema").value) } };
  }
  if ($("set-tools").checked) body.tools = JSON.parse($("set-tools-json").value);
  return body;
}

// Server-sent events from a fetch body: yields each `data:` payload
async function* events(response, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
        if (data.length) yield data.join("\n");
      }
    }
  } finally {
    if (signal.aborted) reader.cancel().catch(() => {});
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("settings-error").hidden = true;
  let body;
  messages.push({ role: "user", content: text });
  try {
    body = requestBody();
  } catch (e) {
    messages.pop();
    $("settings-error").textContent = `Settings: ${e.message}`;
    $("settings-error").hidden = false;
    return;
  }
  $("prompt").value = "";
  const reply = { role: "assistant", content: "", state: "waiting", stats: null };
  messages.push(reply);
  save();
  renderAll();
  const v = view(reply);
  $("messages").lastElementChild.replaceWith(v.element);
  v.element.scrollIntoView({ block: "end" });

  controller = new AbortController();
  $("stop").disabled = false;
  $("send").disabled = true;
  const t0 = performance.now();
  let tFirst = null;
  let tokens = null;
  let cached = null;
  let finish = null;
  const calls = [];
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      const retry = r.headers.get("Retry-After");
      throw new Error(`${await errorMessage(r)}${retry ? ` (retry after ${retry} s)` : ""}`);
    }
    reply.state = "streaming";
    v.update(true);
    for await (const data of events(r, controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) {
        tokens = chunk.usage.completion_tokens;
        cached = chunk.usage.prompt_tokens_details?.cached_tokens ?? 0;
      }
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content) {
        if (tFirst === null) tFirst = performance.now();
        reply.content += delta.content;
      }
      for (const call of delta.tool_calls || []) {
        if (tFirst === null) tFirst = performance.now();
        const slot = calls[call.index] || (calls[call.index] = { name: "", arguments: "" });
        slot.name += call.function?.name || "";
        slot.arguments += call.function?.arguments || "";
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      if (calls.length) {
        reply.content = reply.content.replace(/\n*```tool_calls[\s\S]*$/, "");
        reply.content += `\n\n\`\`\`tool_calls\n${calls.map((c) => `${c.name}(${c.arguments})`).join("\n")}\n\`\`\``;
      }
      v.update();
    }
    reply.state = "done";
  } catch (e) {
    if (controller.signal.aborted) {
      reply.state = "stopped";
      finish = "stopped";
    } else {
      reply.state = "error";
      reply.error = e.message;
    }
  } finally {
    const t1 = performance.now();
    reply.stats = {
      tokens, cached, finish,
      ttft_ms: tFirst === null ? null : tFirst - t0,
      // decode speed: tokens after the first, over the time after it
      tok_s: tokens > 1 && tFirst !== null && t1 > tFirst ? (tokens - 1) / ((t1 - tFirst) / 1000) : null,
    };
    controller = null;
    $("stop").disabled = true;
    $("send").disabled = false;
    save();
    v.update(true);
  }
}

export function startChat() {
  load();
  saveSettings();
  renderAll();
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => {
    controller?.abort();
    messages = [];
    save();
    renderAll();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      send();
    }
  });
  for (const f of FIELDS) $(`set-${f}`).addEventListener("change", saveSettings);
}
