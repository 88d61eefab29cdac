"use strict";
// The Atoll status page's one script: polls /v1/status/board every 2 s and draws it.
// Member labs and addresses come from other peers: they are only ever set as textContent or
// as attribute values, never parsed as markup (no innerHTML) and never turned into links.
(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const BOARD = "/v1/status/board";
  const POLL_MS = 2000;
  const $ = (id) => document.getElementById(id);
  let polls = 0;

  const text = (v) => (v === null || v === undefined ? "" : String(v));
  const short = (hex) => text(hex).slice(0, 12);
  const num = (x) => typeof x === "number" && Number.isFinite(x);
  const fixed = (x, digits) => (num(x) ? x.toFixed(digits) : "–");
  const megabytes = (bytes) => (num(bytes) ? (bytes / 1e6).toFixed(2) + " MB" : "–");

  function cell(row, value, cls) {
    const td = document.createElement("td");
    td.textContent = text(value);
    if (cls) td.className = cls;
    row.appendChild(td);
  }

  function fillTable(id, rows) {
    $(id).tBodies[0].replaceChildren(...rows);
  }

  function memberRow(m) {
    const tr = document.createElement("tr");
    tr.className = m.self ? "member self" : "member";
    tr.dataset.peer = text(m.peer_id);
    cell(tr, short(m.peer_id) + (m.self ? " (this node)" : ""), "mono");
    cell(tr, m.lab || "—");
    cell(tr, (Array.isArray(m.roles) ? m.roles : []).map(text).join(", "));
    const reach = m.suspect ? "refuses connections" : m.reachable ? "yes" : "no (learner only)";
    cell(tr, reach, m.suspect ? "bad" : "");
    cell(tr, m.learning ? "yes" : "stopped");
    cell(tr, m.step, "num");
    cell(tr, m.url || "—", "mono");
    return tr;
  }

  function fragmentRow(f) {
    const tr = document.createElement("tr");
    tr.className = "fragment";
    cell(tr, f.fragment, "num");
    cell(tr, f.owner_id ? short(f.owner_id) : "none", "mono");
    cell(tr, f.owner_url || "—", "mono");
    cell(tr, f.version, "num");
    cell(tr, f.owned === null || f.owned === undefined ? "" : `version ${text(f.owned)}, epoch ${text(f.epoch)}`);
    return tr;
  }

  function summary(b) {
    const t = b.totals, i = t.island, o = t.owners, c = i.contributions || {};
    const refused = Object.values(o.refused || {}).reduce((a, v) => a + v, 0);
    const items = [
      ["inner steps", i.inner_steps], ["loss", fixed(b.loss, 3)],
      ["goodput", num(i.goodput) ? (100 * i.goodput).toFixed(1) + " %" : "–"],
      ["bytes out", megabytes(t.bytes_sent)], ["bytes in", megabytes(t.bytes_received)],
      ["stalled steps", i.stalled_steps],
      ["contributions sent / accepted", `${text(c.sent)} / ${text(c.accepted)}`],
      ["merged here (late)", `${text(o.merged)} (${text(o.late)})`], ["refused here", refused],
      ["versions published here", o.versions_published],
      ["mean merge time", o.versions_published ? fixed(o.merge_seconds / o.versions_published, 3) + " s" : "–"],
    ];
    $("summary").replaceChildren(...items.map(([label, value]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = label;
      dd.textContent = text(value);
      div.append(dt, dd);
      return div;
    }));
  }

  function svg(tag, attrs, content) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (content !== undefined) node.textContent = content;
    return node;
  }

  const tick = (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toPrecision(2));

  function extent(values) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    return [lo, hi];
  }

  // series: [{name, color, points: [[x, y], ...]}], drawn as SVG polylines with their axes' ranges
  function chart(id, series) {
    const box = $(id);
    const W = Number(box.getAttribute("width")), H = Number(box.getAttribute("height"));
    const L = 52, R = 10, T = 10, B = 24;
    const all = series.flatMap((s) => s.points).filter((p) => num(p[0]) && num(p[1]));
    box.replaceChildren();
    if (all.length === 0) {
      box.appendChild(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#777" }, "no data yet"));
      return;
    }
    const [x0, x1] = extent(all.map((p) => p[0])), [y0, y1] = extent(all.map((p) => p[1]));
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    box.appendChild(svg("path", { d: `M${L},${T} V${H - B} H${W - R}`, stroke: "#999", fill: "none" }));
    box.appendChild(svg("text", { x: L - 4, y: T + 8, "text-anchor": "end", "font-size": 11 }, tick(y1)));
    box.appendChild(svg("text", { x: L - 4, y: H - B, "text-anchor": "end", "font-size": 11 }, tick(y0)));
    box.appendChild(svg("text", { x: L, y: H - 6, "font-size": 11 }, tick(x0)));
    box.appendChild(svg("text", { x: W - R, y: H - 6, "text-anchor": "end", "font-size": 11 }, tick(x1)));
    series.forEach((s, k) => {
      const pts = s.points.filter((p) => num(p[0]) && num(p[1]));
      const coords = pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      box.appendChild(svg("polyline", { class: "series", "data-series": s.name, "data-points": pts.length,
                                        points: coords, stroke: s.color, "stroke-width": 1.5, fill: "none" }));
      box.appendChild(svg("text", { x: L + 8, y: T + 10 + 13 * k, fill: s.color, "font-size": 11 }, s.name));
    });
  }

  function render(b) {
    $("peer").textContent = short(b.peer_id);
    $("where").className = "muted";
    $("where").textContent = `swarm ${text(b.swarm)} · ${text(b.url)} · step ${text(b.step)} · ` +
      (b.reachable ? "reachable" : "not reachable (learner only)") + (b.learning ? "" : " · stopped learning");
    summary(b);
    fillTable("members", b.members.map(memberRow));
    $("members-count").textContent = b.members_total > b.members.length
      ? `(${b.members.length} of ${b.members_total} shown)` : `(${b.members_total})`;
    fillTable("fragments", b.fragments.map(fragmentRow));
    const rows = Array.isArray(b.history) ? b.history : [];
    const t0 = rows.length ? rows[0][0] : 0;
    const held = Array.isArray(b.validation) ? b.validation : [];
    chart("loss-chart", [
      { name: "loss", color: "#1f6fd1", points: rows.filter((r) => num(r[2])).map((r) => [r[1], r[2]]) },
      { name: "validation loss", color: "#d1561f", points: held.filter((r) => num(r[1])).map((r) => [r[0], r[1]]) },
    ]);
    chart("bytes-chart", [
      { name: "sent", color: "#d1561f", points: rows.map((r) => [r[0] - t0, r[3] / 1e6]) },
      { name: "received", color: "#2a9d4b", points: rows.map((r) => [r[0] - t0, r[4] / 1e6]) },
    ]);
    document.documentElement.dataset.polls = String(++polls);
  }

  async function poll() {
    try {
      const resp = await fetch(BOARD, { cache: "no-store" });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      render(await resp.json());
    } catch (err) {
      $("where").className = "bad";
      $("where").textContent = "cannot read this node's status: " + text(err && err.message);
    }
    setTimeout(poll, POLL_MS);
  }

  poll();
})();
