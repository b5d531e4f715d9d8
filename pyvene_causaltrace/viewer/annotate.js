"use strict";
// Annotations, loaded before the page's main script (which calls initNotes, restoreNotes,
// keepDraft, isPinned, togglePin, renderNotes and showAnnotate): pinned nodes, supernodes and
// edited labels, drawn in the subgraph pane and the side panel. Save sends them with
// POST api/save?name=PATH and the server writes them into the graph file, in the fields
// circuit-tracer's and Neuronpedia's viewers read: qParams.pinnedIds (a list of node ids),
// qParams.supernodes (lists [name, id, id, ...]), qParams.clickedId, linkType, sg_pos,
// pruningThreshold, and each edited label into its node's clerp (viewer/annotations.py says
// where each name and shape comes from).
// the node kinds whose label can be edited (EDITABLE in viewer/annotations.py)
const EDITABLE = new Set(["cross layer transcoder", "lorsa", "steering"]);
const LINK_TYPES = ["input", "output", "either", "both"];
const MAX_NAME = 200, MAX_LABEL = 2000;
const SG_BOX = {w: 130, h: 22, gap: 8};
const NUMBER = String.raw`-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?`;
const SG_POS = new RegExp(`^(?:${NUMBER}(?: ${NUMBER})*)?$`);  // as the server checks it
// pinned: node ids; supernodes: [name, id, ...]; edits: node id -> label not yet saved;
// loaded: the pins and supernodes as last loaded or saved; extra: qParams kept as loaded
const notes = {pinned: [], supernodes: [], edits: new Map(), checked: new Set(), loaded: "",
               extra: {linkType: "both", sg_pos: ""}};
// unsaved annotations of graphs the picker left, by name, with the version (ETag) of the file
// they were made on: they are re-applied only to that version
const drafts = new Map();
let pinnedIds = {list: null, set: new Set()};  // notes.pinned as a set, rebuilt when it changes

// Whether node id is pinned, in constant time (render asks for every node).
function isPinned(id) {
  if (pinnedIds.list !== notes.pinned) pinnedIds = {list: notes.pinned, set: new Set(notes.pinned)};
  return pinnedIds.set.has(id);
}

// element's children replaced by items, appended one by one (no spread into a call).
function fill(element, items) {
  element.replaceChildren();
  for (const item of items) element.append(item);
  return element;
}

// Whether node id can be pinned or labelled: one node's id (circuit-tracer's error ids
// 0_{layer}_{pos} can equal a layer-0 feature's; the server refuses those).
function annotatable(id) { return state.byId.has(id) && !state.ambiguous.has(id); }

function signature() { return JSON.stringify([notes.pinned, notes.supernodes]); }

function isDirty() { return notes.edits.size > 0 || signature() !== notes.loaded; }

function setStatus(id, text, kind) {
  $(id).textContent = text;
  $(id).className = "status" + (kind ? " " + kind : "");
}

function notesChanged() {
  setStatus("save-status", isDirty() ? "unsaved changes" : "", "dirty");
}

function initNotes() {
  $("save").addEventListener("click", saveNotes);
  $("pin-toggle").addEventListener("click", () => {
    if (state.selected) togglePin(state.selected);
  });
  $("label-save").addEventListener("click", setLabel);
  $("label-input").addEventListener("keydown", event => {
    if (event.key === "Enter") setLabel();
  });
  $("group").addEventListener("click", groupChecked);
  document.addEventListener("keydown", event => {
    if ((event.ctrlKey || event.metaKey) && event.key === "s") {
      event.preventDefault();
      saveNotes();
    }
  });
}

// The annotations in a graph's qParams (lists, or the comma-joined pinnedIds and JSON-string
// supernodes circuit-tracer's own Save writes), ids that are not nodes of the graph left out;
// a supernode's members are pinned.
function readNotes(q) {
  let pinnedIds = q.pinnedIds, groups = q.supernodes, dropped = 0;
  if (typeof pinnedIds === "string") pinnedIds = pinnedIds ? pinnedIds.split(",") : [];
  if (typeof groups === "string") {
    try { groups = JSON.parse(groups || "[]"); } catch { groups = []; dropped++; }
  }
  const pinned = [], supernodes = [], owned = new Set(), seen = new Set();
  for (const id of Array.isArray(pinnedIds) ? pinnedIds : []) {
    if (annotatable(id) && !seen.has(id)) { pinned.push(id); seen.add(id); } else dropped++;
  }
  for (const group of Array.isArray(groups) ? groups : []) {
    if (!Array.isArray(group) || typeof group[0] !== "string" || !group[0].trim()) {
      dropped++;
      continue;
    }
    const members = group.slice(1).filter(id => annotatable(id) && !owned.has(id));
    dropped += group.length - 1 - members.length;
    members.forEach(id => {
      owned.add(id);
      if (!seen.has(id)) { pinned.push(id); seen.add(id); }
    });
    if (members.length) supernodes.push([group[0].slice(0, MAX_NAME), ...members]);
  }
  return {pinned, supernodes, dropped};
}

