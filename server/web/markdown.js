// A tiny Markdown renderer that builds DOM nodes and sets only textContent: model output can never become markup.
// Fenced code blocks (an unclosed fence while streaming is code to the end), headings, lists, paragraphs, inline
// code, bold and italic. Links stay text: a model-written URL is not followed by a click.

const el = (tag, cls) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  return e;
};

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)/g;

function inline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    const [tag, cut] = m[1] ? ["code", 1] : m[2] ? ["strong", 2] : ["em", 1];
    const e = el(tag);
    e.textContent = m[0].slice(cut, -cut);
    parent.append(e);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));  // append(string) makes a text node
}

export function renderMarkdown(text, into) {
  into.replaceChildren();
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) {
      const p = el("p");
      para.forEach((line, i) => {
        if (i) p.append(el("br"));
        inline(line, p);
      });
      into.append(p);
      para = [];
    }
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      flush();
      list = null;
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const pre = el("pre");
      const c = el("code");
      if (fence[1]) c.dataset.lang = fence[1];
      c.textContent = code.join("\n");
      pre.append(c);
      into.append(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (heading) {
      flush();
      list = null;
      const h = el(`h${Math.min(6, heading[1].length + 2)}`);
      inline(heading[2], h);
      into.append(h);
    } else if (item) {
      flush();
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = el(tag);
        into.append(list);
      }
      const li = el("li");
      inline(item[2], li);
      list.append(li);
    } else if (!line.trim()) {
      flush();
      list = null;
    } else {
      list = null;
      para.push(line);
    }
  }
  flush();
}
