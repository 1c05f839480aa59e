// The page's shell: which view shows, the key dialog. The API key and the fetch helper are in api.js.
import { startChat } from "/web/chat.js";
import { startEngineView } from "/web/engine.js";
import { api, askForKey, auth } from "/web/api.js";

const $ = (id) => document.getElementById(id);

function setupKey() {
  const dialog = $("key-dialog");
  const save = () => {
    dialog.close();
    auth.set($("key-input").value.trim());
  };
  $("key-save").addEventListener("click", save);
  $("key-input").addEventListener("keydown", (e) => { if (e.key === "Enter") save(); });
  $("key-cancel").addEventListener("click", () => dialog.close());
  $("key-button").addEventListener("click", () => askForKey("API key for this server:"));
  if (auth.key()) $("key-button").hidden = false;
}

async function loadModel() {
  const r = await api("/v1/models");
  if (r.ok) {
    const body = await r.json();
    const m = body.data[0];
    $("model").textContent = `${m.id} · context ${m.max_model_len}`;
    return m.id;
  }
  return null;
}

function show(view) {
  $("chat-view").hidden = view !== "chat";
  $("engine-view").hidden = view !== "engine";
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === view);
  document.title = view === "engine" ? "pagedserve · engine" : "pagedserve · chat";
}

function main() {
  setupKey();
  const engine = startEngineView();
  const route = () => {
    const view = location.pathname.startsWith("/dashboard") ? "engine" : "chat";
    show(view);
    engine.active(view === "engine");
  };
  for (const a of document.querySelectorAll("nav a")) {
    a.addEventListener("click", (e) => {
      e.preventDefault();
      history.pushState(null, "", a.getAttribute("href"));
      route();
    });
  }
  window.addEventListener("popstate", route);
  route();
  startChat();
  loadModel();
  auth.onChange(loadModel);
}

main();