// Called as a graph loads (state.version: the version fetched): its saved annotations, or the
// unsaved ones it had when the picker left it if the file is still the version they were made
// on; a draft of an older version is dropped, and the page says so (the file changed on disk:
// its node ids may mean other nodes now). Returns the saved clickedId.
function restoreNotes(graph, name) {
  const q = graph.qParams && typeof graph.qParams === "object" ? graph.qParams : {};
  const {pinned, supernodes, dropped} = readNotes(q);
  Object.assign(notes, {pinned, supernodes, edits: new Map(), checked: new Set()});
  notes.loaded = signature();
  notes.extra = {linkType: LINK_TYPES.includes(q.linkType) ? q.linkType : "both",
                 sg_pos: typeof q.sg_pos === "string" && SG_POS.test(q.sg_pos) ? q.sg_pos : ""};
  const threshold = Number(q.pruningThreshold);
  if (q.pruningThreshold !== undefined && q.pruningThreshold !== null && q.pruningThreshold !== ""
      && threshold >= 0 && threshold <= 1) setThreshold(threshold);
  let draft = drafts.get(name), stale = "";
  drafts.delete(name);
  if (draft && draft.version !== state.version) {
    stale = `${name} changed on disk since you left it: your unsaved annotations (` +
            `${draft.pinned.length} pinned, ${draft.supernodes.length} supernode(s), ` +
            `${draft.edits.size} label(s)) were made on the old version and are dropped, ` +
            "not applied to the new one";
    draft = null;
  }
  if (draft) {
    const kept = readNotes({pinnedIds: draft.pinned, supernodes: draft.supernodes});
    const edits = [...draft.edits].filter(([id]) => annotatable(id));
    Object.assign(notes, {pinned: kept.pinned, supernodes: kept.supernodes,
                          edits: new Map(edits)});
    for (const [id, text] of edits) state.byId.get(id).clerp = text;
  }
  if (stale) setStatus("note-status", stale, "error");
  else setStatus("note-status", dropped ? `${dropped} annotation id(s) in this file name no ` +
                                          "node of the graph: left out" : "", "");
  notesChanged();
  return typeof q.clickedId === "string" ? q.clickedId : "";
}

// Called before the picker loads another graph: unsaved annotations are kept for its return.
function keepDraft() {
  if (isDirty()) drafts.set(state.name, {pinned: notes.pinned, supernodes: notes.supernodes,
                                         edits: notes.edits, version: state.version});
}

function dropFromSupernodes(ids) {
  const dropped = new Set(ids);
  notes.supernodes = notes.supernodes.map(([name, ...members]) =>
    [name, ...members.filter(id => !dropped.has(id))]).filter(group => group.length > 1);
}

function togglePin(id) {
  if (isPinned(id)) {
    notes.pinned = notes.pinned.filter(x => x !== id);
    notes.checked.delete(id);
    dropFromSupernodes([id]);
  } else if (annotatable(id)) {
    notes.pinned = [...notes.pinned, id];
  } else {
    setStatus("note-status", `${id} names more than one node of this graph: it cannot be ` +
                             "pinned or labelled", "error");
    return;
  }
  notesChanged();
  render();
}

function groupChecked() {
  const ids = notes.pinned.filter(id => notes.checked.has(id));
  if (ids.length < 2) {
    setStatus("note-status", "check two pinned nodes or more to group them", "error");
    return;
  }
  const name = ($("group-name").value.trim() || label(state.byId.get(ids[0])).trim() ||
                "supernode").slice(0, MAX_NAME);
  dropFromSupernodes(ids);
  notes.supernodes = [...notes.supernodes, [name, ...ids]];
  notes.checked.clear();
  $("group-name").value = "";
  setStatus("note-status", "", "");
  notesChanged();
  renderNotes();
}

function renameSupernode(index, value) {
  const name = value.trim().slice(0, MAX_NAME);
  if (name) {
    notes.supernodes = notes.supernodes.map((group, i) =>
      i === index ? [name, ...group.slice(1)] : group);
  }
  notesChanged();
  renderNotes();
}

function ungroup(index) {
  notes.supernodes = notes.supernodes.filter((_, i) => i !== index);
  notesChanged();
  renderNotes();
}

function setLabel() {
  const node = state.byId.get(state.selected);
  if (!node || !EDITABLE.has(node.feature_type) || !annotatable(node.node_id)) return;
  node.clerp = $("label-input").value.slice(0, MAX_LABEL);
  notes.edits.set(node.node_id, node.clerp);
  notesChanged();
  render();
}

