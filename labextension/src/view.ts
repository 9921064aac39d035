// The widget's DOM: header with totals, toolbar, action buttons, progress, and a virtually
// scrolled tree (only the rows in view exist in the DOM).  The tree is an ARIA tree with one
// focusable row at a time (roving tabindex): arrows move and open/close, Space ticks, Enter
// opens, Home/End jump; focus follows the node across re-renders. The pieces live beside it:
// kernel_link.ts (messages and their answers), actions.ts (the action buttons), row.ts (one
// row), cells.ts (badges and tags), plan.ts (the plan and save bars), dom.ts (DOM helpers).

import { ActionBar, busyWhy } from "./actions";
import { badge, codePath, dtypeTag, fitAmounts } from "./cells";
import { button, h, Reasons } from "./dom";
import { FocusKeeper } from "./focus";
import { humanBytes, humanCount } from "./format";
import { GONE_KERNEL, GONE_WIDGET, KernelLink, NOT_CONNECTED } from "./kernel_link";
import { type Action, actionFor, declareKey, keyList, type Target, withKey } from "./keys";
import { type Plan, PlanBar, planHead, SaveBar } from "./plan";
import { ROW_HEIGHT, type RowContext, treeRow } from "./row";
import { CompareBar, comparedText, type Compared, readComparison } from "./compare";
import { readValues, type Values } from "./values";
import { ValuesPanel } from "./values_panel";
import { type PatchRow, Tree, type TreeJSON, type VisibleRow } from "./tree";

/** The running action's progress line once the widget is disconnected, by why. */
const STOPPED_WHY: Record<string, string> = {
  [GONE_KERNEL]: "the kernel died or was restarted",
  [GONE_WIDGET]: "this widget was closed in the kernel",
  [NOT_CONNECTED]: "no kernel is connected",
};

/** The part of anywidget's model this view uses. */
export interface WidgetModel {
  get(name: string): any;
  set(name: string, value: unknown): void;
  save_changes(): void;
  send(content: unknown): void;
  on(event: string, cb: (...args: any[]) => void): void;
  off(event?: string | null, cb?: ((...args: any[]) => void) | null): void;
  /** The front end's widget manager (its kernel, its notebook's session), when there is one. */
  widget_manager?: unknown;
}

const MAX_VISIBLE_ROWS = 18;
const OVERSCAN = 6;
/** How long a refused request's notice stays. */
export const NOTICE_MS = 5000;

export class TreeView {
  readonly el: HTMLElement;
  tree: Tree;
  expanded: Set<number>;
  query = "";
  selected = new Set<number>();
  rows: VisibleRow[] = [];
  /** The node that has (or will get) keyboard focus in the tree. */
  focusNode = 0;
  /** Messages to the kernel and their answers; whether it is busy or gone. */
  readonly link: KernelLink;
  private checks: Uint8Array;
  private readonly disposers: Array<() => void> = [];
  private frame = 0;
  private noticeTimer = 0;
  private readonly reasons = new Reasons();

