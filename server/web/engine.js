// The live engine view: polls GET /v1/engine/state at 4 Hz while shown and draws counters, the last step's token
// budget, the KV pool block by block (coloured by owner; hover for a sequence's block table) and its usage over time.
import { api, auth, errorMessage } from "/web/api.js";

const $ = (id) => document.getElementById(id);
const PERIOD_MS = 250;
const HISTORY = 240;  // samples: a minute at 4 Hz

const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const hue = (seqId) => (seqId * 137.508) % 360;  // golden angle: neighbours get distant colours
const fmt = (x, digits = 0) => (x == null ? "—" : Number(x).toFixed(digits));

let state = null;
let owners = [];  // block id -> [seq ids]
let highlight = null;  // seq id under the pointer
const history = [];

function set(id, text) {
  $(id).textContent = text;
}

function counters(s) {
  set("st-running", s.running);
  set("st-waiting", s.waiting);
  set("st-preempted", s.preempted);
  set("st-tps", fmt(s.tokens_per_s, 1));
  set("st-ttft", `${fmt(s.ttft_ms.p50)} / ${fmt(s.ttft_ms.p99)}`);
  set("st-tpot", `${fmt(s.tpot_ms.p50, 1)} / ${fmt(s.tpot_ms.p99, 1)}`);
  set("st-hits", s.prefix_cache.hit_rate == null ? "—" : `${(100 * s.prefix_cache.hit_rate).toFixed(1)} %`);
  set("st-spec", s.spec_decode?.acceptance_rate == null ? "off" : `${(100 * s.spec_decode.acceptance_rate).toFixed(1)} %`);
  set("st-constrained", s.constrained);
  set("st-429", s.rejected_429);
  set("st-preemptions", s.num_preemptions);
  const kv = s.kv;
  for (const k of ["free", "cached", "used", "shared"]) set(`st-${k}`, kv[k]);
  set("st-pool", `${kv.num_blocks} blocks × ${kv.block_size} tokens · ${(100 * kv.usage).toFixed(1)} % in use`);
  const step = s.step;
  if (step) {
    set("st-step", `#${step.index}: ${step.ms.toFixed(1)} ms, ${step.num_seqs} sequences, ${step.prefill_tokens} prefill + `
      + `${step.decode_tokens} decode of ${step.budget_tokens} tokens, ${step.num_admitted} admitted, `
      + `${step.num_preempted} preempted`);
    $("step-prefill").style.width = `${(100 * step.prefill_tokens) / step.budget_tokens}%`;
    $("step-decode").style.width = `${(100 * step.decode_tokens) / step.budget_tokens}%`;
  }
}

function layout(canvas, n) {
  const width = canvas.parentElement.clientWidth || 600;
  // cells as big as fit in ~240 px of height, between 3 and 16 px
  let cell = Math.floor(Math.sqrt((width * 240) / Math.max(n, 1)));
  cell = Math.max(3, Math.min(16, cell));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / cols);
  const ratio = window.devicePixelRatio || 1;
  canvas.style.width = `${cols * cell}px`;
  canvas.style.height = `${rows * cell}px`;
  canvas.width = cols * cell * ratio;
  canvas.height = rows * cell * ratio;
  return { cell, cols, ratio };
}

function drawPool() {
  const canvas = $("pool");
  const kv = state.kv;
  const { cell, cols, ratio } = layout(canvas, kv.num_blocks);
  canvas.dataset.cell = cell;
  canvas.dataset.cols = cols;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const mine = new Map(state.sequences.map((q) => [q.seq_id, q.mine]));
  const gap = cell > 5 ? 1 : 0;
  for (let b = 0; b < kv.num_blocks; b++) {
    const x = (b % cols) * cell;
    const y = Math.floor(b / cols) * cell;
    const c = kv.pool[b];
    const who = owners[b];
    let fill = css("--free");
    if (c === "c") fill = css("--cached");
    else if (who && who.length) {
      const first = who[0];
      fill = mine.get(first) ? `hsl(${hue(first)} 65% 55%)` : css("--other");
      if (highlight !== null && !who.includes(highlight)) fill = css("--dim");
    }
    ctx.fillStyle = fill;
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (c === "s") {  // shared: a dark corner mark
      ctx.fillStyle = css("--shared-mark");
      ctx.beginPath();
      ctx.moveTo(x, y);
      ctx.lineTo(x + cell - gap, y);
      ctx.lineTo(x, y + cell - gap);
      ctx.fill();
    }
  }
}