// The selected node's controls: pin or unpin; its label, for features.
function showAnnotate(node) {
  $("annotate").hidden = false;
  $("pin-toggle").textContent = isPinned(node.node_id) ? "Unpin" : "Pin";
  $("pin-toggle").hidden = !annotatable(node.node_id);
  const editable = EDITABLE.has(node.feature_type) && annotatable(node.node_id);
  $("label-editor").hidden = !editable;
  if (editable) $("label-input").value = node.clerp || "";
}

function element(tag, properties, ...children) {
  const el = Object.assign(document.createElement(tag), properties);
  for (const child of children) el.append(child);
  return el;
}

function renderNotes() {
  const owner = new Map(notes.supernodes.flatMap(([name, ...ids]) => ids.map(id => [id, name])));
  fill($("pinned"), notes.pinned.map(id => {
    const pick = element("input", {type: "checkbox", className: "pick",
                                   checked: notes.checked.has(id)});
    pick.addEventListener("change", () => {
      if (pick.checked) notes.checked.add(id); else notes.checked.delete(id);
    });
    const name = element("span", {className: "name", textContent: label(state.byId.get(id)),
                                  title: id});
    name.addEventListener("click", () => select(id));
    const unpin = element("button", {className: "unpin", textContent: "×", title: "unpin"});
    unpin.addEventListener("click", () => togglePin(id));
    const group = owner.has(id) ? element("small", {className: "group",
                                                     textContent: ` [${owner.get(id)}]`}) : "";
    const item = element("li", {}, pick, " ", name, group, " ", unpin);
    item.dataset.id = id;
    return item;
  }));
  fill($("supernodes"), notes.supernodes.map(([name, ...ids], i) => {
    const input = element("input", {className: "sn-name", value: name, size: 16,
                                    title: "rename (Enter)"});
    input.addEventListener("change", () => renameSupernode(i, input.value));
    const members = element("small", {className: "members",
      textContent: ` ${ids.length} node${ids.length === 1 ? "" : "s"}: ` +
                   ids.map(id => label(state.byId.get(id))).join("; ")});
    const button = element("button", {className: "ungroup", textContent: "ungroup"});
    button.addEventListener("click", () => ungroup(i));
    const item = element("li", {}, input, " ", button, members);
    item.dataset.index = i;
    return item;
  }));
  renderSubgraph();
}

// The subgraph pane: each supernode as one box, each other pinned node as its own, placed by
// (mean) position and layer; a link between two boxes sums the links between their members
// (links inside one supernode left out), blue when positive, red when negative; past
// MAX_DRAWN_LINKS of them, the strongest.
function renderSubgraph() {
  const svg = $("subgraph");
  svg.replaceChildren();
  const owner = new Map(), items = [];
  notes.supernodes.forEach(([name, ...ids], i) => {
    const key = `supernode-${i}`;
    ids.forEach(id => owner.set(id, key));
    items.push({key, name, members: ids.map(id => state.byId.get(id)), supernode: true});
  });
  for (const id of notes.pinned) {
    if (owner.has(id)) continue;
    owner.set(id, id);
    items.push({key: id, name: label(state.byId.get(id)), members: [state.byId.get(id)]});
  }
  svg.setAttribute("width", 0);
  svg.setAttribute("height", 0);
  if (!items.length) return;
  const weights = new Map();
  for (const link of state.links) {
    const a = owner.get(link.source), b = owner.get(link.target);
    if (a === undefined || b === undefined || a === b) continue;
    const key = JSON.stringify([a, b]);
    weights.set(key, (weights.get(key) || 0) + link.weight);
  }
  const where = placeSubgraph(items);
  let drawn = [...weights];
  if (drawn.length > MAX_DRAWN_LINKS) {  // the strongest, as in the graph pane
    drawn = drawn.sort((a, b) => Math.abs(b[1]) - Math.abs(a[1])).slice(0, MAX_DRAWN_LINKS);
  }
  svg.dataset.links = weights.size;
  svg.dataset.drawnLinks = drawn.length;
  const maxWeight = maxOf(drawn.map(([, weight]) => Math.abs(weight)), 1e-12);
  for (const [key, weight] of drawn) {
    const [a, b] = JSON.parse(key).map(k => where.get(k));
    const line = svgElement("line", {x1: a.x, y1: a.y, x2: b.x, y2: b.y,
                                     class: "sg-link " + (weight >= 0 ? "pos" : "neg"),
                                     "stroke-width": (0.5 + 3 * Math.abs(weight) / maxWeight)
                                                     .toFixed(2), "stroke-opacity": 0.7}, svg);
    line.dataset.weight = weight;
  }
  for (const item of items) {
    const p = where.get(item.key);
    const box = svgElement("g", {class: "sg-node" + (item.supernode ? " supernode" : ""),
                                 transform: `translate(${p.x - SG_BOX.w / 2},${p.y - SG_BOX.h / 2})`},
                           svg);
    box.dataset.key = item.key;
    svgElement("rect", {width: SG_BOX.w, height: SG_BOX.h, rx: 4}, box);
    const text = svgElement("text", {x: 5, y: 15}, box);
    text.textContent = item.name.length > 19 ? item.name.slice(0, 18) + "…" : item.name;
    svgElement("title", {}, box).textContent = item.name + (item.supernode ? "\n" +
      item.members.map(n => `${label(n)} (${n.node_id})`).join("\n") : ` (${item.key})`);
    if (!item.supernode) box.addEventListener("click", () => select(item.key));
  }
}