  // parts
  private readonly totalsEl = h("div", "jmi-totals");
  private readonly selEl = h("div", "jmi-seltotals");
  private readonly search = h("input", "jmi-search");
  private readonly depthInput = h("input", "jmi-depth");
  private readonly actionBar: ActionBar;
  private readonly progressEl = h("div", "jmi-progress");
  private readonly progressBar = h("div", "jmi-progress-fill");
  private readonly progressText = h("span", "jmi-progress-text");
  private readonly cancelBtn: HTMLButtonElement;
  private readonly messageEl = h("div", "jmi-message");
  private readonly noticeEl = h("div", "jmi-notice");
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
  /** Values: its panel (columns toggle, depth chart, histogram) and what it measured. */
  readonly valuesPanel: ValuesPanel;
  private values: Values | null = null;
  /** Compare with…: its bar and the last comparison. */
  readonly compareBar: CompareBar;
  private compared: Compared | null = null;
  private planHeadEl: HTMLElement = h("div", "jmi-planhead");
  /** The parts a widget that lost its model turns inert (everything but its banners). */
  private liveParts: HTMLElement[] = [];
  private readonly focusKeeper: FocusKeeper;
  /** The widget's own actions beside the action bar's and the plan bar's: keys on tree rows. */
  private readonly ownActions: Action[];

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
    this.link = new KernelLink((content) => model.send(content), {
      // the last action's message is not about this one: hide it until the kernel's next
      actionSent: () => {
        this.messageEl.hidden = true;
        this.noticeEl.hidden = true; // an old "Copied …" is not about it either
      },
      changed: (connection) => {
        this.renderActions();
        if (!connection) return;
        this.applyOff();
        this.renderRows();
        this.renderTable();
        this.renderProgress();
      },
    });
    this.cancelBtn = button("Cancel", "jmi-cancel", () => this.request({ action: "cancel" }));
    this.tableBtn = button("Table", "jmi-toggle jmi-table-toggle", () => this.toggleTable());
    this.fullBtn = button("All columns", "jmi-toggle jmi-full", () => {
      model.set("table_full", !model.get("table_full"));
      model.save_changes();
    });
    const host = {
      request: (c: Record<string, unknown>) => this.request(c),
      get: (k: string) => model.get(k),
      explain: (b: HTMLButtonElement, why: string) => this.reasons.explain(b, why),
      say: (text: string) => this.sayNotice(text),
    };
    this.planBar = new PlanBar(host);
    this.saveBar = new SaveBar(host);
    this.compareBar = new CompareBar(host);
    this.actionBar = new ActionBar(host, this.reasons, { plan: this.planBar.el, save: this.saveBar.el, compare: this.compareBar.el }, [
      this.rngSel,
      this.dtypeSel,
    ]);
    this.valuesPanel = new ValuesPanel(
      () => {
        this.el.classList.toggle("jmi-valued", this.valuesPanel.columns);
        this.renderRows();
      },
      (node) => this.tree.qname[node] ?? "",
      (node) => this.tree.tied[node] ?? [],
    );
    this.ownActions = this.widgetActions();
    this.focusKeeper = new FocusKeeper(this.el, () => this.focusFallback());
    this.build();
    this.link.watchKernel(model.widget_manager);
    this.listen("change:plan", () => this.renderPlan());
    this.listen("change:values", () => this.renderValues());
    this.listen("change:comparison", () => this.renderComparison());
    this.listen("change:selected", () => {
      this.selected = new Set(this.tree.nodesOf(this.model.get("selected") ?? []));
      this.refreshChecks();
      this.renderActions(); // the plan and save bars act on the selection
    });
    this.listen("change:selection", () => this.renderSelection());
    this.listen("change:busy change:devices change:no_cuda_reason", () => this.renderActions());
    this.listen("change:progress change:busy", () => this.renderProgress());
    this.listen("change:busy", () => this.renderRows());
    this.listen("change:model_gone", () => {
      this.applyOff();
      this.renderActions();
      this.renderRows();
      this.renderMessage();
    });
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
      if (msg && msg.kind === "ack") this.link.acknowledged(Number(msg.id));
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
    this.link.dispose();
    this.el.remove();
  }

  /** Send an action (or a ping); see KernelLink. */
  request(content: Record<string, unknown>): void {
    this.link.request(content);
  }

  setDisconnected(why = GONE_KERNEL): void {
    this.link.setDisconnected(why);
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
      ["Std", "jmi-c-num jmi-c-val jmi-c-std"],
      ["Absmax", "jmi-c-num jmi-c-val jmi-c-absmax"],
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
      const bar = [this.planBar.el, this.saveBar.el, this.compareBar.el].find((b) => b.contains(ev.target as Node));
      if (ev.key === "Escape" && bar) {
        ev.preventDefault(); // closes the bar; the tree row takes the focus back
        this.closeBar(bar);
      } else if (ev.key === "Escape") {
        ev.preventDefault();
        this.focusNotebook();
      } else if (this.rowsEl.contains(ev.target)) {
        this.onKey(ev);
      } else if (this.actionBar.el.contains(ev.target)) {
        this.actionBar.onKey(ev);
      } else if (ev.target === this.depthInput && ev.key === "Enter") {
        ev.preventDefault(); // applies the depth, as Enter submits the plan and save fields
        this.expandToDepth(Number(this.depthInput.value) || 0);
      }
    };
    for (const type of ["keydown", "keypress", "keyup"]) {
      window.addEventListener(type, onWindowKey as EventListener, true);
      this.disposers.push(() => window.removeEventListener(type, onWindowKey as EventListener, true));
    }
    this.rowsEl.addEventListener("focusin", (ev) => {
      const rowEl = (ev.target as HTMLElement).closest(".jmi-row") as HTMLElement | null;
      if (rowEl?.dataset.node !== undefined) this.focusNode = Number(rowEl.dataset.node);
      this.valuesPanel.focus(this.focusNode);
    });
    this.noticeEl.setAttribute("role", "status");
    this.noticeEl.hidden = true;
    this.messageEl.setAttribute("role", "status");
    this.messageEl.tabIndex = -1; // holds the focus of a widget whose model is gone
    this.liveParts = [tools, this.actionBar.el, this.planBar.el, this.saveBar.el, this.compareBar.el, this.progressEl, colhead, this.scroller, this.valuesPanel.el, this.tableEl];
    if (typeof ResizeObserver !== "undefined") {
      const watcher = new ResizeObserver(() => {
        this.actionBar.placeSeparator();
        this.valuesPanel.resized();
      });
      watcher.observe(this.el);
      this.disposers.push(() => watcher.disconnect());
    }

    this.el.append(
      head,
      this.link.disconnectedEl,
      this.link.waitingEl,
      tools,
      this.actionBar.el,
      this.planBar.el,
      this.saveBar.el,
      this.compareBar.el,
      this.compareBar.legend,
      this.progressEl,
      this.messageEl,
      this.noticeEl,
      colhead,
      this.scroller,
      this.valuesPanel.el,
      this.tableEl,
      this.reasons.el,
    );
    this.syncSelects();
    this.renderPlan();
    this.renderActions();
    this.renderProgress();
    this.renderMessage();
    this.renderTable();
    this.renderValues();
    this.renderComparison(); // a second view of the widget (or a reload) shows the colours too
  }

  // ------------------------------------------------------------------ actions and keys
  /** The widget's own entries of the action table: Cancel, Table, Copy and the key list. */
  private widgetActions(): Action[] {
    const actions: Action[] = [
      {
        id: "cancel",
        label: "Cancel",
        shortcut: "X",
        what: "Stop the running action: the model is left as it was",
        button: this.cancelBtn,
        blocked: () =>
          this.off ? busyWhy(false, true) : this.model.get("busy") || this.link.actionPending ? "" : "Nothing is running",
        run: () => this.request({ action: "cancel" }),
      },
      {
        id: "table",
        label: "Table",
        shortcut: "T",
        what: "Show the memory table of the selection (the whole model if none)",
        button: this.tableBtn,
        blocked: () => (this.off ? busyWhy(false, true) : ""),
        run: () => this.toggleTable(),
      },
      {
        id: "value-columns",
        label: "Value columns",
        shortcut: "Shift+V",
        what: "Show std and absmax as columns of the tree",
        button: this.valuesPanel.columnsBtn,
        blocked: () => (this.values ? "" : "Run Values first (key v)"),
        run: () => this.valuesPanel.toggleColumns(),
      },
      { id: "copy", label: "Copy the row's path", shortcut: "C", blocked: () => "", run: () => this.copyPath(this.focusNode) },
      { id: "keys", label: "these keys", shortcut: "?", blocked: () => "", run: () => this.sayNotice(keyList(this.actions()), 15_000) },
    ];
    for (const a of actions) declareKey(a);
    return actions;
  }

  /** Every entry of the action table, as of the last render (the order of the key list). */
  actions(): Action[] {
    return [...this.actionBar.actions, ...this.planBar.actions(), ...this.ownActions];
  }

  /** What a key on a tree row acts on: the ticked rows, or the focused row if none. */
  keyTarget(): Target {
    const names: string[] = this.model.get("selected") ?? [];
    if (names.length) {
      return { names, ticked: true, states: Object.keys(this.model.get("selection")?.states ?? {}) };
    }
    const n = this.focusNode;
    return { names: [this.tree.qname[n]], ticked: false, states: [this.tree.state[n]] };
  }

  /** Run an action from its key on a tree row; the row keeps the focus (a bar that opens
   *  takes it), and an action that cannot run says why, briefly. */
  private runKey(action: Action): void {
    const target = this.keyTarget();
    const why = action.blocked(target);
    if (why) this.sayNotice(`${action.label}: ${why}`);
    else action.run(target);
    const next = why ? null : action.focusAfter?.();
    if (next) next.focus();
    else this.focusRow();
  }

  private toggleTable(): void {
    this.model.set("show_table", !this.model.get("show_table"));
    this.model.save_changes();
  }

  /** Close the Plan… or Save… bar; the tree row takes the focus. */
  private closeBar(bar: HTMLElement): void {
    const id = bar === this.planBar.el ? "plan" : bar === this.saveBar.el ? "save" : "compare";
    const toggle = this.actions().find((a) => a.id === id);
    if (!bar.hidden && toggle) toggle.run(this.keyTarget());
    this.renderRows();
    this.focusRow();
  }

  /** Say something briefly, beside the last action's message (a refused key, a copy). */
  sayNotice(text: string, ms = NOTICE_MS): void {
    clearTimeout(this.noticeTimer);
    this.noticeEl.textContent = text;
    this.noticeEl.hidden = false;
    this.noticeTimer = window.setTimeout(() => (this.noticeEl.hidden = true), ms);
    this.keepFocusInView();
  }

  /** Text shown above the tree (a notice, the key list, a message) pushes the rows down, and
   *  nothing scrolls the notebook after them: bring the focused element back into view (at a
   *  narrow width the key list alone is taller than the notebook's view). */
  private keepFocusInView(): void {
    const active = document.activeElement;
    if (active instanceof HTMLElement && active !== this.el && this.el.contains(active)) {
      active.scrollIntoView({ block: "nearest" });
    }
  }

  /** Where focus goes when its element goes away: the tree row, or, in a widget that lost
   *  its model, the banner that says so. */
  private focusFallback(): HTMLElement | null {
    if (this.off) return this.link.disconnected ? this.link.disconnectedEl : this.messageEl;
    if (!this.rowsEl.querySelector(`[data-node="${this.focusNode}"]`)) this.renderRows();
    return this.rowsEl.querySelector<HTMLElement>(`[data-node="${this.focusNode}"]`);
  }

  /** A widget that lost its kernel or its model: nothing in it is a control any more (inert,
   *  greyed), its banner says why, and holds the focus if the widget had it. */
  private applyOff(): void {
    const off = this.off;
    this.el.classList.toggle("jmi-off", off);
    const hadFocus = this.el.contains(document.activeElement);
    for (const part of this.liveParts) {
      if (off) part.setAttribute("inert", "");
      else part.removeAttribute("inert");
    }
    if (off && hadFocus) this.focusFallback()?.focus({ preventScroll: true });
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
    if (this.off || this.model.get("busy")) return;
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
    // the clicked row takes the keyboard: the notebook may have taken focus on mousedown
    // (Notebook 7 focuses the cell), and the arrows and Space that follow are the tree's
    this.renderRows();
    this.focusRow();
  }

  /** Copy a row's path as code the magics take (`model.model.layers[5]`) and say so. */
  copyPath(node: number): string {
    const code = codePath(String(this.model.get("var_name") ?? "model"), this.tree.qname[node]);
    const said = (text: string) => this.sayNotice(text);
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
    if (ev.key === "Enter" && (ev.shiftKey || ev.ctrlKey || ev.altKey || ev.metaKey)) {
      // the notebook's "run the cell": never the tree's Enter (it would collapse the row)
      ev.preventDefault();
      this.sayNotice(
        "Shift+Enter does nothing in the tree: press Escape to go back to the notebook, then Shift+Enter runs the cell.",
      );
      return true;
    }
    const action = actionFor(this.actions(), ev);
    if (action) {
      ev.preventDefault();
      this.runKey(action);
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

  /** Nothing can be done: the kernel is gone, or the model was freed in it. */
  private get off(): boolean {
    return this.link.disconnected || Boolean(this.model.get("model_gone"));
  }

  renderActions(): void {
    const off = this.off;
    // an action sent and not yet answered counts as running: no second one meanwhile
    const busy = Boolean(this.model.get("busy")) || off || this.link.actionPending;
    this.actionBar.render(busy, off);
    this.planBar.render(busy, off);
    this.saveBar.render(busy, off);
    this.compareBar.render(busy, off);
    for (const a of this.ownActions) {
      if (!a.button) continue;
      a.button.disabled = off;
      this.reasons.explain(a.button, withKey(a.what ?? a.label, a.shortcut));
    }
    this.actionBar.placeSeparator();
    this.focusKeeper.schedule();
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
    // "materialize cpu: 1.0 GiB / 2.0 GiB (50%) · phase", or "free: phase" before any amount
    const said = [amount, phase].filter(Boolean).join(" · ");
    this.progressText.textContent = busy ? [`${busy}:`, said].filter(Boolean).join(" ") : "";
    // The kernel (or this widget in it) is gone mid-action: nothing more will come of it, so
    // the line says it stopped, and Cancel, which could reach no one, goes.
    const gone = this.link.disconnected;
    this.cancelBtn.hidden = gone;
    this.progressEl.classList.toggle("jmi-stopped", gone);
    if (gone && busy) this.progressText.textContent = `${busy}: stopped, ${STOPPED_WHY[this.link.why] ?? "the kernel is gone"}.`;
    this.focusKeeper.schedule(); // Cancel went with the progress line: the row takes the focus
  }

  /** What Values measured: the panel, and the rows' flags and columns. */
  private renderValues(): void {
    this.values = readValues(this.model.get("values"));
    this.valuesPanel.setValues(this.values);
    this.valuesPanel.focus(this.focusNode);
    this.el.classList.toggle("jmi-valued", Boolean(this.values) && this.valuesPanel.columns);
    this.renderRows();
  }

  /** What Compare with… found: the rows' colours, their tooltips and the legend. */
  private renderComparison(): void {
    this.compared = readComparison(this.model.get("comparison"));
    this.compareBar.legend.hidden = !this.compared;
    this.renderRows();
  }

  private renderMessage(): void {
    const err: string = this.model.get("error") ?? "";
    const status: string = this.model.get("status") ?? "";
    this.messageEl.className = `jmi-message${err ? " jmi-error" : status ? " jmi-ok" : ""}`;
    this.messageEl.textContent = err || status;
    this.messageEl.hidden = !(err || status);
    if (err || status) this.keepFocusInView();
  }

  private renderNotice(): void {
    const notice = this.model.get("notice") ?? {};
    const text: string = notice.text ?? "";
    if (text) this.sayNotice(text);
    else this.noticeEl.hidden = true;
  }

  private renderTable(): void {
    const show = Boolean(this.model.get("show_table"));
    this.tableBtn.classList.toggle("jmi-on", show);
    this.tableBtn.setAttribute("aria-pressed", String(show));
    this.tableEl.hidden = !show;
    const full = Boolean(this.model.get("table_full"));
    this.fullBtn.classList.toggle("jmi-on", full);
    this.fullBtn.title = full ? "Back to the compact table" : "Show every column of the table";
    // the HTML is rendered by pandas in the kernel, never from page input
    const body = h("div", "jmi-table");
    const html: string = this.model.get("table_html") ?? "";
    body.innerHTML = show ? html : "";
    if (show && !html) {
      body.textContent = this.link.disconnected
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
    const plan: Plan = this.model.get("plan") ?? {};
    const ctx: RowContext = {
      tree: this.tree,
      checks: this.checks,
      isOpen: (i) => this.isOpen(i),
      focusNode: this.focusNode,
      query: this.query,
      varName: String(this.model.get("var_name") ?? "model"),
      locked: Boolean(this.model.get("busy")) || this.off,
      plan,
      planned: Boolean(plan.devices?.length),
      values: this.values,
      compared: this.compared,
      comparedText: (node: number) => (this.compared ? comparedText(this.compared, node) : ""),
      valueColumns: Boolean(this.values) && this.valuesPanel.columns,
    };
    const frag = document.createDocumentFragment();
    for (let i = first; i < last; i++) frag.append(treeRow(ctx, this.rows[i], i));
    // the focused row always exists, even scrolled out of view, so that focus never drops
    const at = this.rows.findIndex((r) => r.node === this.focusNode);
    if (at >= 0 && (at < first || at >= last)) frag.append(treeRow(ctx, this.rows[at], at));
    this.rowsEl.replaceChildren(frag);
    if (hadFocus) this.focusRow();
  }
}

function rowsHaveChild(rows: VisibleRow[], i: number): boolean {
  return i + 1 < rows.length && rows[i + 1].depth > rows[i].depth;
}
