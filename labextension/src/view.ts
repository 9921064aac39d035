// The widget's DOM: header with totals, toolbar, action buttons, progress, and a virtually
// scrolled tree (only the rows in view exist in the DOM).  The tree is an ARIA tree with one
// focusable row at a time (roving tabindex): arrows move and open/close, Space ticks, Enter
// opens, Home/End jump; focus follows the node across re-renders.

import { humanBytes, humanCount, percent, stateKind } from "./format";
import { deviceChip, type Plan, PlanBar, planHead, SaveBar } from "./plan";
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
/** How long a refused request's notice stays. */
export const NOTICE_MS = 5000;
/** A message the kernel has not acknowledged by then means it is busy (running a cell): the
 *  page says it waits. Only the comm's close or the kernel's restart means it is gone. */
export const ACK_TIMEOUT_MS = 1500;

/** After this long without an answer, the page no longer assumes the kernel is only busy. */
export const SILENCE_MS = 10_000;
export const SILENT_KERNEL =
  "No answer from the kernel for 10 s. It is still busy with a long cell (your action runs when it ends), or it was shut down: if the notebook shows no kernel, start one and run the cells that build the model again.";

/** What the page says when the kernel restarted or stopped: the model went with it. */
export const GONE_KERNEL =
  "The kernel was restarted or stopped, and the model went with it. Run the cells that build the model again to get a live tree.";