// Box centres: x by mean position over the span of positions the boxes cover, one row per
// (mean) layer row they occupy, logits on top; boxes on one row are pushed right until they no
// longer overlap.
function placeSubgraph(items) {
  const nLayers = countLayers(state.graph.nodes);
  const mean = (members, f) => members.reduce((sum, n) => sum + f(n), 0) / members.length;
  const placed = items.map(item => ({key: item.key, pos: mean(item.members, n => n.ctx_idx),
                                     row: Math.round(mean(item.members, n => row(n, nLayers)))}));
  const first = minOf(placed.map(p => p.pos), Infinity);
  const last = maxOf(placed.map(p => p.pos), -Infinity);
  const rowsUsed = [...new Set(placed.map(p => p.row))].sort((a, b) => b - a);
  const width = Math.max(400, $("subgraph-pane").clientWidth - 20);
  const colW = (width - SG_BOX.w) / (Math.floor(last - first) + 1);
  const where = new Map(), rows = new Map();
  for (const p of placed) {
    p.x = SG_BOX.w / 2 + (p.pos - first + 0.5) * colW;
    p.y = SG_BOX.h / 2 + 4 + rowsUsed.indexOf(p.row) * (SG_BOX.h + 3 * SG_BOX.gap);
    if (!rows.has(p.row)) rows.set(p.row, []);
    rows.get(p.row).push(p);
  }
  let right = 0, bottom = 0;
  for (const line of rows.values()) {
    line.sort((a, b) => a.x - b.x);
    line.forEach((p, i) => {
      if (i) p.x = Math.max(p.x, line[i - 1].x + SG_BOX.w + SG_BOX.gap);
      where.set(p.key, p);
      right = Math.max(right, p.x + SG_BOX.w / 2);
      bottom = Math.max(bottom, p.y + SG_BOX.h / 2);
    });
  }
  $("subgraph").setAttribute("width", right + 4);
  $("subgraph").setAttribute("height", bottom + 4);
  return where;
}

// Save: the annotations into the graph file (the server checks and writes them); sg_pos
// (circuit-tracer's subgraph positions, one pair per subgraph node) only while the pins and
// supernodes are the ones it was saved with.
async function saveNotes() {
  if (!state.graph) return;
  const name = state.name, pinnedSupernodes = signature();
  const qParams = {pinnedIds: notes.pinned, supernodes: notes.supernodes,
                   clickedId: state.selected || "", linkType: notes.extra.linkType,
                   sg_pos: pinnedSupernodes === notes.loaded ? notes.extra.sg_pos : "",
                   pruningThreshold: state.threshold};
  const clerps = [...notes.edits];
  setStatus("save-status", "saving…", "");
  $("save").disabled = true;
  try {
    const headers = {"Content-Type": "application/json"};
    if (state.version) headers["If-Match"] = state.version;  // refused if the file changed
    const response = await fetch("api/save?name=" + encodeURIComponent(name), {
      method: "POST", headers, body: JSON.stringify({qParams, clerps})});
    const text = await response.text();
    if (!response.ok) {  // the server's reason: {"error": "..."}
      let reason = text.trim();
      try { reason = JSON.parse(text).error || reason; } catch { /* not JSON: as it is */ }
      setStatus("save-status", "not saved: " + reason, "error");
      return;
    }
    if (name === state.name) {
      state.version = response.headers.get("ETag");
      for (const [id, label] of clerps) if (notes.edits.get(id) === label) notes.edits.delete(id);
      notes.loaded = pinnedSupernodes;
      notes.extra.sg_pos = qParams.sg_pos;
    }
    const saved = JSON.parse(text);
    setStatus("save-status", `saved: ${saved.pinned} pinned, ${saved.supernodes} supernodes, ` +
                             `${saved.labels} label(s)` + (isDirty() ? "; newer changes unsaved" : ""),
              isDirty() ? "dirty" : "");
  } catch (error) {
    setStatus("save-status", "not saved: " + error.message, "error");
  } finally {
    $("save").disabled = false;
  }
}
