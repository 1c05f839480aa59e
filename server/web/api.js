// The API key (sessionStorage: this tab only) and `api`, the page's one fetch helper.
const $ = (id) => document.getElementById(id);
const KEY = "pagedserve.key";

export const auth = {
  key: () => sessionStorage.getItem(KEY) || "",
  listeners: [],
  onChange(fn) { this.listeners.push(fn); },
  set(key) {
    if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
    this.listeners.forEach((fn) => fn());
  },
};

// fetch() with the key; a 401 asks for one (once at a time) and is returned to the caller as it is.
// A 401 for a key the user has since replaced asks nothing: the new key's own requests decide.
export async function api(path, options = {}) {
  const key = auth.key();
  const headers = { ...(options.headers || {}) };
  if (key) headers.Authorization = `Bearer ${key}`;
  const r = await fetch(path, { ...options, headers });
  if (r.status === 401 && key === auth.key()) {
    askForKey(key ? "The server refused this key." : "This server needs an API key.");
  }
  return r;
}

export async function errorMessage(r) {
  try {
    const body = await r.json();
    return body.error?.message || `HTTP ${r.status}`;
  } catch {
    return `HTTP ${r.status}`;
  }
}

export function askForKey(reason) {
  const dialog = $("key-dialog");
  $("key-button").hidden = false;
  if (dialog.open) return;
  $("key-reason").textContent = reason;
  $("key-input").value = "";
  dialog.showModal();
}