/** What the page says when the widget was closed while the kernel lives on. */
export const GONE_WIDGET =
  "This widget was closed in the kernel. The model is still there if a name holds it: show it again with jupyter_metainit.explore(model), no need to rebuild it.";

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
  /** The node that has (or will get) keyboard focus in the tree. */
  focusNode = 0;
  /** The kernel is gone (comm closed, kernel restarted or dead). */
  disconnected = false;
  /** A message was sent that the kernel has not answered yet for a while: it is busy. */
  waiting = false;
  private checks: Uint8Array;
  private readonly disposers: Array<() => void> = [];
  private frame = 0;
  private noticeTimer = 0;
  private silenceTimer = 0;
  /** What the unanswered action is, in words ("Free", "Materialize → cpu"). */
  private queuedLabel = "";
  private nextId = 1;
  private readonly pending = new Map<number, number>();
  /** The unanswered messages that are actions (not pings). */
  private readonly blocking = new Set<number>();
  private readonly actionButtons = new Map<string, HTMLButtonElement>();
  private readonly sepEl = h("span", "jmi-sep");
  /** Visually hidden texts the action buttons' aria-describedby point to. */
  private readonly whysEl = h("div", "jmi-sr");

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
  private readonly noticeEl = h("div", "jmi-notice");
  private readonly disconnectedEl = h("div", "jmi-disconnected");
  private readonly waitingEl = h("div", "jmi-waiting");
  private readonly fullBtn: HTMLButtonElement;
  private readonly scroller = h("div", "jmi-scroll");
  private readonly spacer = h("div", "jmi-spacer");
  private readonly rowsEl = h("div", "jmi-rows");
  private readonly countEl = h("span", "jmi-count");
  private readonly tableEl = h("div", "jmi-tablewrap");
  private readonly tableBtn: HTMLButtonElement;
  private readonly rngSel = h("select", "jmi-select");
  private readonly dtypeSel = h("select", "jmi-select");
  /** Plan… and Save…: their bars (plan.ts) and the plan's per-device bars in the header. */
  readonly planBar: PlanBar;
  readonly saveBar: SaveBar;
  private planHeadEl: HTMLElement = h("div", "jmi-planhead");

  constructor(
    readonly model: WidgetModel,
    root: HTMLElement,
  ) {
    this.tree = new Tree(model.get("tree") as TreeJSON);
    this.expanded = this.tree.expandedToDepth(Number(model.get("expand_depth") ?? 1));
    this.selected = new Set(this.tree.nodesOf(model.get("selected") ?? []));
    this.checks = this.tree.checkStates(this.selected);
    this.el = h("div", "jmi-root");
    // Keys pressed in the widget are its own: Lumino (JupyterLab, Notebook 7) skips its
    // notebook shortcuts (arrows move between cells, Space...) for targets inside this.
    this.el.setAttribute("data-lm-suppress-shortcuts", "true");
    this.el.setAttribute("data-p-suppress-shortcuts", "true");
    root.appendChild(this.el);
    this.cancelBtn = button("Cancel", "jmi-cancel", () => this.request({ action: "cancel" }));
    this.tableBtn = button("Table", "jmi-toggle", () => {
      model.set("show_table", !model.get("show_table"));
      model.save_changes();
    });
    this.fullBtn = button("All columns", "jmi-toggle jmi-full", () => {
      model.set("table_full", !model.get("table_full"));
      model.save_changes();
    });
    const host = { request: (c: Record<string, unknown>) => this.request(c), get: (k: string) => model.get(k) };
    this.planBar = new PlanBar(host);
    this.saveBar = new SaveBar(host);
    this.build();
    this.listen("change:plan", () => this.renderPlan());
    this.listen("change:selected", () => {
      this.selected = new Set(this.tree.nodesOf(this.model.get("selected") ?? []));
      this.refreshChecks();
      this.renderActions(); // the plan and save bars act on the selection
    });
    this.listen("change:selection", () => this.renderSelection());
    this.listen("change:busy change:devices change:no_cuda_reason", () => this.renderActions());
    this.listen("change:progress change:busy", () => this.renderProgress());
    this.listen("change:busy", () => this.renderRows());
    this.listen("change:error change:status", () => this.renderMessage());
    this.listen("change:notice", () => this.renderNotice());
    this.listen("change:show_table change:table_html change:table_full", () => this.renderTable());
    this.listen("change:phase", () => this.renderProgress());
    // The kernel went away: the widget manager marks every comm dead when the kernel restarts
    // or dies; a comm closed from the kernel (w.close()) ends this widget alone.
    this.listen("comm_live_update", () => this.setDisconnected(GONE_KERNEL));
    this.listen("comm:close destroy", () => this.setDisconnected(GONE_WIDGET));
    this.listen("change:rng change:dtype", () => this.syncSelects());
    this.listen("change:tree", () => {
      this.tree = new Tree(this.model.get("tree") as TreeJSON);
      this.expanded = this.tree.expandedToDepth(Number(this.model.get("expand_depth") ?? 1));
      this.update();
    });
    this.listen("msg:custom", (msg: any) => {
      if (msg && msg.kind === "patch") this.applyPatch(msg.nodes as PatchRow[]);
      if (msg && msg.kind === "ack") this.acknowledged(Number(msg.id));
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
    clearTimeout(this.noticeTimer);
    clearTimeout(this.silenceTimer);
    for (const timer of this.pending.values()) clearTimeout(timer);
    this.el.remove();
  }

  // ------------------------------------------------------------------ talking to the kernel
  /** Send an action; the kernel acknowledges every message. Silence means it is busy running
   *  a cell: the message waits in the kernel's queue and runs when the cell ends, so the page
   *  says it is waiting (and takes no second action meanwhile) until the answer comes. */
  request(content: Record<string, unknown>): void {
    if (this.disconnected) return;
    const id = this.nextId++;
    this.pending.set(
      id,
      window.setTimeout(() => this.setWaiting(true), ACK_TIMEOUT_MS),
    );
    // a ping only asks whether the kernel is there: it does not hold back the actions
    if (content.action !== "ping") {
      this.blocking.add(id);
      this.queuedLabel = actionLabel(content);
      // the last action's message is not about this one: hide it until the kernel's next
      this.messageEl.hidden = true;
    }
    this.model.send({ ...content, id });
    this.renderActions();
  }

  private acknowledged(id: number): void {
    clearTimeout(this.pending.get(id));
    this.pending.delete(id);
    this.blocking.delete(id);
    // The kernel answers: whatever was said in doubt no longer holds.
    if (this.disconnected) this.setConnected();
    if (!this.pending.size) this.setWaiting(false);
    this.renderActions();
  }

  private setWaiting(on: boolean): void {
    if (this.waiting === on) return;
    this.waiting = on;
    this.waitingEl.hidden = !on;
    const what = this.blocking.size && this.queuedLabel ? `your ${this.queuedLabel}` : "your action";
    this.waitingEl.textContent = on
      ? `Waiting for the kernel… it is busy (a cell is running); ${what} is queued and runs when it is free.`
      : "";
    clearTimeout(this.silenceTimer);
    // A shut-down kernel closes no comm and restarts nothing: it just never answers. After a
    // long silence the page says both possibilities, and what to do in each.
    if (on) {
      this.silenceTimer = window.setTimeout(() => {
        if (this.waiting) this.waitingEl.textContent = SILENT_KERNEL;
      }, SILENCE_MS);
    }
    this.renderActions();
  }

  setDisconnected(why = GONE_KERNEL): void {
    if (this.disconnected) return;
    this.disconnected = true;
    for (const timer of this.pending.values()) clearTimeout(timer);
    this.pending.clear();
    this.blocking.clear();
    this.setWaiting(false);
    this.el.classList.add("jmi-off");
    this.disconnectedEl.textContent = `Disconnected. ${why}`;
    this.disconnectedEl.hidden = false;
    this.renderActions();
    this.renderRows();
    this.renderTable();
  }

  private setConnected(): void {
    this.disconnected = false;
    this.el.classList.remove("jmi-off");
    this.disconnectedEl.hidden = true;
    this.renderActions();
    this.renderRows();
    this.renderTable();
  }

  // ------------------------------------------------------------------ layout
  private build(): void {
    const head = h("div", "jmi-head");
    this.planHeadEl.hidden = true;
    head.append(this.totalsEl, this.selEl, this.planHeadEl);

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
    this.depthInput.setAttribute("aria-label", "Depth to expand to");
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
    colhead.setAttribute("aria-hidden", "true");
    for (const [t, c] of [
      ["", "jmi-c-check"],
      ["Module", "jmi-c-name"],
      ["Type", "jmi-c-type"],
      ["Params", "jmi-c-num jmi-c-params"],
      ["Size", "jmi-c-num jmi-c-size"],
      ["State", "jmi-c-state"],
      ["Share", "jmi-c-share"],
      ["Device", "jmi-c-device"],
    ]) {
      colhead.append(h("div", c, t));
    }

    this.scroller.append(this.spacer);
    this.spacer.append(this.rowsEl);
    this.rowsEl.setAttribute("role", "tree");
    this.rowsEl.setAttribute("aria-label", "Modules of the model");
    this.rowsEl.setAttribute("aria-multiselectable", "true");
    this.scroller.addEventListener("scroll", () => this.scheduleRows());
    this.rowsEl.addEventListener("click", (ev) => this.onRowClick(ev));
    // Handled at the window, in the capture phase: notebook front ends bind keys (arrows,
    // Space, Enter) on the document in the capture phase and stop them before they reach us.
    // Every key pressed while focus is inside the widget stays in the widget: stopping it at
    // the window's capture phase (the first place any listener sees it) keeps Lumino's command
    // shortcuts (`a`, `m`, `d d`, Shift+Enter...) from running on the notebook, whether the
    // front end listens on the document in the capture or the bubble phase. Default actions
    // (typing in the filter, Tab between controls, Enter on a button) still happen.
    const onWindowKey = (ev: KeyboardEvent) => {
      if (!(ev.target instanceof Node) || !this.el.contains(ev.target)) return;
      ev.stopPropagation();
      if (ev.type !== "keydown") return;
      if (ev.key === "Escape") {
        ev.preventDefault();
        this.focusNotebook();
      } else if (this.rowsEl.contains(ev.target)) {
        this.onKey(ev);
      }
    };
    for (const type of ["keydown", "keypress", "keyup"]) {
      window.addEventListener(type, onWindowKey as EventListener, true);
      this.disposers.push(() => window.removeEventListener(type, onWindowKey as EventListener, true));
    }
    this.rowsEl.addEventListener("focusin", (ev) => {
      const rowEl = (ev.target as HTMLElement).closest(".jmi-row") as HTMLElement | null;
      if (rowEl?.dataset.node !== undefined) this.focusNode = Number(rowEl.dataset.node);
    });
    this.noticeEl.setAttribute("role", "status");
    this.noticeEl.hidden = true;
    this.messageEl.setAttribute("role", "status");
    this.disconnectedEl.setAttribute("role", "alert");
    this.disconnectedEl.hidden = true;
    this.waitingEl.setAttribute("role", "status");
    this.waitingEl.hidden = true;

    this.el.append(
      head,
      this.disconnectedEl,
      this.waitingEl,
      tools,
      this.actionsEl,
      this.planBar.el,
      this.saveBar.el,
      this.progressEl,
      this.messageEl,
      this.noticeEl,
      colhead,
      this.scroller,
      this.tableEl,
      this.whysEl,
    );
    this.syncSelects();
    this.renderPlan();
    this.renderActions();
    this.renderProgress();
    this.renderMessage();
    this.renderTable();
  }

  // ------------------------------------------------------------------ tree interactions
  setQuery(q: string): void {
    this.query = q;
    this.update();
    const first = this.rows.findIndex((r) => r.match);
    if (first >= 0) {
      this.focusNode = this.rows[first].node;
      this.scrollToRow(first);
    } else {
      this.scroller.scrollTop = 0;
    }
    this.renderRows();
  }

  /** Scroll just enough for row `i` to be in view. */
  private scrollToRow(i: number): void {
    const top = i * ROW_HEIGHT;
    const height = this.scroller.clientHeight || MAX_VISIBLE_ROWS * ROW_HEIGHT;
    if (top < this.scroller.scrollTop) this.scroller.scrollTop = top;
    else if (top + ROW_HEIGHT > this.scroller.scrollTop + height) {
      this.scroller.scrollTop = top + ROW_HEIGHT - height;
    }
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
    if (this.disconnected || this.model.get("busy")) return;
    const next = this.tree.toggle(this.selected, node);
    this.selected = new Set(next);
    this.refreshChecks();
    this.model.set("selected", this.tree.namesOf(next));
    this.model.save_changes();
    // a tick is answered by the kernel (the selection summary); ask for an acknowledgement so
    // that a kernel shut down or busy shows as such instead of the tick being dropped silently
    this.request({ action: "ping" });
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
    this.focusNode = node;
    const copy = target.closest<HTMLElement>(".jmi-copy");
    if (copy) {
      this.copyPath(node);
      return;
    }
    if (target.closest(".jmi-check")) this.toggleCheck(node);
    else if (target.closest(".jmi-caret, .jmi-name")) {
      if (this.tree.children[node].length) this.toggleExpand(node);
    }
  }

  /** Copy a row's path as code the magics take (`model.model.layers[5]`) and say so. */
  copyPath(node: number): string {
    const code = codePath(String(this.model.get("var_name") ?? "model"), this.tree.qname[node]);
    const said = (text: string) => {
      clearTimeout(this.noticeTimer);
      this.noticeEl.textContent = text;
      this.noticeEl.hidden = false;
      this.noticeTimer = window.setTimeout(() => (this.noticeEl.hidden = true), NOTICE_MS);
    };
    const clip = navigator.clipboard;
    if (!clip) said(`Path: ${code} (this page gives no clipboard access; copy it from here)`);
    else {
      clip.writeText(code).then(
        () => said(`Copied ${code}`),
        () => said(`Path: ${code} (the clipboard refused it; copy it from here)`),
      );
    }
    return code;
  }

  /** Keyboard of an ARIA tree (WAI-ARIA Authoring Practices, "Tree View"); true if the key
   *  was the tree's. `c` (or Ctrl/Cmd+C) copies the focused row's path, as its copy button. */
  onKey(ev: KeyboardEvent): boolean {
    if (!ev.altKey && (ev.key === "c" || ev.key === "C")) {
      ev.preventDefault();
      this.copyPath(this.focusNode);
      return true;
    }
    if (ev.altKey || ev.ctrlKey || ev.metaKey) return false;
    const i = this.rows.findIndex((r) => r.node === this.focusNode);
    if (i < 0) return false;
    const node = this.focusNode;
    const kids = this.tree.children[node];
    const open = this.isOpen(i);
    let next = -1;
    switch (ev.key) {
      case "ArrowDown":
        next = Math.min(this.rows.length - 1, i + 1);
        break;
      case "ArrowUp":
        next = Math.max(0, i - 1);
        break;
      case "Home":
        next = 0;
        break;
      case "End":
        next = this.rows.length - 1;
        break;
      case "ArrowRight":
        if (kids.length && !open) this.toggleExpand(node);
        else if (kids.length) next = i + 1;
        break;
      case "ArrowLeft":
        if (kids.length && open) this.toggleExpand(node);
        else if (this.tree.parent[node] >= 0) {
          next = this.rows.findIndex((r) => r.node === this.tree.parent[node]);
        }
        break;
      case " ":
        this.toggleCheck(node);
        break;
      case "Enter":
        if (kids.length) this.toggleExpand(node);
        break;
      default:
        return false;
    }
    ev.preventDefault();
    if (next >= 0 && next < this.rows.length) {
      this.focusNode = this.rows[next].node;
      this.scrollToRow(next);
    }
    this.renderRows();
    this.focusRow();
    return true;
  }

  /** Escape: hand focus back to the notebook cell holding this output (command mode), or to
   *  whatever focusable element holds the widget elsewhere. */
  focusNotebook(): void {
    const cell = this.el.closest<HTMLElement>(".jp-Cell");
    const notebook = this.el.closest<HTMLElement>(".jp-Notebook");
    (document.activeElement as HTMLElement | null)?.blur();
    for (const target of [cell, notebook]) {
      if (!target) continue;
      if (!target.hasAttribute("tabindex")) continue;
      target.focus({ preventScroll: true });
      if (document.activeElement === target) return;
    }
    notebook?.focus({ preventScroll: true });
  }

  /** Put keyboard focus on the focused node's row (it is re-created by every render). */
  private focusRow(): void {
    const el = this.rowsEl.querySelector<HTMLElement>(`[data-node="${this.focusNode}"]`);
    el?.focus({ preventScroll: true });
  }

  private isOpen(i: number): boolean {
    const n = this.rows[i].node;
    return this.query ? this.tree.children[n].length > 0 && rowsHaveChild(this.rows, i) : this.expanded.has(n);
  }

  private refreshChecks(): void {
    this.checks = this.tree.checkStates(this.selected);
    this.renderRows();
  }

  /** Recompute the visible rows and redraw what depends on them. */
  update(): void {
    this.rows = this.tree.visibleRows(this.expanded, this.query);
    if (!this.rows.some((r) => r.node === this.focusNode) && this.rows.length) {
      // the focused node was hidden (collapsed or filtered out): its nearest shown ancestor
      let a = this.focusNode;
      while (a > 0 && !this.rows.some((r) => r.node === a)) a = this.tree.parent[a];
      this.focusNode = this.rows.some((r) => r.node === a) ? a : this.rows[0].node;
    }
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
      ...(t.dtype[0] ? [dtypeTag(t.dtype[0])] : []),
      badge(t.state[0], t.target[0]),
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
        const as = h("span", "jmi-muted", `→ ${humanBytes(s.bytes_as)}`);
        as.title = `Size as ${dtype}`;
        parts.push(as);
      }
      // Fits before acting: per device, what the selection needs there against its free memory
      const fit: Record<string, { fits: boolean; need: number; free: number }> = s.fit ?? {};
      for (const [device, f] of Object.entries(fit)) {
        // by how much, in the text itself: a hover tooltip is out of reach of the keyboard
        const el = h(
          "span",
          f.fits ? "jmi-fit" : "jmi-nofit",
          f.fits ? `fits ${device}` : `too big for ${device}: ${fitAmounts(device, f)}`,
        );
        el.title = `Needs ${humanBytes(f.need)} more on ${device}; ${humanBytes(f.free)} free there now${dtype ? ` (as ${dtype})` : ""}`;
        parts.push(el);
      }
      const also: string[] = s.also ?? [];
      if (also.length) {
        const shown = also.slice(0, 3).join(", ") + (also.length > 3 ? ` and ${also.length - 3} more` : "");
        const el = h("span", "jmi-also", `also makes ${shown} real (tied)`);
        el.title = `These modules share tensors with the selection:\n${also.join("\n")}`;
        parts.push(el);
      }
    }
    this.selEl.replaceChildren(...parts);
    this.selEl.title = names.join("\n");
    this.renderActions();
  }

  /** The action buttons are made once and updated in place, so that the one with keyboard
   *  focus keeps it through every re-render (after Enter, while busy, when it ends). An
   *  unavailable action is `aria-disabled` rather than `disabled`: it stays focusable and its
   *  reason (the title) stays readable. */
  private actionButton(key: string, label: string, cls: string, onClick: () => void): HTMLButtonElement {
    let b = this.actionButtons.get(key);
    if (!b) {
      b = button(label, cls, () => {
        if (b!.getAttribute("aria-disabled") !== "true") onClick();
      });
      this.actionButtons.set(key, b);
      // what the button does, or why it is unavailable, read out when it gets focus: the
      // title alone is a hover tooltip, which keyboard and screen-reader users never see
      const why = h("span", "jmi-sr");
      why.id = `jmi-why-${viewId}-${++whyIds}`;
      this.whysEl.append(why);
      b.setAttribute("aria-describedby", why.id);
    }
    b.textContent = label;
    return b;
  }

  /** Set a button's reason: its tooltip and the text its aria-describedby points to. */
  private explain(b: HTMLButtonElement, why: string): void {
    b.title = why;
    const el = b.getAttribute("aria-describedby");
    const target = el ? this.whysEl.querySelector<HTMLElement>(`#${el}`) : null;
    if (target && target.textContent !== why) target.textContent = why;
  }

  renderActions(): void {
    // an action sent and not yet answered counts as running: no second one meanwhile
    const busy = Boolean(this.model.get("busy")) || this.disconnected || this.blocking.size > 0;
    const names: string[] = this.model.get("selected") ?? [];
    const s = this.model.get("selection") ?? {};
    const states: Record<string, number> = s.states ?? {};
    const anyReal = Object.keys(states).some((k) => k !== "deferred");
    const none = names.length === 0;
    const why = none ? "Select modules first (tick their checkboxes)" : "";
    const fit: Record<string, { fits: boolean; need: number; free: number }> = s.fit ?? {};
    const noRoom = (device: string): string => {
      const f = fit[device];
      return f && !f.fits
        ? `Does not fit: the selection ${fitAmounts(device, f)}. Select less, pick a smaller dtype or free something first.`
        : "";
    };
    const act = (action: string, device?: string) => () =>
      this.request({ action, device, names: this.model.get("selected") ?? [] });

    const cpu = this.actionButton("cpu", "Materialize → CPU", "jmi-primary jmi-mat-cpu", act("materialize", "cpu"));
    setEnabled(cpu, !(busy || none || noRoom("cpu")));
    this.explain(cpu, why || noRoom("cpu") || "Allocate the selected subtrees on the CPU and compute their values");
    const buttons: HTMLElement[] = [cpu];
    const devices: Array<{ name: string; label: string }> = this.model.get("devices") ?? [];
    if (!devices.length) {
      const b = this.actionButton("nocuda", "Materialize → cuda", "jmi-mat-cuda", () => undefined);
      setEnabled(b, false); // focusable, so that its reason reaches the keyboard
      this.explain(b, this.model.get("no_cuda_reason") || "No CUDA device is visible to this kernel.");
      buttons.push(b);
    }
    for (const d of devices) {
      const b = this.actionButton(`cuda ${d.name}`, `→ ${d.name}`, "jmi-mat-cuda", act("materialize", d.name));
      setEnabled(b, !(busy || none || noRoom(d.name)));
      this.explain(b, why || noRoom(d.name) || `Materialize on ${d.name} (${d.label})`);
      buttons.push(b);
    }
    const free = this.actionButton("free", "Free", "jmi-free", act("free"));
    setEnabled(free, !(busy || none || !anyReal));
    this.explain(free, why || (anyReal ? "Back to deferred: release the memory" : "Nothing selected is materialized"));
    const planToggle = this.barToggle("plan", "Plan…", this.planBar.el, "Plan which device each part goes to for a workload (allocates nothing)");
    const saveToggle = this.barToggle("save", "Save…", this.saveBar.el, "Write the model, or the selected subtree, as a checkpoint (safetensors or torch DCP)");
    buttons.push(free, planToggle, saveToggle, this.sepEl, this.rngSel, this.dtypeSel);
    this.planBar.render(busy);
    this.saveBar.render(busy);
    this.rngSel.disabled = busy;
    this.dtypeSel.disabled = busy;
    this.cancelBtn.disabled = this.disconnected;
    this.tableBtn.disabled = this.disconnected;
    // only touch the DOM when the set of buttons changed, so focus is never lost
    const current = [...this.actionsEl.children];
    if (current.length !== buttons.length || current.some((el, i) => el !== buttons[i])) {
      this.actionsEl.replaceChildren(...buttons);
    }
  }

  /** A button that shows or hides one of the bars (plan, save), focus moving into it. */
  private barToggle(key: string, label: string, bar: HTMLElement, why: string): HTMLButtonElement {
    const b = this.actionButton(key, label, `jmi-toggle jmi-${key}-toggle`, () => {
      bar.hidden = !bar.hidden;
      b.classList.toggle("jmi-on", !bar.hidden);
      b.setAttribute("aria-expanded", String(!bar.hidden));
      if (!bar.hidden) bar.querySelector<HTMLElement>("input, select")?.focus();
    });
    b.setAttribute("aria-expanded", String(!bar.hidden));
    setEnabled(b, !this.disconnected);
    this.explain(b, why);
    return b;
  }

  /** The plan: the per-device bars in the header, the device column, the plan bar. */
  private renderPlan(): void {
    const plan: Plan = this.model.get("plan") ?? {};
    const planned = Boolean(plan.devices?.length);
    this.el.classList.toggle("jmi-planned", planned);
    const head = planHead(plan);
    this.planHeadEl.replaceWith(head);
    this.planHeadEl = head;
    this.renderActions();
    this.renderRows();
  }

  private renderProgress(): void {
    const busy: string = this.model.get("busy") ?? "";
    const [done, total] = (this.model.get("progress") as number[]) ?? [0, 0];
    this.progressEl.hidden = !busy;
    this.el.classList.toggle("jmi-busy", Boolean(busy));
    const frac = total ? Math.min(1, done / total) : 0;
    this.progressBar.style.width = `${(100 * frac).toFixed(1)}%`;
    const phase: string = this.model.get("phase") ?? "";
    const amount = total ? `${humanBytes(done)} / ${humanBytes(total)} (${Math.round(100 * frac)}%)` : "";
    this.progressText.textContent = busy ? [`${busy}:`, amount, phase && `· ${phase}`].filter(Boolean).join(" ") : "";
  }

  private renderMessage(): void {
    const err: string = this.model.get("error") ?? "";
    const status: string = this.model.get("status") ?? "";
    this.messageEl.className = `jmi-message${err ? " jmi-error" : status ? " jmi-ok" : ""}`;
    this.messageEl.textContent = err || status;
    this.messageEl.hidden = !(err || status);
  }

  private renderNotice(): void {
    const notice = this.model.get("notice") ?? {};
    const text: string = notice.text ?? "";
    clearTimeout(this.noticeTimer);
    this.noticeEl.textContent = text;
    this.noticeEl.hidden = !text;
    if (text) this.noticeTimer = window.setTimeout(() => (this.noticeEl.hidden = true), NOTICE_MS);
  }

  private renderTable(): void {
    const show = Boolean(this.model.get("show_table"));
    this.tableBtn.classList.toggle("jmi-on", show);
    this.tableBtn.title = "Show the memory table of the selection (the whole model if none)";
    this.tableEl.hidden = !show;
    const full = Boolean(this.model.get("table_full"));
    this.fullBtn.classList.toggle("jmi-on", full);
    this.fullBtn.title = full ? "Back to the compact table" : "Show every column of the table";
    // the HTML is rendered by pandas in the kernel, never from page input
    const body = h("div", "jmi-table");
    const html: string = this.model.get("table_html") ?? "";
    body.innerHTML = show ? html : "";
    if (show && !html) {
      body.textContent = this.disconnected
        ? "No table: it is computed by the kernel, which is gone."
        : "Computing the table…";
    }
    this.tableEl.replaceChildren(...(show ? [this.fullBtn, body] : []));
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
    const hadFocus = this.rowsEl.contains(document.activeElement);
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) frag.append(this.renderRow(this.rows[i], i));
    this.rowsEl.replaceChildren(frag);
    if (hadFocus) this.focusRow();
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
    const hasKids = t.children[n].length > 0;
    const open = hasKids && this.isOpen(i);
    el.setAttribute("role", "treeitem");
    el.setAttribute("aria-level", String(row.depth + 1));
    el.setAttribute("aria-selected", String(check === CHECKED));
    if (hasKids) el.setAttribute("aria-expanded", String(open));
    const plan: Plan = this.model.get("plan") ?? {};
    const planned = Boolean(plan.devices?.length);
    const chip = planned ? deviceChip(plan, n) : null;
    const on = chip && chip.textContent !== "—" ? `, planned on ${chip.textContent}` : "";
    el.setAttribute("aria-label", `${t.qname[n] || "the whole model"}, ${t.type[n]}, ${humanBytes(t.bytes[n])}, ${stateText(t.state[n], t.target[n])}${on}`);
    el.setAttribute("aria-keyshortcuts", "C");
    el.tabIndex = n === this.focusNode ? 0 : -1;
    if (n === this.focusNode) el.classList.add("jmi-focus");

    const cbCell = h("div", "jmi-c-check");
    const cb = h("input", "jmi-check");
    cb.type = "checkbox";
    cb.tabIndex = -1; // the row is the focus stop; Space ticks
    cb.checked = check === CHECKED;
    cb.indeterminate = check === PARTIAL;
    cb.disabled = Boolean(this.model.get("busy")) || this.disconnected;
    cb.setAttribute("aria-label", `Select ${t.qname[n] || "the whole model"}`);
    cbCell.append(cb);

    const nameCell = h("div", "jmi-c-name");
    // the indent narrows with the widget (style.css: --jmi-indent), so deep names keep room
    nameCell.style.paddingLeft = `calc(${row.depth} * var(--jmi-indent, 16px))`;
    const caret = h("span", `jmi-caret${hasKids ? "" : " jmi-leaf"}`, hasKids ? (open ? "▾" : "▸") : "");
    caret.setAttribute("aria-hidden", "true");
    const name = h("span", "jmi-name");
    const label = n === 0 ? "(model)" : t.name[n];
    appendHighlighted(name, label, row.match ? this.query : "");
    name.title = t.qname[n] || "the whole model";
    // the path as code the magics take, to copy (shown on hover and on the focused row)
    const code = codePath(String(this.model.get("var_name") ?? "model"), t.qname[n]);
    // an inline SVG, not a glyph: "⧉" and its kin are missing from common Linux fonts (tofu)
    const copy = h("button", "jmi-copy");
    copy.append(copyIcon());
    copy.type = "button";
    copy.tabIndex = -1; // the row is the focus stop
    copy.title = `Copy ${code} (the path %materialize and the other magics take; key: c)`;
    copy.setAttribute("aria-label", `Copy ${code}`);
    copy.dataset.code = code;
    nameCell.append(caret, name, copy);
    // The chips beside the name, most important first (tied, repeated): each shows
    // whole or not at all, never cut to "t…" (style.css: .jmi-tags wraps what does not fit
    // onto a hidden second line); their text stays in the row's title and aria-label.
    const tags: HTMLElement[] = [];
    const rep = t.repeatedChildren(n);
    // "identical" only while it holds: a block cast to another dtype since differs
    if (rep) {
      const same = t.stillIdentical(t.children[n][0], rep[0]);
      const chip = keyedChip("jmi-chip", `×${rep[0]}`, same ? ", identical" : ", same structure");
      chip.title = same
        ? `${rep[0]} identical ${rep[1]} blocks`
        : `${rep[0]} ${rep[1]} blocks built identical; their dtypes or sizes now differ`;
      tags.push(chip);
    } else if (
      hasKids &&
      t.repN[n] > 1 &&
      t.repI[n] === 0 &&
      t.children[t.parent[n]].length !== t.repN[n]
    ) {
      // a run of identical blocks among other children; leaves (two equal Linears) are not blocks
      const same = t.stillIdentical(n, t.repN[n]);
      const chip = keyedChip("jmi-chip", `×${t.repN[n]}`, same ? ", identical" : ", same structure");
      chip.title = same
        ? `This ${t.type[n]} and the next ${t.repN[n] - 1} are identical blocks`
        : `This ${t.type[n]} and the next ${t.repN[n] - 1} were built identical; their dtypes or sizes now differ`;
      tags.push(chip);
    }
    const tied = t.tied[n];
    if (tied.length) {
      const names = tied.map((k) => t.qname[k] || "(model)");
      const chip = keyedChip("jmi-chip jmi-tied", "tied", `: ${names[0]}${names.length > 1 ? ` +${names.length - 1}` : ""}`);
      chip.title = `Shares a tensor with ${names.join(", ")}: counted once, and real or deferred together`;
      tags.unshift(chip);
    }

    // non-eager values are never hidden: the tag keeps its width, the name shrinks
    if (t.values[n]) nameCell.append(fastTag(t.values[n]));
    if (tags.length) {
      const box = h("span", "jmi-tags");
      box.append(h("span", "jmi-tags-spacer"), ...tags);
      nameCell.append(box);
    }

    const typeCell = h("div", "jmi-c-type");
    appendHighlighted(typeCell, t.type[n], row.match ? this.query : "");
    if (t.info[n]) typeCell.title = `${t.type[n]}(${t.info[n]})`;

    const share = h("div", "jmi-c-share");
    const track = h("div", "jmi-bar");
    const fill = h("div", "jmi-bar-fill");
    const frac = t.totalBytes ? t.share[n] / t.totalBytes : 0;
    fill.style.width = `${Math.max(frac > 0 ? 1 : 0, 100 * frac).toFixed(1)}%`;
    track.append(fill);
    share.append(track, h("span", "jmi-pct", percent(t.share[n], t.totalBytes)));
    share.title = "Share of the model's memory (a tied tensor counts for its first holder)";

    const size = h("div", "jmi-c-num jmi-c-size", humanBytes(t.bytes[n]));
    if (t.dtype[n]) size.prepend(dtypeTag(t.dtype[n]), " ");
    if (t.source[n]) size.prepend(sourceTag(t.source[n]), " ");


    el.append(
      cbCell,
      nameCell,
      typeCell,
      h("div", "jmi-c-num jmi-c-params", humanCount(t.params[n])),
      size,
      cellWith(badge(t.state[n], t.target[n]), "jmi-c-state"),
      share,
    );
    if (chip) el.append(cellWith(chip, "jmi-c-device"));
    return el;
  }
}

