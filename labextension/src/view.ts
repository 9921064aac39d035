// The widget's DOM: header with totals, toolbar, action buttons, progress, and a virtually
// scrolled tree (only the rows in view exist in the DOM).

import { humanBytes, humanCount, percent, stateKind } from "./format";
import { CHECKED, PARTIAL, type PatchRow, Tree, type TreeJSON, type VisibleRow } from "./tree";

/** The part of anywidget's model this view uses. */
export interface WidgetModel {
  get(name: string): any;
  set(name: string, value: unknown): void;
  save_changes(): void;
  send(content: unknown): void;
  on(event: string, cb: (...args: any[]) => void): void;
  off(event?: string | null, cb?: ((...args: any[]) => void) | null): void;
}

export const ROW_HEIGHT = 26;
const MAX_VISIBLE_ROWS = 18;
const OVERSCAN = 6;

function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls = "",
  text = "",
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text) el.textContent = text;
  return el;
}

function button(label: string, cls: string, onClick: () => void): HTMLButtonElement {
  const b = h("button", `jmi-btn ${cls}`, label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

export class TreeView {
  readonly el: HTMLElement;
  tree: Tree;
  expanded: Set<number>;
  query = "";
  selected = new Set<number>();
  rows: VisibleRow[] = [];
  private checks: Uint8Array;
  private readonly disposers: Array<() => void> = [];
  private frame = 0;

  // parts
  private readonly totalsEl = h("div", "jmi-totals");
  private readonly selEl = h("div", "jmi-seltotals");
  private readonly search = h("input", "jmi-search");
  private readonly depthInput = h("input", "jmi-depth");
  private readonly actionsEl = h("div", "jmi-actions");
  private readonly progressEl = h("div", "jmi-progress");
  private readonly progressBar = h("div", "jmi-progress-fill");
  private readonly progressText = h("span", "jmi-progress-text");
  private readonly cancelBtn: HTMLButtonElement;
  private readonly messageEl = h("div", "jmi-message");
  private readonly scroller = h("div", "jmi-scroll");
  private readonly spacer = h("div", "jmi-spacer");
  private readonly rowsEl = h("div", "jmi-rows");
  private readonly countEl = h("span", "jmi-count");
  private readonly tableEl = h("div", "jmi-tablewrap");
  private readonly tableBtn: HTMLButtonElement;
  private readonly rngSel = h("select", "jmi-select");
  private readonly dtypeSel = h("select", "jmi-select");

  constructor(
    readonly model: WidgetModel,
    root: HTMLElement,
  ) {
    this.tree = new Tree(model.get("tree") as TreeJSON);
    this.expanded = this.tree.expandedToDepth(Number(model.get("expand_depth") ?? 1));
    this.selected = new Set(this.tree.nodesOf(model.get("selected") ?? []));
    this.checks = this.tree.checkStates(this.selected);
    this.el = h("div", "jmi-root");
    root.appendChild(this.el);
    this.cancelBtn = button("Cancel", "jmi-cancel", () => model.send({ action: "cancel" }));
    this.tableBtn = button("Table", "jmi-toggle", () => {
      model.set("show_table", !model.get("show_table"));
      model.save_changes();
    });
    this.build();
    this.listen("change:selected", () => {
      this.selected = new Set(this.tree.nodesOf(this.model.get("selected") ?? []));
      this.refreshChecks();
    });
    this.listen("change:selection", () => this.renderSelection());
    this.listen("change:busy change:devices change:no_cuda_reason", () => this.renderActions());
    this.listen("change:progress change:busy", () => this.renderProgress());
    this.listen("change:busy", () => this.renderRows());
    this.listen("change:error change:status", () => this.renderMessage());
    this.listen("change:show_table change:table_html", () => this.renderTable());
    this.listen("change:rng change:dtype", () => this.syncSelects());
    this.listen("change:tree", () => {
      this.tree = new Tree(this.model.get("tree") as TreeJSON);
      this.expanded = this.tree.expandedToDepth(Number(this.model.get("expand_depth") ?? 1));
      this.update();
    });
    this.listen("msg:custom", (msg: any) => {
      if (msg && msg.kind === "patch") this.applyPatch(msg.nodes as PatchRow[]);
    });
    this.update();
  }

  private listen(events: string, cb: (...args: any[]) => void): void {
    for (const ev of events.split(" ")) {
      this.model.on(ev, cb);
      this.disposers.push(() => this.model.off(ev, cb));
    }
  }

  dispose(): void {
    for (const d of this.disposers) d();
    cancelAnimationFrame(this.frame);
    this.el.remove();
  }

  // ------------------------------------------------------------------ layout
  private build(): void {
    const head = h("div", "jmi-head");
    head.append(this.totalsEl, this.selEl);

    const tools = h("div", "jmi-tools");
    this.search.type = "search";
    this.search.placeholder = "Filter by name or type…";
    this.search.setAttribute("aria-label", "Filter modules by name or type");
    this.search.addEventListener("input", () => this.setQuery(this.search.value));
    this.depthInput.type = "number";
    this.depthInput.min = "0";
    this.depthInput.max = "64";
    this.depthInput.value = String(Math.max(1, Number(this.model.get("expand_depth") ?? 1)));
    this.depthInput.title = "Depth to expand to";
    const expandBtn = button("Expand to depth", "jmi-expand", () =>
      this.expandToDepth(Number(this.depthInput.value) || 0),
    );
    const collapseBtn = button("Collapse all", "jmi-collapse", () => this.collapseAll());
    tools.append(this.search, expandBtn, this.depthInput, collapseBtn, this.countEl, this.tableBtn);

    for (const [v, label] of [
      ["exact", "RNG: exact"],
      ["fast", "RNG: fast"],
    ]) {
      const o = h("option", "", label);
      o.value = v;
      this.rngSel.append(o);
    }
    this.rngSel.title =
      "exact: bit-identical to building the model eagerly; fast: independent random streams, parallel";
    this.rngSel.addEventListener("change", () => {
      this.model.set("rng", this.rngSel.value);
      this.model.save_changes();
    });
    for (const [v, label] of [
      ["", "dtype: as built"],
      ["float32", "dtype: float32"],
      ["bfloat16", "dtype: bfloat16"],
      ["float16", "dtype: float16"],
    ]) {
      const o = h("option", "", label);
      o.value = v;
      this.dtypeSel.append(o);
    }
    this.dtypeSel.title = "Floating-point dtype to materialize as";
    this.dtypeSel.addEventListener("change", () => {
      this.model.set("dtype", this.dtypeSel.value);
      this.model.save_changes();
    });

    const track = h("div", "jmi-progress-track");
    track.append(this.progressBar);
    this.progressEl.append(track, this.progressText, this.cancelBtn);

    const colhead = h("div", "jmi-row jmi-colhead");
    for (const [t, c] of [
      ["", "jmi-c-check"],
      ["Module", "jmi-c-name"],
      ["Type", "jmi-c-type"],
      ["Params", "jmi-c-num"],
      ["Size", "jmi-c-num"],
      ["State", "jmi-c-state"],
      ["Share", "jmi-c-share"],
    ]) {
      colhead.append(h("div", c, t));
    }

    this.scroller.append(this.spacer);
    this.spacer.append(this.rowsEl);
    this.scroller.addEventListener("scroll", () => this.scheduleRows());
    this.rowsEl.addEventListener("click", (ev) => this.onRowClick(ev));

    this.el.append(
      head,
      tools,
      this.actionsEl,
      this.progressEl,
      this.messageEl,
      colhead,
      this.scroller,
      this.tableEl,
    );
    this.syncSelects();
    this.renderActions();
    this.renderProgress();
    this.renderMessage();
    this.renderTable();
  }

  // ------------------------------------------------------------------ tree interactions
  setQuery(q: string): void {
    this.query = q;
    this.update();
  }

  toggleExpand(node: number): void {
    if (this.expanded.has(node)) this.expanded.delete(node);
    else this.expanded.add(node);
    this.update();
  }

  expandToDepth(depth: number): void {
    this.expanded = this.tree.expandedToDepth(depth);
    this.update();
  }

  collapseAll(): void {
    this.expanded = new Set();
    this.update();
  }

  toggleCheck(node: number): void {
    const next = this.tree.toggle(this.selected, node);
    this.selected = new Set(next);
    this.refreshChecks();
    this.model.set("selected", this.tree.namesOf(next));
    this.model.save_changes();
  }

  applyPatch(rows: PatchRow[]): void {
    this.tree.applyPatch(rows);
    this.update();
  }

  private onRowClick(ev: Event): void {
    const target = ev.target as HTMLElement;
    const rowEl = target.closest(".jmi-row") as HTMLElement | null;
    if (!rowEl || rowEl.dataset.node === undefined) return;
    const node = Number(rowEl.dataset.node);
    if (target.closest(".jmi-check")) this.toggleCheck(node);
    else if (target.closest(".jmi-caret, .jmi-name")) {
      if (this.tree.children[node].length) this.toggleExpand(node);
    }
  }

  private refreshChecks(): void {
    this.checks = this.tree.checkStates(this.selected);
    this.renderRows();
  }

  /** Recompute the visible rows and redraw what depends on them. */
  update(): void {
    this.rows = this.tree.visibleRows(this.expanded, this.query);
    const shown = Math.min(this.rows.length, MAX_VISIBLE_ROWS);
    this.scroller.style.height = `${Math.max(shown, 1) * ROW_HEIGHT}px`;
    this.spacer.style.height = `${this.rows.length * ROW_HEIGHT}px`;
    this.countEl.textContent = this.query
      ? `${this.rows.filter((r) => r.match).length} matches`
      : `${this.tree.n} modules`;
    this.renderTotals();
    this.renderRows();
  }

  private scheduleRows(): void {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.renderRows();
    });
  }

  // ------------------------------------------------------------------ rendering
  private renderTotals(): void {
    const t = this.tree;
    if (!t.n) return;
    this.totalsEl.replaceChildren(
      h("span", "jmi-label", "Model"),
      h("strong", "jmi-model-type", t.type[0]),
      h("span", "jmi-stat", `${humanCount(t.params[0])} params`),
      h("span", "jmi-stat", humanBytes(t.bytes[0])),
      badge(t.state[0]),
    );
  }

  private renderSelection(): void {
    const s = this.model.get("selection") ?? {};
    const names: string[] = this.model.get("selected") ?? [];
    const parts: HTMLElement[] = [h("span", "jmi-label", "Selection")];
    if (!names.length) {
      parts.push(h("span", "jmi-muted", "none — tick modules to select them"));
    } else {
      parts.push(
        h("span", "jmi-stat", `${names.length} subtree${names.length === 1 ? "" : "s"}`),
        h("span", "jmi-stat", `${humanCount(s.params ?? 0)} params`),
        h("span", "jmi-stat", humanBytes(s.bytes ?? 0)),
      );
      const dtype = this.model.get("dtype");
      if (dtype && s.bytes_as !== undefined && s.bytes_as !== s.bytes) {
        parts.push(h("span", "jmi-muted", `→ ${humanBytes(s.bytes_as)} as ${dtype}`));
      }
    }
    this.selEl.replaceChildren(...parts);
    this.selEl.title = names.join("\n");
    this.renderActions();
  }

  renderActions(): void {
    const busy = Boolean(this.model.get("busy"));
    const names: string[] = this.model.get("selected") ?? [];
    const s = this.model.get("selection") ?? {};
    const states: Record<string, number> = s.states ?? {};
    const anyReal = Object.keys(states).some((k) => k !== "deferred");
    const none = names.length === 0;
    const why = none ? "Select modules first (tick their checkboxes)" : "";
    const act = (action: string, device?: string) => () =>
      this.model.send({ action, device, names: this.model.get("selected") ?? [] });

    const cpu = button("Materialize → CPU", "jmi-primary jmi-mat-cpu", act("materialize", "cpu"));
    cpu.disabled = busy || none;
    cpu.title = why || "Allocate the selected subtrees on the CPU and compute their values";
    const buttons: HTMLElement[] = [cpu];
    const devices: Array<{ name: string; label: string }> = this.model.get("devices") ?? [];
    if (!devices.length) {
      const b = button("Materialize → cuda", "jmi-mat-cuda", () => undefined);
      b.disabled = true;
      b.title = this.model.get("no_cuda_reason") || "No CUDA device is visible to this kernel.";
      buttons.push(b);
    }
    for (const d of devices) {
      const b = button(`→ ${d.name}`, "jmi-mat-cuda", act("materialize", d.name));
      b.disabled = busy || none;
      b.title = why || `Materialize on ${d.name} (${d.label})`;
      buttons.push(b);
    }
    const free = button("Free", "jmi-free", act("free"));
    free.disabled = busy || none || !anyReal;
    free.title = why || (anyReal ? "Back to deferred: release the memory" : "Nothing selected is materialized");
    buttons.push(free, h("span", "jmi-sep"), this.rngSel, this.dtypeSel);
    this.rngSel.disabled = busy;
    this.dtypeSel.disabled = busy;
    this.actionsEl.replaceChildren(...buttons);
  }

  private renderProgress(): void {
    const busy: string = this.model.get("busy") ?? "";
    const [done, total] = (this.model.get("progress") as number[]) ?? [0, 0];
    this.progressEl.hidden = !busy;
    this.el.classList.toggle("jmi-busy", Boolean(busy));
    const frac = total ? Math.min(1, done / total) : 0;
    this.progressBar.style.width = `${(100 * frac).toFixed(1)}%`;
    this.progressText.textContent = busy
      ? `${busy}: ${humanBytes(done)} / ${humanBytes(total)} (${Math.round(100 * frac)}%)`
      : "";
  }

  private renderMessage(): void {
    const err: string = this.model.get("error") ?? "";
    const status: string = this.model.get("status") ?? "";
    this.messageEl.className = `jmi-message${err ? " jmi-error" : status ? " jmi-ok" : ""}`;
    this.messageEl.textContent = err || status;
    this.messageEl.hidden = !(err || status);
  }

  private renderTable(): void {
    const show = Boolean(this.model.get("show_table"));
    this.tableBtn.classList.toggle("jmi-on", show);
    this.tableBtn.title = "Show the memory table of the selection (the whole model if none)";
    this.tableEl.hidden = !show;
    // the HTML is rendered by pandas in the kernel, never from page input
    this.tableEl.innerHTML = show ? (this.model.get("table_html") ?? "") : "";
  }

  private syncSelects(): void {
    this.rngSel.value = this.model.get("rng") ?? "exact";
    this.dtypeSel.value = this.model.get("dtype") ?? "";
    this.renderSelection();
  }

  renderRows(): void {
    const top = this.scroller.scrollTop;
    const height = this.scroller.clientHeight || MAX_VISIBLE_ROWS * ROW_HEIGHT;
    const first = Math.max(0, Math.floor(top / ROW_HEIGHT) - OVERSCAN);
    const last = Math.min(this.rows.length, Math.ceil((top + height) / ROW_HEIGHT) + OVERSCAN);
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) frag.append(this.renderRow(this.rows[i], i));
    this.rowsEl.replaceChildren(frag);
  }

  private renderRow(row: VisibleRow, i: number): HTMLElement {
    const t = this.tree;
    const n = row.node;
    const el = h("div", "jmi-row");
    el.dataset.node = String(n);
    el.style.top = `${i * ROW_HEIGHT}px`;
    if (row.match) el.classList.add("jmi-match");
    const check = this.checks[n];
    if (check === CHECKED) el.classList.add("jmi-selected");

    const cbCell = h("div", "jmi-c-check");
    const cb = h("input", "jmi-check");
    cb.type = "checkbox";
    cb.checked = check === CHECKED;
    cb.indeterminate = check === PARTIAL;
    cb.disabled = Boolean(this.model.get("busy"));
    cb.setAttribute("aria-label", `Select ${t.qname[n] || "the whole model"}`);
    cbCell.append(cb);

    const nameCell = h("div", "jmi-c-name");
    nameCell.style.paddingLeft = `${row.depth * 16}px`;
    const hasKids = t.children[n].length > 0;
    const open = this.query ? hasKids && (this.expanded.has(n) || rowsHaveChild(this.rows, i)) : this.expanded.has(n);
    const caret = h("span", `jmi-caret${hasKids ? "" : " jmi-leaf"}`, hasKids ? (open ? "▾" : "▸") : "");
    const name = h("span", "jmi-name");
    const label = n === 0 ? "(model)" : t.name[n];
    appendHighlighted(name, label, row.match ? this.query : "");
    name.title = t.qname[n] || "the whole model";
    nameCell.append(caret, name);
    const rep = t.repeatedChildren(n);
    if (rep) {
      const chip = h("span", "jmi-chip", `${rep[0]} × ${rep[1]}`);
      chip.title = `${rep[0]} identical ${rep[1]} blocks`;
      nameCell.append(chip);
    }
    else if (t.repN[n] > 1 && t.repI[n] === 0 && t.children[t.parent[n]].length !== t.repN[n]) {
      nameCell.append(h("span", "jmi-chip", `×${t.repN[n]} identical`));
    }

    const typeCell = h("div", "jmi-c-type");
    appendHighlighted(typeCell, t.type[n], row.match ? this.query : "");
    if (t.info[n]) typeCell.title = `${t.type[n]}(${t.info[n]})`;

    const share = h("div", "jmi-c-share");
    const track = h("div", "jmi-bar");
    const fill = h("div", "jmi-bar-fill");
    const frac = t.totalBytes ? t.bytes[n] / t.totalBytes : 0;
    fill.style.width = `${Math.max(frac > 0 ? 1 : 0, 100 * frac).toFixed(1)}%`;
    track.append(fill);
    share.append(track, h("span", "jmi-pct", percent(t.bytes[n], t.totalBytes)));

    el.append(
      cbCell,
      nameCell,
      typeCell,
      h("div", "jmi-c-num", humanCount(t.params[n])),
      h("div", "jmi-c-num", humanBytes(t.bytes[n])),
      cellWith(badge(t.state[n]), "jmi-c-state"),
      share,
    );
    return el;
  }
}

function rowsHaveChild(rows: VisibleRow[], i: number): boolean {
  return i + 1 < rows.length && rows[i + 1].depth > rows[i].depth;
}

function cellWith(child: HTMLElement, cls: string): HTMLElement {
  const c = h("div", cls);
  c.append(child);
  return c;
}

export function badge(state: string): HTMLElement {
  const b = h("span", `jmi-badge jmi-state-${stateKind(state)}`, state || "—");
  b.title = state
    ? state === "deferred"
      ? "No memory allocated yet"
      : state === "mixed"
        ? "Partly materialized"
        : `Materialized on ${state}`
    : "Holds no parameters or buffers";
  return b;
}

function appendHighlighted(el: HTMLElement, text: string, query: string): void {
  const q = query.trim().toLowerCase();
  const at = q ? text.toLowerCase().indexOf(q) : -1;
  if (at < 0) {
    el.append(text);
    return;
  }
  el.append(text.slice(0, at), h("mark", "jmi-hl", text.slice(at, at + q.length)), text.slice(at + q.length));
}
