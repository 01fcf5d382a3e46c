"use strict";
// Re-renders the server's view model (router/dashboard/view.py) from dashboard/state.
// cell/table/cards mirror view.py's _cell/render_table/render_cards; text only, never HTML.
(function () {
  const interval = Number(document.getElementById("interval").textContent) || 1;
  const status = document.getElementById("status");
  const previous = new Map(); // "table/row/col" -> text, to flash what changed
  let polls = 0;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function cell(c, key, left) {
    const spec = typeof c === "string" ? { t: c } : c;
    const cls = [spec.c, left ? "l" : ""].filter(Boolean).join(" ");
    const td = el("td", { class: cls, title: spec.title });
    const text = String(spec.t === undefined ? "" : spec.t);
    if (spec.h) {
      td.appendChild(el("a", { href: spec.h, target: "_blank", rel: "noopener" }, text));
    } else if (spec.m !== undefined && spec.m !== null) {
      const meter = el("meter", { min: "0", max: "1" });
      meter.value = spec.m;
      td.appendChild(meter);
      td.appendChild(document.createTextNode(" " + text));
    } else {
      td.textContent = text;
    }
    const changed = previous.has(key) && previous.get(key) !== text;
    if (changed && spec.c !== "age") td.classList.add("flash"); // ages always change
    previous.set(key, text);
    return td;
  }

  function table(name, spec) {
    const t = el("table");
    const head = el("tr");
    const left = new Set(spec.left || []);
    spec.cols.forEach((c, i) => head.appendChild(el("th", { class: left.has(i) ? "l" : "" }, c)));
    t.appendChild(el("thead")).appendChild(head);
    const body = t.appendChild(el("tbody"));
    if (!spec.rows.length) {
      const tr = body.appendChild(el("tr"));
      tr.appendChild(el("td", { class: "empty", colspan: String(spec.cols.length) }, spec.empty));
    }
    for (const row of spec.rows) {
      const tr = body.appendChild(el("tr", { "data-k": row.k }));
      row.cells.forEach((c, i) => tr.appendChild(cell(c, `${name}/${row.k}/${i}`, left.has(i))));
    }
    return t;
  }

  function cards(list) {
    const out = document.createDocumentFragment();
    for (const c of list) {
      const div = el("div", { class: ("card " + (c.c || "")).trim(), id: "card-" + c.k });
      div.appendChild(el("div", { class: "l" }, c.label));
      div.appendChild(el("div", { class: "v" }, c.v));
      div.appendChild(el("div", { class: "s" }, c.sub));
      out.appendChild(div);
    }
    return out;
  }

  function render(view) {
    document.getElementById("title").textContent = view.title;
    document.getElementById("cards").replaceChildren(cards(view.cards));
    for (const [name, spec] of Object.entries(view.tables)) {
      const box = document.getElementById("t-" + name);
      if (box) box.replaceChildren(table(name, spec));
    }
  }

  async function poll() {
    try {
      const r = await fetch("dashboard/state", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const state = await r.json();
      render(state.view);
      polls += 1;
      document.body.dataset.polls = String(polls);
      status.className = "status live";
      status.textContent = "live · " + new Date(state.generated_at * 1000).toLocaleTimeString();
    } catch (err) {
      status.className = "status stale";
      status.textContent = "stale: " + err.message;
    } finally {
      setTimeout(poll, interval * 1000);
    }
  }

  poll();
})();
