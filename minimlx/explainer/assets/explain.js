// minimlx explain: draws the walk from tokens to the next token. Plain JS, SVG and canvas; no requests but to
// the page's own address (live mode) or none at all (standalone: the walk is carried in `options.data`).
"use strict";

function minimlxExplain(root, options) {
  const live = options.api;
  const data = options.data || {};
  const state = { info: data.info || null, walk: data.walk || null, base: null, ablate: { heads: [], experts: [], blocks: [] },
                  layer: 0, head: 0, position: -1 };

  const el = (tag, attrs = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  };
  const shown = (t) => JSON.stringify(t).slice(1, -1);
  const fmt = (p) => p.toFixed(3);
  const post = async (path, body) => {
    const response = await fetch(path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error.message);
    return answer;
  };
  const section = (title, id) => el("section", { class: "mx-panel", "data-panel": id }, el("h2", {}, title));

  // ---- layout ----
  const title = root.dataset.title;
  root.append(el("h1", {}, "minimlx explain ", el("span", { class: "mx-model" }, title)));
  const status = el("div", { class: "mx-status", "data-status": "" });
  const form = el("form", { class: "mx-form" });
  const prompt = el("textarea", { name: "prompt", rows: "2", placeholder: "Type a prompt" });
  const chat = el("input", { type: "checkbox", name: "chat_template" });
  form.append(prompt, el("label", {}, chat, " chat template"), el("button", { type: "submit" }, "Explain"),
    el("button", { type: "button", name: "step", onclick: () => step() }, "Step (greedy)"),
    el("button", { type: "button", name: "clear", onclick: () => { state.ablate = { heads: [], experts: [], blocks: [] }; rewalk(); } }, "Clear ablations"));
  form.addEventListener("submit", (e) => { e.preventDefault(); explain(); });
  const panels = {
    tokens: section("Tokens", "tokens"), lens: section("Logit lens: what each layer would predict", "lens"),
    attention: section("Attention", "attention"), image: section("Attention to the image", "image"), blocks: section("What each block adds", "blocks"),
    adapter: section("Base against adapted", "adapter"),
    experts: section("Experts", "experts"), next: section("Next token", "next"),
    compare: section("Side by side", "compare"), ledger: section("Parameters", "ledger"),
  };
  if (live) root.append(form);
  root.append(status, ...Object.values(panels));
  const compareControls = el("div"), compareOut = el("div"), precisionOut = el("div");
  panels.compare.append(compareControls, compareOut, precisionOut);

  const say = (text, error = false) => { status.textContent = text; status.classList.toggle("mx-error", error); };
  const clear = (panel) => { while (panel.children.length > 1) panel.lastChild.remove(); };

  // ---- requests (live mode) ----
  const body = (extra = {}) => {
    const b = state.ids ? { ids: state.ids } : { prompt: prompt.value, chat_template: chat.checked };
    const a = state.ablate;
    if (a.heads.length || a.experts.length || a.blocks.length || a.patch) b.ablate = a;
    return { ...b, ...extra };
  };
  async function explain() { state.ids = null; state.base = null; await rewalk(); }
  async function rewalk() {
    say("walking…");
    try {
      const walk = await post("/api/explain", body());
      if (!state.base || !anyAblation()) state.base = walk;
      state.ids = walk.ids; state.walk = walk; await draw();
      say(walk.note || `${walk.tokens.length} tokens` + (anyAblation() ? ` · ablated: ${describe()}` : ""));
      root.dataset.ready = String(Number(root.dataset.ready || 0) + 1);
    } catch (e) { say(e.message, true); }
  }
  async function step() {
    if (!state.walk) return;
    state.ids = [...state.walk.ids, state.walk.next[0].id];
    state.position = -1;
    await rewalk();
  }
  const anyAblation = () => { const a = state.ablate; return a.heads.length + a.experts.length + a.blocks.length > 0 || !!a.patch; };
  const describe = () => { const a = state.ablate; return [...a.heads.map(([l, h]) => `head ${l}.${h}`), ...a.experts.map(([l, e]) => `expert ${l}.${e}`),
    ...a.blocks.map((l) => `block ${l}`), ...(a.patch ? [`patch at block ${a.patch.layer}`] : [])].join(", "); };
  const toggle = (list, item) => { const i = list.findIndex((x) => JSON.stringify(x) === JSON.stringify(item)); if (i >= 0) list.splice(i, 1); else list.push(item); rewalk(); };

  // ---- drawing ----
  async function draw() {  // resolves once every panel is drawn, its requests (attention, sampling) answered
    const w = state.walk;
    if (state.position < 0 || state.position >= w.tokens.length) state.position = w.tokens.length - 1;
    drawTokens(w); drawLens(w); drawBlocks(w); drawAdapter(w); drawExperts(w);
    await Promise.all([drawAttention(w), drawNext(w)]);
  }

  // an image's soft tokens: one small square each (their text is the image token's, the same for all)
  const inImage = (w, i) => !!w.image && i >= w.image.start && i < w.image.stop;
  const label = (w, i) => inImage(w, i) ? "▦" : shown(w.tokens[i]);

  function drawTokens(w) {
    clear(panels.tokens);
    const row = el("div", { class: "mx-tokens" });
    w.tokens.forEach((t, i) => row.append(el("span", { class: "mx-token" + (inImage(w, i) ? " mx-image-token" : "") + (i === state.position ? " mx-selected" : ""), "data-id": w.ids[i], "data-position": i,
      title: inImage(w, i) ? `image soft token ${i - w.image.start} (id ${w.ids[i]})` : `id ${w.ids[i]}`, onclick: () => { state.position = i; draw(); } },
      label(w, i), ...(inImage(w, i) ? [] : [el("sub", {}, String(w.ids[i]))]))));
    panels.tokens.append(row);
  }

  function drawLens(w) {
    clear(panels.lens);
    const table = el("table", { class: "mx-lens" });
    const head = el("tr", {}, el("th", {}, "after"));
    w.tokens.forEach((t, i) => head.append(el("th", {}, label(w, i))));
    table.append(head);
    for (let r = w.lens.length - 1; r >= 0; r--) {
      const tr = el("tr", {}, el("th", {}, w.layers[r]));
      w.lens[r].forEach((cell, c) => {
        const p = cell.probs[0];
        const hover = cell.tokens.map((t, k) => `${shown(t)} ${fmt(cell.probs[k])}`).join("\n");
        tr.append(el("td", { "data-row": r, "data-position": c, "data-token": cell.tokens[0], "data-prob": String(p), title: hover,
          style: `background: rgba(37, 99, 235, ${p.toFixed(3)}); color: ${p > 0.55 ? "white" : "black"}` }, shown(cell.tokens[0])));
      });
      table.append(tr);
    }
    panels.lens.append(el("p", { class: "mx-note" }, "Rows: the stream read after the embedding and after each block (last on top). Each cell is the top next-token guess at that position; hover for the top 5."), el("div", { class: "mx-scroll" }, table));
  }

  function heatmap(weights, size, attrs) {
    const n = weights.length, canvas = el("canvas", { width: String(size), height: String(size), ...attrs });
    const g = canvas.getContext("2d"), cell = size / n;
    for (let i = 0; i < n; i++) for (let j = 0; j <= i; j++) {
      g.fillStyle = `rgba(220, 38, 38, ${Math.min(1, weights[i][j]).toFixed(3)})`;
      g.fillRect(j * cell, i * cell, Math.ceil(cell), Math.ceil(cell));
    }
    return canvas;
  }

  async function layerWeights(w, layer) {
    if (w.attention) return w.attention[layer];
    w.cache = w.cache || {};
    if (!w.cache[layer]) w.cache[layer] = (await post("/api/attention", { ...body(), ids: w.ids, layer })).weights;
    return w.cache[layer];
  }

  async function drawAttention(w) {
    clear(panels.attention);
    if (!w.attention && !live) { panels.attention.append(el("p", {}, "Attention maps of long prompts are computed per layer by the live page.")); drawImage(w, null); return; }
    const pick = el("select", { name: "layer", onchange: () => { state.layer = Number(pick.value); drawAttention(w); } });
    w.layers.slice(1).forEach((l, i) => pick.append(el("option", { value: String(i), ...(i === state.layer ? { selected: "" } : {}) }, `block ${l}`)));
    panels.attention.append(el("label", {}, "layer ", pick));
    const weights = await layerWeights(w, state.layer);
    drawImage(w, weights);
    if (!weights.length) { panels.attention.append(el("p", { class: "mx-recurrent" }, `Block ${state.layer} is a recurrent layer: its tokens meet in a state it carries along, not through attention, so it has no map. Its contribution is in the blocks panel.`)); return; }
    const grid = el("div", { class: "mx-heads" });
    weights.forEach((head, h) => {
      const off = state.ablate.heads.some(([l, k]) => l === state.layer && k === h);
      const small = heatmap(head, 72, { "data-layer": state.layer, "data-head": h, title: `head ${h}: click to enlarge` });
      grid.append(el("figure", { class: "mx-head" + (h === state.head ? " mx-selected" : "") + (off ? " mx-off" : ""), onclick: () => { state.head = h; drawAttention(w); } }, small, el("figcaption", {}, `head ${h}`)));
    });
    const big = heatmap(weights[state.head], 320, { class: "mx-enlarged", "data-layer": state.layer, "data-head": state.head, "data-weights": JSON.stringify(weights[state.head]) });
    const side = el("div", { class: "mx-enlarged-box" }, el("h3", {}, `block ${state.layer}, head ${state.head}: row t shows what token t reads`), big);
    if (live) side.append(el("button", { name: "ablate-head", onclick: () => toggle(state.ablate.heads, [state.layer, state.head]) }, "switch this head off / on"));
    panels.attention.append(el("div", { class: "mx-attention" }, grid, side));
  }

  // the picture, its encoder's patches (faint) and its soft tokens' grid over it, and under the
  // attention panel's layer and head the chosen token's attention to each soft token, drawn over its cell
  function drawImage(w, weights) {
    clear(panels.image);
    panels.image.hidden = !w.image;
    if (!w.image) return;
    const im = w.image, [rows, cols] = im.grid, [prow, pcol] = im.patches, p = state.position;
    const W = 360, H = Math.round((W * im.height) / im.width);
    const canvas = el("canvas", { width: String(W), height: String(H), class: "mx-image-heat", "data-grid": JSON.stringify(im.grid) });
    const g = canvas.getContext("2d");
    let note = `The picture: the model reads it as ${prow} x ${pcol} patches (faint lines), pooled into ${rows} x ${cols} soft tokens (white lines), positions ${im.start} to ${im.stop - 1} of the prompt.`;
    if (weights && weights.length) {
      const row = weights[state.head][p].slice(im.start, im.stop);
      const grid = Array.from({ length: rows }, (_, r) => row.slice(r * cols, (r + 1) * cols));
      const most = Math.max(...row, 1e-12), total = row.reduce((a, b) => a + b, 0);
      grid.forEach((line, r) => line.forEach((v, c) => {
        g.fillStyle = `rgba(220, 38, 38, ${(0.85 * v / most).toFixed(3)})`;
        g.fillRect((c * W) / cols, (r * H) / rows, W / cols, H / rows);
      }));
      Object.entries({ "data-layer": state.layer, "data-head": state.head, "data-position": p, "data-weights": JSON.stringify(grid) }).forEach(([k, v]) => canvas.setAttribute(k, String(v)));
      note += ` Red: how much position ${p} (${label(w, p)}) attends to each soft token in block ${state.layer}, head ${state.head} (pick them in the token row and the attention panel): ${(100 * total).toFixed(1)}% of its attention goes to the image, the darkest cell ${fmt(most)}.`;
    } else if (weights) {
      note += ` Block ${state.layer} is a recurrent layer: it has no attention to show.`;
    } else {
      note += " Attention over long prompts is computed per layer by the live page.";
    }
    const lines = (n, m, color, width) => {
      g.strokeStyle = color; g.lineWidth = width; g.beginPath();
      for (let r = 1; r < n; r++) { g.moveTo(0, (r * H) / n); g.lineTo(W, (r * H) / n); }
      for (let c = 1; c < m; c++) { g.moveTo((c * W) / m, 0); g.lineTo((c * W) / m, H); }
      g.stroke();
    };
    if (prow <= 128 && pcol <= 128) lines(prow, pcol, "rgba(255, 255, 255, 0.25)", 0.5);
    lines(rows, cols, "rgba(255, 255, 255, 0.9)", 1);
    const picture = el("img", { src: im.src, width: String(W), height: String(H), alt: "the image", class: "mx-image" });
    panels.image.append(el("p", { class: "mx-note" }, note), el("div", { class: "mx-image-box", style: `width: ${W}px; height: ${H}px` }, picture, canvas));
  }

  function bar(value, max, color) {
    return el("div", { class: "mx-bar", style: `width: ${Math.max(1, (100 * value) / max).toFixed(1)}%; background: ${color}` });
  }

  function drawBlocks(w) {
    clear(panels.blocks);
    const p = state.position;
    const table = el("table", { class: "mx-blocks" }, el("tr", {}, ...["block", "|attention adds|", "|FFN adds|", "|stream|", "cos to embedding", "cos to previous", ""].map((h) => el("th", {}, h))));
    const max = Math.max(...w.blocks.map((b) => Math.max(b.attn_norm[p], b.mlp_norm[p], b.resid_norm[p])));
    w.blocks.forEach((b, i) => {
      const off = state.ablate.blocks.includes(i);
      const cells = [["attn_norm", "#2563eb"], ["mlp_norm", "#16a34a"], ["resid_norm", "#6b7280"]].map(([k, color]) =>
        el("td", { "data-figure": k }, bar(b[k][p], max, color), b[k][p].toFixed(2)));
      const button = live ? el("button", { name: "ablate-block", "data-layer": i, onclick: () => toggle(state.ablate.blocks, i) }, off ? "switch on" : "switch off") : "";
      const label = b.state_norm == null ? String(i) : `${i} (recurrent; its state's norm after the text: ${b.state_norm.toFixed(2)})`;
      table.append(el("tr", { "data-layer": i, class: off ? "mx-off" : "" }, el("th", {}, label), ...cells,
        el("td", {}, b.cos_embed[p].toFixed(3)), el("td", {}, b.cos_prev[p].toFixed(3)), el("td", {}, button)));
    });
    panels.blocks.append(el("p", { class: "mx-note" }, `At position ${p} (${shown(w.tokens[p])}; click a token to pick another).`), table);
    if (live) {
      const layer = el("input", { type: "number", name: "patch-layer", min: "0", max: String(w.blocks.length - 1), value: String(Math.floor(w.blocks.length / 2)) });
      const source = el("input", { name: "patch-prompt", placeholder: "second prompt" });
      panels.blocks.append(el("form", { class: "mx-form", onsubmit: (e) => { e.preventDefault(); state.ablate.patch = source.value ? { prompt: source.value, layer: Number(layer.value) } : undefined; rewalk(); } },
        "Patch the stream leaving block ", layer, " at the last token with the second prompt's: ", source, el("button", { type: "submit", name: "patch" }, "patch")));
    }
  }

  function drawAdapter(w) {  // the base (the adapters detached) against the adapted model, on the same prompt
    clear(panels.adapter);
    panels.adapter.hidden = !w.adapter;
    if (!w.adapter) return;
    const p = state.position, a = w.adapter;
    const table = el("table", { class: "mx-blocks mx-adapter" }, el("tr", {}, ...["block", "|attention adds|: base → adapted", "|FFN adds|: base → adapted", "stream moved"].map((h) => el("th", {}, h))));
    const max = Math.max(...a.blocks.map((b) => Math.max(b.attn_before[p], b.attn_after[p], b.mlp_before[p], b.mlp_after[p])));
    a.blocks.forEach((b, i) => {
      const pair = (k, color) => el("td", { "data-figure": k, "data-before": String(b[`${k}_before`][p]), "data-after": String(b[`${k}_after`][p]) },
        el("div", {}, bar(b[`${k}_before`][p], max, "#9ca3af")), el("div", {}, bar(b[`${k}_after`][p], max, color)), `${b[`${k}_before`][p].toFixed(3)} → ${b[`${k}_after`][p].toFixed(3)}`);
      table.append(el("tr", { "data-layer": i, class: b.shift[p] > 0 ? "mx-changed" : "" }, el("th", {}, String(i)), pair("attn", "#2563eb"), pair("mlp", "#16a34a"),
        el("td", { "data-figure": "shift", "data-shift": String(b.shift[p]) }, `${(100 * b.shift[p]).toFixed(2)}%`)));
    });
    const column = (label, next, which) => el("div", { class: "mx-next", "data-model": which }, el("h3", {}, label),
      ...next.slice(0, 10).map((n) => el("div", { class: "mx-next-row", "data-token": n.token, "data-id": n.id, "data-prob": String(n.prob) },
        el("span", { class: "mx-next-token" }, shown(n.token)), el("span", { class: "mx-bar-box" }, bar(n.prob, next[0].prob, which === "base" ? "#9ca3af" : "#2563eb")), fmt(n.prob))));
    panels.adapter.append(el("p", { class: "mx-note" }, `At position ${p} (${shown(w.tokens[p])}): what each block adds without the adapter (grey) and with it, and how far the stream leaving the block moved (the norm of the difference, relative to the base's). The other panels show the adapted model.`),
      table, el("div", { class: "mx-attention" }, column("next token, base", a.next_base, "base"), column("next token, adapted", w.next, "adapted")));
  }

  function drawExperts(w) {
    clear(panels.experts);
    const routed = w.blocks.map((b, i) => [i, b.routing]).filter(([, r]) => r);
    panels.experts.hidden = routed.length === 0;
    for (const [layer, r] of routed) {
      const table = el("table", { class: "mx-experts", "data-layer": layer });
      r.experts.forEach((chosen, t) => table.append(el("tr", { "data-position": t }, el("th", {}, shown(w.tokens[t])),
        ...chosen.map((e, k) => el("td", { "data-expert": e, title: `weight ${fmt(r.weights[t][k])}` }, `${e} (${fmt(r.weights[t][k])})`)))));
      const load = el("div", { class: "mx-load" });
      const most = Math.max(...r.load, 1);
      r.load.forEach((n, e) => {
        const off = state.ablate.experts.some(([l, x]) => l === layer && x === e);
        load.append(el("div", { class: "mx-load-row" + (off ? " mx-off" : ""), "data-expert": e, "data-load": n },
          live ? el("button", { name: "ablate-expert", "data-layer": layer, "data-expert": e, onclick: () => toggle(state.ablate.experts, [layer, e]) }, `expert ${e}`) : `expert ${e}`,
          bar(n, most, "#9333ea"), String(n)));
      });
      panels.experts.append(el("h3", {}, `block ${layer}: each token's experts (weight), and each expert's load`), el("div", { class: "mx-attention" }, table, load));
    }
  }

  async function drawNext(w) {
    clear(panels.next);
    const list = el("div", { class: "mx-next" });
    const base = state.base && anyAblation() ? Object.fromEntries(state.base.next.map((n) => [n.id, n.prob])) : null;
    const most = w.next[0].prob;
    w.next.forEach((n) => list.append(el("div", { class: "mx-next-row", "data-token": n.token, "data-id": n.id, "data-prob": String(n.prob) },
      el("span", { class: "mx-next-token" }, shown(n.token)), bar(n.prob, most, "#2563eb"),
      `${fmt(n.prob)}` + (base ? ` (was ${base[n.id] !== undefined ? fmt(base[n.id]) : "< " + fmt(state.base.next.at(-1).prob)})` : ""))));
    panels.next.append(list);
    if (!live) return;
    const temperature = el("input", { type: "range", name: "temperature", min: "0", max: "2", step: "0.05", value: "1" });
    const topP = el("input", { type: "range", name: "top_p", min: "0.05", max: "1", step: "0.05", value: "1" });
    const topK = el("input", { type: "number", name: "top_k", min: "0", value: "0" });
    const kept = el("div", { class: "mx-kept", "data-kept": "" });
    const sample = async () => {
      try {
        const s = await post("/api/next", body({ ids: w.ids, temperature: Number(temperature.value), top_p: Number(topP.value), top_k: Number(topK.value) }));
        kept.replaceChildren(el("p", {}, `sampling at temperature ${temperature.value}, top-p ${topP.value}, top-k ${topK.value || "off"} keeps ${s.kept_count} tokens:`),
          ...s.kept.map((n) => el("span", { class: "mx-token", "data-token": n.token, "data-prob": String(n.prob) }, `${shown(n.token)} ${fmt(n.prob)}`)));
      } catch (e) { say(e.message, true); }
    };
    [temperature, topP, topK].forEach((c) => c.addEventListener("change", sample));
    panels.next.append(el("div", { class: "mx-form" }, el("label", {}, "temperature ", temperature), el("label", {}, "top-p ", topP), el("label", {}, "top-k ", topK)), kept);
    await sample();
  }

  // ---- side by side ----
  function drawCompare(result) {
    compareOut.replaceChildren(el("p", {}, `${shown(result.word)}: token ${shown(result.tokens[0])} at position ${result.positions[0]} of the first sentence, ${shown(result.tokens[1])} at ${result.positions[1]} of the second.`),
      lineChart(result.layers, [result.similarity], "cosine of the two hidden states", { "data-similarity": JSON.stringify(result.similarity) }));
  }

  function lineChart(labels, series, caption, attrs = {}) {
    const W = 560, H = 200, pad = 32, n = labels.length;
    const all = series.flat(), low = Math.min(0, ...all), high = Math.max(1, ...all);
    const x = (i) => pad + ((W - 2 * pad) * i) / Math.max(1, n - 1), y = (v) => H - pad - ((H - 2 * pad) * (v - low)) / (high - low);
    const ns = "http://www.w3.org/2000/svg", svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.setAttribute("class", "mx-chart");
    for (const [k, v] of Object.entries(attrs)) svg.setAttribute(k, v);
    const add = (tag, a, text) => { const node = document.createElementNS(ns, tag); for (const [k, v] of Object.entries(a)) node.setAttribute(k, v); if (text) node.textContent = text; svg.append(node); };
    add("line", { x1: pad, y1: H - pad, x2: W - pad, y2: H - pad, stroke: "#999" });
    series.forEach((values, s) => add("polyline", { fill: "none", stroke: ["#2563eb", "#dc2626"][s % 2], "stroke-width": 2, points: values.map((v, i) => `${x(i)},${y(v)}`).join(" ") }));
    [0, Math.floor((n - 1) / 2), n - 1].forEach((i) => add("text", { x: x(i), y: H - 10, "font-size": 11, "text-anchor": "middle" }, labels[i]));
    [low, high].forEach((v) => add("text", { x: 2, y: y(v) + 4, "font-size": 11 }, v.toFixed(2)));
    add("text", { x: W / 2, y: 14, "font-size": 12, "text-anchor": "middle" }, caption);
    return svg;
  }

  function compareForm() {
    const first = el("input", { name: "first", value: "I deposited the cash at the bank" });
    const second = el("input", { name: "second", value: "We had a picnic on the river bank" });
    const word = el("input", { name: "word", value: "bank", size: "8" });
    const f = el("form", { class: "mx-form", onsubmit: async (e) => { e.preventDefault(); try { drawCompare(await post("/api/compare", { first: first.value, second: second.value, word: word.value })); } catch (x) { say(x.message, true); } } },
      first, second, "word ", word, el("button", { type: "submit", name: "compare" }, "compare"));
    compareControls.replaceChildren(el("p", { class: "mx-note" }, "The same word in two contexts: its hidden state starts identical and drifts apart layer by layer."), f);
    if (state.info && state.info.second) {
      compareControls.append(el("button", { name: "precision", onclick: async () => { try {
        const d = await post("/api/precision", body());
        const last = d.cosine.map((row) => row.at(-1)), rel = d.relative_difference.map((row) => row.at(-1));
        precisionOut.replaceChildren(lineChart(d.layers, [last, rel], `${d.first} vs ${d.second}: cosine (blue) and relative difference (red) at the last token`, { "data-precision": JSON.stringify(last) }));
      } catch (x) { say(x.message, true); } } }, `compare with ${state.info.second}`));
    }
  }

  // ---- ledger ----
  function drawLedger(figures) {
    clear(panels.ledger);
    const L = figures.ledger, total = L.total;
    const W = 480, H = 220, ns = "http://www.w3.org/2000/svg", svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.setAttribute("class", "mx-treemap");
    const colors = ["#2563eb", "#16a34a", "#9333ea", "#f59e0b", "#dc2626", "#0891b2", "#6b7280"];
    let x = 0;
    Object.entries(L.components).forEach(([name, n], i) => {  // one strip per component, as wide as its share
      const width = (W * n) / total;
      const g = document.createElementNS(ns, "g"); g.setAttribute("data-component", name); g.setAttribute("data-params", n);
      const rect = document.createElementNS(ns, "rect");
      Object.entries({ x, y: 0, width, height: H, fill: colors[i % colors.length], stroke: "white" }).forEach(([k, v]) => rect.setAttribute(k, v));
      const tip = document.createElementNS(ns, "title"); tip.textContent = `${name}: ${n.toLocaleString()} parameters (${((100 * n) / total).toFixed(1)}%)`; rect.append(tip);
      g.append(rect);
      if (width > 40) { const t = document.createElementNS(ns, "text"); Object.entries({ x: x + 4, y: 16, "font-size": 11, fill: "white" }).forEach(([k, v]) => t.setAttribute(k, v)); t.textContent = name; g.append(t); }
      svg.append(g); x += width;
    });
    const count = (n) => n >= 1e12 ? `${(n / 1e12).toFixed(2)}T` : n >= 1e9 ? `${(n / 1e9).toFixed(2)}B` : `${(n / 1e6).toFixed(1)}M`;
    const shape = L.shape;
    const depth = el("table", { class: "mx-depth" }, el("tr", {}, ...["model", "params", "active", "width", "layers", "heads", "layers/128 width"].map((h) => el("th", {}, h))));
    depth.append(el("tr", { class: "mx-selected" }, ...[title, count(L.total), count(L.active), shape.d_model, shape.layers, shape.heads, ((shape.layers * 128) / shape.d_model).toFixed(2)].map((v) => el("td", {}, String(v)))));
    figures.depth.forEach((r) => depth.append(el("tr", {}, ...[r.model, count(r.params), count(r.active), r.width, r.layers, r.heads, r.layers_per_128.toFixed(2)].map((v) => el("td", {}, String(v))))));
    panels.ledger.append(el("p", {}, `${count(total)} parameters, ${count(L.active)} active per token.`),
      el("div", { class: "mx-attention" }, svg, depth));
  }

  // ---- start ----
  if (live) {
    compareForm();
    fetch("/api/info").then((r) => r.json()).then((info) => { state.info = info; chat.checked = false; chat.disabled = !info.chat_template; compareForm(); });
    fetch("/api/ledger").then((r) => r.json()).then(drawLedger);
    say("Type a prompt and press Explain.");
    root.dataset.ready = "0";
  } else {
    if (data.ledger) drawLedger(data.ledger);
    if (data.compare) drawCompare(data.compare); else panels.compare.hidden = true;
    say(state.walk.note || `${state.walk.tokens.length} tokens (a standalone page: run minimlx explain to type prompts, step and ablate)`);
    draw().then(() => { root.dataset.ready = "1"; });
  }
}