const SVG_NS = "http://www.w3.org/2000/svg";

/** Two overlapping sheets, the usual "copy" icon, drawn in the text colour. */
export function copyIcon(): SVGSVGElement {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 16 16");
  svg.setAttribute("width", "12");
  svg.setAttribute("height", "12");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("focusable", "false");
  svg.classList.add("jmi-icon");
  // the front sheet whole, the back one as the corner that shows behind it: no fill needed,
  // so it reads on any row background (hover, selected, dark)
  const back = document.createElementNS(SVG_NS, "path");
  back.setAttribute("d", "M2.75 10.5V3.5a.75.75 0 0 1 .75-.75h7");
  const front = document.createElementNS(SVG_NS, "rect");
  for (const [k, v] of [["x", "5.25"], ["y", "5.25"], ["width", "8"], ["height", "8"], ["rx", "1"]]) {
    front.setAttribute(k, v);
  }
  for (const part of [back, front]) {
    part.setAttribute("fill", "none");
    part.setAttribute("stroke", "currentColor");
    part.setAttribute("stroke-width", "1.5");
    part.setAttribute("stroke-linecap", "round");
    svg.append(part);
  }
  return svg;
}

/** A chip whose key ("tied", "×4") is what must show: where the rest does not fit it ends in an
 *  ellipsis, and where the key does not fit the chip goes (style.css: .jmi-tags). */