function drawHistory() {
  const canvas = $("history");
  const width = canvas.parentElement.clientWidth || 600;
  const height = 70;
  const ratio = window.devicePixelRatio || 1;
  canvas.style.width = `${width}px`;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const line = (key, color) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    history.forEach((h, i) => {
      const x = (i / (HISTORY - 1)) * width;
      const y = height - 2 - h[key] * (height - 4);
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    ctx.stroke();
  };
  line("cached", css("--cached-line"));
  line("used", css("--accent"));
}

function table() {
  const rows = state.sequences.map((q) => {
    const tr = document.createElement("tr");
    tr.dataset.seq = q.seq_id;
    const cells = [q.seq_id, q.mine ? q.request_id : "another key's", q.status, q.prompt_tokens, q.output_tokens,
      q.computed_tokens, q.cached_tokens, q.blocks.length, q.preemptions];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      if (i === 0) {
        const sw = document.createElement("i");
        sw.className = "sw";
        sw.style.background = q.mine ? `hsl(${hue(q.seq_id)} 65% 55%)` : css("--other");
        td.append(sw);
      }
      td.append(String(v));
      tr.append(td);
    });
    tr.addEventListener("mouseenter", () => { highlight = q.seq_id; drawPool(); });
    tr.addEventListener("mouseleave", () => { highlight = null; drawPool(); });
    return tr;
  });
  $("seqs").tBodies[0].replaceChildren(...rows);
}

function tooltip(event) {
  const canvas = $("pool");
  const tip = $("tip");
  if (!state) return;
  const cell = Number(canvas.dataset.cell);
  const cols = Number(canvas.dataset.cols);
  const rect = canvas.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / cell);
  const b = Math.floor((event.clientY - rect.top) / cell) * cols + col;
  if (col >= cols || b < 0 || b >= state.kv.num_blocks) {
    tip.hidden = true;
    return;
  }
  const kind = { ".": "free", c: "cached (free, keeps a prefix)", u: "used", s: "shared" }[state.kv.pool[b]];
  const lines = [`block ${b}: ${kind}`];
  for (const id of owners[b] || []) {
    const q = state.sequences.find((s) => s.seq_id === id);
    const name = q.mine ? q.request_id : "another key's request";
    lines.push(`seq ${id} (${name}): ${q.blocks.length} blocks [${q.blocks.slice(0, 64).join(" ")}`
      + `${q.blocks.length > 64 ? " …" : ""}]`);
  }
  tip.textContent = lines.join("\n");
  tip.style.left = `${event.clientX - rect.left + 12}px`;
  tip.style.top = `${event.clientY - rect.top + 12}px`;
  tip.hidden = false;
}

function clear(message) {
  state = null;
  for (const e of document.querySelectorAll("#counters .num, .legend b")) e.textContent = "—";
  $("seqs").tBodies[0].replaceChildren();
  const err = $("engine-error");
  err.textContent = message || "";
  err.hidden = !message;
}

export function startEngineView() {
  let timer = null;
  let inflight = false;
  let shown = false;
  const start = () => { if (shown && timer === null && !inflight) poll(); };
  async function poll() {
    timer = null;
    inflight = true;
    try {
      const r = await api("/v1/engine/state");
      if (!r.ok) {
        clear(r.status === 401 ? "An API key is needed to see the engine." : await errorMessage(r));
        if (r.status === 401) return;  // until a key is given (auth.onChange restarts the polls)
      } else {
        state = await r.json();
        $("engine-error").hidden = true;
        owners = Array.from({ length: state.kv.num_blocks }, () => []);
        for (const q of state.sequences) for (const b of q.blocks) owners[b].push(q.seq_id);
        history.push({ used: state.kv.usage, cached: state.kv.cached / state.kv.num_blocks });
        if (history.length > HISTORY) history.shift();
        counters(state);
        drawPool();
        drawHistory();
        table();
        document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      }
    } catch (e) {
      clear(`Cannot reach the server: ${e.message}`);
    } finally {
      inflight = false;
    }
    if (shown) timer = setTimeout(poll, PERIOD_MS);
  }
  $("pool").addEventListener("mousemove", tooltip);
  $("pool").addEventListener("mouseleave", () => { $("tip").hidden = true; });
  auth.onChange(start);
  return {
    active(on) {
      shown = on;
      start();
      if (!on && timer !== null) {
        clearTimeout(timer);
        timer = null;
      }
    },
  };
}