export function keyedChip(cls: string, key: string, rest: string): HTMLElement {
  const chip = h("span", cls, key + rest);
  // ch is the width of "0" in the chip's font: the key, the ellipsis, the padding
  chip.style.setProperty("--jmi-key", `calc(${key.length + 1.5}ch + 12px)`);
  return chip;
}

/** Available or not, keeping the button focusable (see renderActions). */
function setEnabled(b: HTMLButtonElement, enabled: boolean): void {
  b.disabled = false;
  b.setAttribute("aria-disabled", String(!enabled));
  b.classList.toggle("jmi-disabled", !enabled);
}

function rowsHaveChild(rows: VisibleRow[], i: number): boolean {
  return i + 1 < rows.length && rows[i + 1].depth > rows[i].depth;
}

function cellWith(child: HTMLElement, cls: string): HTMLElement {
  const c = h("div", cls);
  c.append(child);
  return c;
}

/** An action message in words, for the page to say what waits. */
function actionLabel(content: Record<string, unknown>): string {
  if (content.action === "materialize") return `Materialize → ${String(content.device ?? "its device")}`;
  if (content.action === "free") return "Free";
  if (content.action === "materialize_plan") return "Materialize plan";
  if (content.action === "plan" || content.action === "pin" || content.action === "unpin") return "Plan";
  if (content.action === "save") return "Save";
  return String(content.action ?? "action");
}

let whyIds = 0;
/** Ids must be unique in the page, which may hold several widgets (and several pages). */
const viewId = Math.random().toString(36).slice(2, 8);

/** "needs 3.64 TiB, 19.8 GiB free on cpu": by how much a selection misses a device. */
export function fitAmounts(device: string, f: { need: number; free: number }): string {
  return `needs ${humanBytes(f.need)}, ${humanBytes(f.free)} free on ${device}`;
}

/** A module's qualified name as Python the magics take: `model.layers.5` of `model` is
 *  `model.model.layers[5]`. */
export function codePath(varName: string, qname: string): string {
  if (!qname) return varName;
  let out = varName;
  for (const part of qname.split(".")) {
    if (/^\d+$/.test(part)) out += `[${part}]`;
    else if (/^[A-Za-z_][A-Za-z0-9_]*$/.test(part)) out += `.${part}`;
    else return `${varName}.get_submodule(${JSON.stringify(qname)})`;
  }
  return out;
}

/** What a state badge says: `deferred → cuda:0` when deferred parts have a target. */
export function stateText(state: string, target = ""): string {
  return state === "deferred" && target ? `deferred → ${target}` : state || "—";
}

export function badge(state: string, target = ""): HTMLElement {
  const b = h("span", `jmi-badge jmi-state-${stateKind(state)}`);
  if (state === "deferred" && target) {
    // two parts, so that a narrow column shortens "deferred" and keeps the device readable
    b.classList.add("jmi-badge-split");
    b.append(h("span", "jmi-badge-state", "deferred"), h("span", "jmi-badge-target", ` → ${target}`));
  } else {
    b.textContent = stateText(state, target);
  }
  b.title = state
    ? state === "deferred"
      ? `No memory allocated yet${target ? `; will be materialized on ${target} unless told otherwise` : ""}`
      : state === "mixed"
        ? "Partly materialized"
        : state === "meta"
          ? "On PyTorch's meta device: no values and no recording, cannot be materialized"
          : `Materialized on ${state}`
    : "Holds no parameters or buffers";
  return b;
}

/** Where the values come from, when it is a checkpoint file. */
function sourceTag(source: string): HTMLElement {
  const tag = h("span", "jmi-dtype jmi-source", source === "checkpoint" ? "file" : "file+init");
  tag.title =
    source === "checkpoint"
      ? "Values come from a checkpoint file (read when materialized)"
      : "Partly from a checkpoint file, partly from the model's init (keys missing from the file)";
  return tag;
}

/** Values replayed with rng="fast": deterministic, but not what eager construction gives. */
export function fastTag(values: string): HTMLElement {
  const tag = h("span", "jmi-dtype jmi-fast");
  // "part " goes first when the widget is narrow (style.css), "fast" never
  if (values === "mixed") tag.append(h("span", "jmi-fast-part", "part "));
  tag.append("fast");
  tag.title =
    (values === "mixed" ? "Part of these values" : "These values") +
    ' were generated with RNG "fast": deterministic, but not the values eager construction gives. Materialize with RNG "exact" to re-generate them exactly.';
  return tag;
}

/** A small dtype tag: bf16, fp32, mixed. */
function dtypeTag(dtype: string): HTMLElement {
  // "multi", not "mixed": the state badge beside it says "mixed" for something else
  const tag = h("span", "jmi-dtype", dtype === "mixed" ? "multi" : dtype);
  tag.title = dtype === "mixed" ? "Tensors of several dtypes" : `dtype ${dtype}`;
  return tag;
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
