import { afterEach, describe, expect, it, vi } from "vitest";
import { codePath } from "../src/cells";
import { TreeView, type WidgetModel } from "../src/view";
import { bigTree, smallTree } from "./fixture";
import type { TreeJSON } from "../src/tree";
import { ROW } from "../src/rows";

/** An in-memory stand-in for anywidget's model (plain state + events), not a mock of a library. */
class FakeModel implements WidgetModel {
  state: Record<string, any>;
  widget_manager?: unknown;
  sent: any[] = [];
  saved = 0;
  private handlers = new Map<string, Set<(...a: any[]) => void>>();
  constructor(tree: TreeJSON, extra: Record<string, any> = {}) {
    this.state = {
      tree, selected: [], selection: {}, expand_depth: 1, busy: "", progress: [0, 0], error: "",
      status: "", rng: "exact", dtype: "", devices: [], no_cuda_reason: "no GPU here",
      show_table: false, table_html: "", ...extra,
    };
  }
  get(k: string) { return this.state[k]; }
  set(k: string, v: unknown) { this.state[k] = v; this.emit(`change:${k}`); }
  save_changes() { this.saved++; }
  send(c: unknown) { this.sent.push(c); }
  on(ev: string, cb: (...a: any[]) => void) {
    if (!this.handlers.has(ev)) this.handlers.set(ev, new Set());
    this.handlers.get(ev)!.add(cb);
  }
  off(ev?: string | null, cb?: ((...a: any[]) => void) | null) {
    if (ev && cb) this.handlers.get(ev)?.delete(cb);
  }
  emit(ev: string, ...args: any[]) { for (const cb of this.handlers.get(ev) ?? []) cb(...args); }
}

function mount(tree: TreeJSON, extra: Record<string, any> = {}, manager?: unknown) {
  const model = new FakeModel(tree, extra);
  model.widget_manager = manager;
  const root = document.createElement("div");
  document.body.append(root);
  const view = new TreeView(model, root);
  return { model, root, view };
}

const rowNames = (root: HTMLElement) =>
  [...root.querySelectorAll(".jmi-rows .jmi-row .jmi-name")].map((e) => e.textContent);

describe("TreeView", () => {
  it("renders the first level with totals and badges", () => {
    const { root } = mount(smallTree());
    expect(rowNames(root)).toEqual(["(model)", "embed", "layers", "norm"]);
    expect(root.querySelector(".jmi-totals")!.textContent).toContain("Net");
    expect(root.querySelector(".jmi-rows .jmi-badge")!.textContent).toBe("deferred");
    expect(root.querySelector(".jmi-chip")!.textContent).toBe("×2, identical");
  });

  it("expands a node on click", () => {
    const { root } = mount(smallTree());
    const layers = [...root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")][2];
    layers.querySelector<HTMLElement>(".jmi-caret")!.click();
    expect(rowNames(root)).toEqual(["(model)", "embed", "layers", "0", "1", "norm"]);
  });

  it("sends the selection when a checkbox is ticked", () => {
    const { root, model } = mount(smallTree());
    const embed = [...root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")][1];
    embed.querySelector<HTMLInputElement>(".jmi-check")!.click();
    expect(model.state.selected).toEqual(["embed"]);
    expect(model.saved).toBe(1);
    const root0 = root.querySelector<HTMLInputElement>(".jmi-rows .jmi-row .jmi-check")!;
    expect(root0.indeterminate).toBe(true);
  });

  it("materializes the selection with an action message, never code", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!.click();
    expect(model.sent).toEqual([{ action: "materialize", device: "cpu", names: ["norm"], id: 1 }]);
  });

  it("disables the CUDA button with a reason when there is no GPU, keeping it in the Tab order", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    const b = root.querySelector<HTMLButtonElement>(".jmi-mat-cuda")!;
    expect(b.disabled).toBe(false); // a disabled button is skipped by Tab: its reason unreachable
    expect(b.getAttribute("aria-disabled")).toBe("true");
    expect(b.title).toBe("no GPU here (key on a tree row: g)");
    expect(document.getElementById(b.getAttribute("aria-describedby")!)!.textContent).toBe(b.title);
    b.click();
    expect(model.sent).toEqual([]);
  });

  it("copies the focused row's path with the c key and says so", async () => {
    const { root } = mount(smallTree(), { var_name: "net" });
    const written: string[] = [];
    Object.defineProperty(navigator, "clipboard", {
      configurable: true,
      value: { writeText: async (t: string) => void written.push(t) },
    });
    const row = root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")[2];
    row.focus();
    row.dispatchEvent(new KeyboardEvent("keydown", { key: "c", bubbles: true }));
    await new Promise((r) => setTimeout(r, 0));
    expect(written).toEqual(["net.layers"]);
    expect(root.querySelector(".jmi-notice")!.textContent).toBe("Copied net.layers");
  });

  it("disables buttons and shows progress while busy", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("busy", "materialize cpu");
    model.set("progress", [50, 200]);
    expect(root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!.getAttribute("aria-disabled")).toBe("true");
    expect(root.querySelector<HTMLElement>(".jmi-progress")!.hidden).toBe(false);
    expect(root.querySelector<HTMLElement>(".jmi-progress-fill")!.style.width).toBe("25.0%");
    root.querySelector<HTMLButtonElement>(".jmi-cancel")!.click();
    expect(model.sent).toEqual([{ action: "cancel", id: 1 }]);
  });

  it("stops calling blocks identical once one was cast to another dtype", () => {
    const { root, model } = mount(smallTree());
    const chip = () => root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")[2].querySelector<HTMLElement>(".jmi-chip")!;
    expect(chip().textContent).toBe("×2, identical");
    model.emit("msg:custom", { kind: "patch", nodes: [[6, 30, 60, "cpu", "bf16"], [2, 60, 180, "mixed", "mixed"]] });
    expect(chip().textContent).toBe("×2, same structure");
    expect(chip().title).toContain("now differ");
  });

  it("updates badges from a patch", () => {
    const { root, model } = mount(smallTree());
    model.emit("msg:custom", { kind: "patch", nodes: [[9, 5, 20, "cpu"], [0, 165, 660, "mixed"]] });
    const badges = [...root.querySelectorAll(".jmi-rows .jmi-badge")].map((b) => b.textContent);
    expect(badges).toEqual(["mixed", "deferred", "deferred", "cpu"]);
  });

  it("shows errors in plain words", () => {
    const { root, model } = mount(smallTree());
    model.set("error", "Out of memory: cpu has no room.");
    const msg = root.querySelector<HTMLElement>(".jmi-message")!;
    expect(msg.hidden).toBe(false);
    expect(msg.classList.contains("jmi-error")).toBe(true);
  });

  it("keeps only the rows in view in the DOM", () => {
    const { root, view } = mount(bigTree());
    view.expandToDepth(99);
    expect(view.rows.length).toBeGreaterThan(1000);
    expect(root.querySelectorAll(".jmi-rows .jmi-row").length).toBeLessThan(60);
  });

  it("expands to the typed depth on Enter in the depth box", () => {
    const { root } = mount(smallTree());
    const depth = root.querySelector<HTMLInputElement>(".jmi-depth")!;
    depth.value = "2";
    depth.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true }));
    expect(rowNames(root)).toEqual(["(model)", "embed", "layers", "0", "1", "norm"]);
  });

  it("greys every action once the model is gone in the kernel", () => {
    const { root, model } = mount(smallTree());
    model.set("error", "The model this widget showed is gone.");
    model.set("model_gone", true);
    const actions = [...root.querySelectorAll<HTMLButtonElement>(".jmi-actions .jmi-btn")];
    expect(actions.length).toBeGreaterThan(0);
    expect(actions.every((b) => b.disabled || b.classList.contains("jmi-disabled"))).toBe(true);
    expect(root.querySelector<HTMLElement>(".jmi-message")!.hidden).toBe(false);
    expect(root.querySelector<HTMLInputElement>(".jmi-rows .jmi-check")!.disabled).toBe(true);
  });

  it("filters as one types", () => {
    const { root } = mount(bigTree());
    const input = root.querySelector<HTMLInputElement>(".jmi-search")!;
    input.value = "lm_head";
    input.dispatchEvent(new Event("input"));
    expect(rowNames(root)).toEqual(["(model)", "lm_head"]);
  });

  it("is an ARIA tree that the keyboard moves, opens and ticks, keeping focus", () => {
    const { root, model, view } = mount(smallTree());
    const tree = root.querySelector<HTMLElement>("[role=tree]")!;
    const focused = () => document.activeElement as HTMLElement;
    const key = (k: string) => focused().dispatchEvent(new KeyboardEvent("keydown", { key: k, bubbles: true }));
    tree.querySelector<HTMLElement>("[role=treeitem][tabindex='0']")!.focus();
    expect(focused().dataset.node).toBe("0");
    key("ArrowDown");
    key("ArrowDown");
    expect(focused().dataset.node).toBe("2");
    expect(focused().getAttribute("aria-expanded")).toBe("false");
    key("ArrowRight"); // opens
    expect(focused().getAttribute("aria-expanded")).toBe("true");
    key("ArrowRight"); // into the first child
    expect(focused().dataset.node).toBe("3");
    key(" "); // ticks, and the re-rendered row keeps the focus
    expect(model.state.selected).toEqual(["layers.0"]);
    expect(focused().dataset.node).toBe("3");
    expect(focused().getAttribute("aria-selected")).toBe("true");
    key("ArrowLeft"); // to the parent
    expect(focused().dataset.node).toBe("2");
    key("End");
    expect(focused().dataset.node).toBe("9");
    key("Home");
    expect(focused().dataset.node).toBe("0");
    expect(view.focusNode).toBe(0);
  });

  it("says the tie in a tied row's title and accessible name, and its chip names the holder's last part", () => {
    const tree = smallTree();
    tree.nodes[5][ROW.tied] = [1]; // layers.0.mlp shares embed's tensor
    tree.nodes[1][ROW.tied] = [5];
    const { root } = mount(tree, { expand_depth: 3 });
    expect(rowOfNode(root, 5).getAttribute("aria-label")).toContain("layers.0.mlp, Linear, 80 B, deferred, tied to embed");
    expect(rowOfNode(root, 5).title).toBe("tied to embed");
    expect(rowOfNode(root, 1).querySelector(".jmi-tied")!.textContent).toBe("tied: mlp");
  });

  it("marks a tied leaf with an icon in its empty caret slot and a tied parent before its name", () => {
    const tree = smallTree();
    tree.nodes[2][ROW.tied] = [1]; // layers (a parent) and embed (a leaf) share a tensor
    tree.nodes[1][ROW.tied] = [2];
    const { root } = mount(tree);
    const leaf = rowOfNode(root, 1).querySelector<HTMLElement>(".jmi-c-name")!;
    expect([...leaf.children].map((c) => c.className).slice(0, 2)).toEqual(["jmi-caret jmi-leaf jmi-tie-mark", "jmi-name"]);
    expect(leaf.querySelector(".jmi-tie-mark svg")!.getAttribute("aria-hidden")).toBe("true");
    expect(leaf.querySelector<HTMLElement>(".jmi-tie-mark")!.title).toContain("Shares a tensor with layers");
    const parent = rowOfNode(root, 2).querySelector<HTMLElement>(".jmi-c-name")!;
    expect([...parent.children].map((c) => c.className).slice(0, 3)).toEqual(["jmi-caret", "jmi-tie-mark", "jmi-name"]);
  });

  it("writes a ×N chip as its key and its rest, and says the blocks in the row's accessible name", () => {
    const { root } = mount(smallTree());
    const chip = rowOfNode(root, 2).querySelector<HTMLElement>(".jmi-chip")!;
    expect([...chip.children].map((c) => c.textContent)).toEqual(["×2", ", identical"]);
    expect(chip.title).toBe("2 identical Block blocks");
    expect(rowOfNode(root, 2).getAttribute("aria-label")).toContain(", 2 identical Block blocks");
  });

  it("names tied modules and counts shares once", () => {
    const tree = smallTree();
    tree.nodes[1][ROW.tied] = [9];
    tree.nodes[9][ROW.tied] = [1];
    tree.nodes[9][ROW.share_bytes] = 0; // the tied tensor is attributed to embed
    const { root } = mount(tree);
    const chips = [...root.querySelectorAll(".jmi-tied")].map((c) => c.textContent);
    expect(chips).toEqual(["tied: norm", "tied: embed"]);
    const pcts = [...root.querySelectorAll(".jmi-rows .jmi-pct")].map((p) => p.textContent);
    expect(pcts[3]).toBe("0%");
  });

  it("shows the dtype and the target device of deferred parts", () => {
    const tree = smallTree();
    tree.nodes[0][ROW.dtype] = "bf16";
    tree.nodes[0][ROW.target] = "cuda:0";
    const { root } = mount(tree);
    expect(root.querySelector(".jmi-totals .jmi-dtype")!.textContent).toBe("bf16");
    expect(root.querySelector(".jmi-totals .jmi-badge")!.textContent).toBe("deferred → cuda:0");
  });

  it("marks the parts whose values come from a checkpoint file", () => {
    const tree = smallTree();
    tree.nodes[1][ROW.source] = "checkpoint";
    tree.nodes[0][ROW.source] = "mixed";
    const { root } = mount(tree);
    const tags = [...root.querySelectorAll(".jmi-rows .jmi-source")].map((t) => t.textContent);
    expect(tags).toEqual(["file+init", "file"]);
  });

  it("tells what else a tied selection makes real", () => {
    const { root, model } = mount(smallTree());
    model.set("selected", ["embed"]);
    model.set("selection", { params: 100, bytes: 400, states: { deferred: 400 }, also: ["norm"] });
    expect(root.querySelector(".jmi-also")!.textContent).toBe("also makes norm real (tied)");
  });

  it("shows a refused request briefly, beside the last action's message", () => {
    vi.useFakeTimers();
    const { root, model } = mount(smallTree());
    model.set("status", "Materialized norm on cpu in 0.1 s.");
    model.set("notice", { id: 1, text: "Still busy with materialize cpu" });
    expect(root.querySelector<HTMLElement>(".jmi-notice")!.hidden).toBe(false);
    expect(root.querySelector(".jmi-message")!.textContent).toContain("Materialized");
    vi.advanceTimersByTime(6000);
    expect(root.querySelector<HTMLElement>(".jmi-notice")!.hidden).toBe(true);
    expect(root.querySelector<HTMLElement>(".jmi-message")!.hidden).toBe(false);
  });

  it("says so and disables actions when the kernel is gone", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    model.emit("comm_live_update");
    expect(root.querySelector<HTMLElement>(".jmi-disconnected")!.hidden).toBe(false);
    expect(root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!.getAttribute("aria-disabled")).toBe("true");
    expect(root.querySelector<HTMLInputElement>(".jmi-rows .jmi-check")!.disabled).toBe(true);
  });

  it("says it waits for a busy kernel, and clears that the moment the kernel answers", () => {
    vi.useFakeTimers();
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    const cpu = root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!;
    cpu.click();
    vi.advanceTimersByTime(5000); // a cell holds the kernel
    const waiting = root.querySelector<HTMLElement>(".jmi-waiting")!;
    expect(waiting.hidden).toBe(false);
    expect(waiting.textContent).toContain("Waiting for the kernel");
    vi.advanceTimersByTime(15000);
    expect(waiting.textContent).toContain("busy with a long cell");
    expect(root.querySelector<HTMLElement>(".jmi-disconnected")!.hidden).toBe(true);
    cpu.click(); // no second action while the first waits
    expect(model.sent.length).toBe(1);
    model.emit("msg:custom", { kind: "ack", id: 1 });
    expect(waiting.hidden).toBe(true);
    expect(cpu.getAttribute("aria-disabled")).toBe("false");
  });

  it("says which action waits for a busy kernel and hides the last action's message meanwhile", () => {
    vi.useFakeTimers();
    const { root, model } = mount(smallTree(), { selected: ["norm"], status: "Materialized norm on cpu in 5 ms." });
    model.set("selected", ["norm"]);
    root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!.click();
    vi.advanceTimersByTime(2000);
    expect(root.querySelector(".jmi-waiting")!.textContent).toContain("your Materialize → cpu is queued");
    expect(root.querySelector<HTMLElement>(".jmi-message")!.hidden).toBe(true);
  });

  it("says a tick went unanswered, and after 10 s that the kernel may be shut down", () => {
    vi.useFakeTimers();
    const { root, model } = mount(smallTree());
    const norm = root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")[3];
    norm.querySelector<HTMLInputElement>(".jmi-check")!.click();
    expect(model.sent.map((m) => m.action)).toEqual(["ping"]);
    const waiting = root.querySelector<HTMLElement>(".jmi-waiting")!;
    vi.advanceTimersByTime(2000);
    expect(waiting.hidden).toBe(false);
    vi.advanceTimersByTime(10000);
    expect(waiting.textContent).toContain("shut down: if the notebook shows no kernel, start one");
    model.emit("msg:custom", { kind: "ack", id: model.sent[0].id });
    expect(waiting.hidden).toBe(true);
  });

  it("says the model went with a restarted kernel, and that a closed widget needs no rebuild", () => {
    const a = mount(smallTree());
    a.model.emit("comm_live_update");
    expect(a.root.querySelector(".jmi-disconnected")!.textContent).toContain("Run the cells that build");
    const b = mount(smallTree());
    b.model.emit("comm:close");
    expect(b.root.querySelector(".jmi-disconnected")!.textContent).toContain("no need to rebuild");
  });

  it("keeps keys pressed inside the widget from reaching the notebook, and Escape leaves", () => {
    const cell = document.createElement("div");
    cell.className = "jp-Cell";
    cell.tabIndex = -1;
    document.body.append(cell);
    const model = new FakeModel(smallTree());
    const root = document.createElement("div");
    cell.append(root);
    new TreeView(model, root);
    const reached: string[] = [];
    const onDoc = (ev: KeyboardEvent) => reached.push(ev.key);
    document.addEventListener("keydown", onDoc, true);
    document.addEventListener("keydown", onDoc);
    try {
      const row = root.querySelector<HTMLElement>("[role=treeitem][tabindex='0']")!;
      row.focus();
      for (const k of ["a", "b", "m", "y", "d", "x", "c", "v", "z", "Enter"]) {
        row.dispatchEvent(new KeyboardEvent("keydown", { key: k, bubbles: true, shiftKey: k === "Enter" }));
      }
      const search = root.querySelector<HTMLInputElement>(".jmi-search")!;
      search.dispatchEvent(new KeyboardEvent("keydown", { key: "a", bubbles: true }));
      expect(reached).toEqual([]);
      (document.activeElement as HTMLElement).dispatchEvent(new KeyboardEvent("keydown", { key: "Escape", bubbles: true }));
      expect(document.activeElement).toBe(cell);
    } finally {
      document.removeEventListener("keydown", onDoc, true);
      document.removeEventListener("keydown", onDoc);
    }
  });

  it("keeps focus on an action button through the action's re-renders", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    const cpu = root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!;
    cpu.focus();
    cpu.click();
    model.set("busy", "materialize cpu");
    model.emit("msg:custom", { kind: "ack", id: 1 });
    model.set("busy", "");
    model.set("selection", { states: { cpu: 20 } });
    expect(document.activeElement).toBe(cpu);
    expect(root.querySelector(".jmi-mat-cpu")).toBe(cpu);
  });

  it("marks rows holding fast-RNG values", () => {
    const { root, model } = mount(smallTree());
    model.emit("msg:custom", { kind: "patch", nodes: [[9, 5, 20, "cpu", "fp32", 20, "", "", "fast"]] });
    const norm = [...root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")][3];
    expect(norm.querySelector(".jmi-fast")!.textContent).toBe("fast");
    expect(root.querySelectorAll(".jmi-fast").length).toBe(1);
  });

  it("offers each row's path as code the magics take", () => {
    expect(codePath("model", "model.layers.5")).toBe("model.model.layers[5]");
    expect(codePath("m", "")).toBe("m");
    expect(codePath("m", "blocks.a-b")).toBe('m.get_submodule("blocks.a-b")');
    const { root } = mount(smallTree(), { var_name: "net" });
    const layers = [...root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")][2];
    expect(layers.querySelector<HTMLElement>(".jmi-name")!.title).toBe("layers");
    expect(layers.querySelector<HTMLElement>(".jmi-copy")!.dataset.code).toBe("net.layers");
  });

  it("says why the table is empty once the kernel is gone", () => {
    const { root, model } = mount(smallTree(), { show_table: true, table_html: "" });
    model.emit("comm_live_update");
    expect(root.querySelector(".jmi-table")!.textContent).toContain("kernel, which is gone");
  });

  it("disables Materialize with the reason when the selection does not fit", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    model.set("selection", { bytes: 20, fit: { cpu: { fits: false, need: 2 ** 30, free: 2 ** 20 } } });
    const cpu = root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!;
    expect(cpu.getAttribute("aria-disabled")).toBe("true");
    expect(cpu.title).toContain("Does not fit");
    cpu.click();
    expect(model.sent).toEqual([]);
  });

  it("draws the copy-path button as an SVG icon with a label, not a font glyph", () => {
    const { root } = mount(smallTree(), { var_name: "net" });
    const copy = root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row .jmi-copy")[2];
    expect(copy.textContent).toBe("");
    expect(copy.querySelector("svg")!.getAttribute("aria-hidden")).toBe("true");
    expect(copy.getAttribute("aria-label")).toBe("Copy net.layers");
  });

  it("says by how much a selection misses the device, in the summary text", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    model.set("selection", { bytes: 20, fit: { cpu: { fits: false, need: 4 * 2 ** 40, free: 20 * 2 ** 30 } } });
    expect(root.querySelector(".jmi-nofit")!.textContent).toBe(
      "too big for cpu: needs 4.00 TiB, 20.0 GiB free on cpu",
    );
  });

  it("gives a disabled Materialize's reason to the keyboard through aria-describedby", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    model.set("selected", ["norm"]);
    model.set("selection", { bytes: 20, fit: { cpu: { fits: false, need: 4 * 2 ** 40, free: 20 * 2 ** 30 } } });
    const cpu = root.querySelector<HTMLButtonElement>(".jmi-mat-cpu")!;
    const described = document.getElementById(cpu.getAttribute("aria-describedby")!)!;
    expect(root.contains(described)).toBe(true);
    expect(described.textContent).toContain("Does not fit: the selection needs 4.00 TiB, 20.0 GiB free on cpu");
    model.set("selection", { bytes: 20, fit: { cpu: { fits: true, need: 20, free: 20 * 2 ** 30 } } });
    expect(described.textContent).toBe("Allocate the selected subtrees on the CPU and compute their values (key on a tree row: m)");
  });

  it("scrolls the filter's first match into view", () => {
    const { root, view } = mount(bigTree());
    const scroller = root.querySelector<HTMLElement>(".jmi-scroll")!;
    Object.defineProperty(scroller, "clientHeight", { value: 18 * 26 });
    view.setQuery("lm_head");
    expect(view.rows.findIndex((r) => r.match)).toBeGreaterThan(0);
    view.setQuery("79.mlp.down_proj");
    const first = view.rows.findIndex((r) => r.match);
    expect(scroller.scrollTop).toBe(Math.max(0, (first + 1) * 26 - 18 * 26));
    expect(view.focusNode).toBe(view.rows[first].node);
  });
});

/** A plan of smallTree over two devices: embed on cuda:0, layers and norm on cuda:1 (over). */
function twoDevicePlan(fits = true) {
  return {
    devices: [
      { name: "cuda:0", peak: 600, capacity: 1024, fits: true, parts: 1 },
      { name: "cuda:1", peak: fits ? 500 : 2048, capacity: 1024, fits, parts: 3 },
    ],
    nodes: [-2, 0, 1, 1, 1, 1, 1, 1, 1, 1],
    fits,
    headline: `inference, batch 1, seq_len 8: ${fits ? "fits" : "does not fit"}`,
    pins: {},
  };
}

const deviceCells = (root: HTMLElement) =>
  [...root.querySelectorAll(".jmi-rows .jmi-c-device")].map((e) => e.textContent);

describe("tags beside a name", () => {
  it("come most important first, after an empty item that lets even the first one wrap away", () => {
    const { root, model } = mount(smallTree());
    model.set("tree", { ...smallTree(), nodes: smallTree().nodes.map((r, i) => {
      const row = [...r] as typeof r;
      if (i === 2) {
        row[ROW.tied] = [9];
        row[ROW.values] = "fast";
      }
      return row;
    }) });
    const box = root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-row")[2].querySelector(".jmi-tags")!;
    expect([...box.children].map((c) => c.textContent)).toEqual(["", "tied: norm", "×2, identical"]);
    expect(box.firstElementChild!.className).toBe("jmi-tags-spacer");
    // the fast tag is never wrapped away: it sits before the chips, outside their box
    expect(box.previousElementSibling!.textContent).toBe("fast");
    // each chip's key and rest are items of their own (style.css: each shows whole or goes)
    const parts = [...box.querySelectorAll<HTMLElement>(".jmi-chip > span")].map((c) => c.className);
    expect(parts).toEqual(["jmi-chip-key", "jmi-chip-rest", "jmi-chip-key", "jmi-chip-rest"]);
  });
});

describe("Plan and Save", () => {
  it("shows a device column, one colour per device, once a plan arrives", () => {
    const { root, model } = mount(smallTree());
    expect(root.querySelector(".jmi-rows .jmi-c-device")).toBeNull();
    model.set("plan", twoDevicePlan());
    expect(root.querySelector(".jmi-root")!.classList.contains("jmi-planned")).toBe(true);
    expect(deviceCells(root)).toEqual(["split", "cuda:0", "cuda:1", "cuda:1"]);
    const chips = [...root.querySelectorAll<HTMLElement>(".jmi-rows .jmi-devchip")].slice(1, 3);
    const [c0, c1] = chips.map((c) => c.style.getPropertyValue("--jmi-dev"));
    expect(c0).not.toBe(c1);
  });

  it("says in words that a part on a device over capacity does not fit", () => {
    const { root, model } = mount(smallTree());
    model.set("plan", twoDevicePlan(false));
    expect(deviceCells(root)).toContain("cuda:1 over");
    const head = root.querySelector(".jmi-planhead")!;
    expect(head.textContent).toContain("does not fit");
    expect(head.textContent).toContain("over by 1.00 KiB");
  });

  it("draws one bar per device in the header, predicted peak against capacity", () => {
    const { root, model } = mount(smallTree());
    model.set("plan", twoDevicePlan());
    const bars = [...root.querySelectorAll<HTMLElement>(".jmi-planhead .jmi-devbar")];
    expect(bars.map((b) => b.querySelector(".jmi-devbar-text")!.textContent)).toEqual([
      "600 B / 1.00 KiB (59%)",
      "500 B / 1.00 KiB (49%)",
    ]);
    expect(bars[0].querySelector<HTMLElement>(".jmi-devbar-fill")!.style.width).toBe("58.6%");
  });

  it("sends the typed devices, batch, seq len and workload when Plan is submitted", () => {
    const { root, model, view } = mount(smallTree());
    root.querySelector<HTMLButtonElement>(".jmi-plan-toggle")!.click();
    expect(view.planBar.el.hidden).toBe(false);
    view.planBar.devices.value = "cuda:0=80GiB, cuda:1=80GiB";
    view.planBar.batch.value = "4";
    view.planBar.seqLen.value = "4096";
    view.planBar.mode.value = "training";
    view.planBar.el.dispatchEvent(new Event("submit", { cancelable: true }));
    expect(model.sent).toEqual([
      { action: "plan", devices: "cuda:0=80GiB, cuda:1=80GiB", batch: 4, seq_len: 4096, training: true, inputs: null, precision: null, id: 1 },
    ]);
  });

  it("sends the Inputs' shapes typed instead of a Seq len", () => {
    const { model, view } = mount(smallTree());
    view.planBar.devices.value = "cpu=8GiB";
    view.planBar.inputs.value = " (8, 3, 224, 224) ";
    view.planBar.el.dispatchEvent(new Event("submit", { cancelable: true }));
    expect(model.sent).toEqual([
      { action: "plan", devices: "cpu=8GiB", batch: 1, seq_len: null, training: false, inputs: "(8, 3, 224, 224)", precision: null, id: 1 },
    ]);
  });

  it("pins the selected parts to the device chosen in the plan bar", () => {
    const { model, view } = mount(smallTree(), { selected: ["norm"] });
    model.set("plan", twoDevicePlan());
    view.planBar.pinSel.value = "cuda:0";
    view.planBar.pinBtn.click();
    expect(model.sent).toEqual([{ action: "pin", device: "cuda:0", names: ["norm"], id: 1 }]);
  });

  it("offers Materialize plan only once there is a plan", () => {
    const { model, view } = mount(smallTree(), { devices: [{ name: "cuda:0", label: "" }, { name: "cuda:1", label: "" }] });
    view.planBar.matBtn.click();
    expect(model.sent).toEqual([]);
    model.set("plan", twoDevicePlan());
    view.planBar.matBtn.click();
    expect(model.sent).toEqual([{ action: "materialize_plan", id: 1 }]);
  });

  it("says why Materialize plan is unavailable when the plan uses devices this kernel lacks", () => {
    const { model, view } = mount(smallTree());
    model.set("plan", twoDevicePlan());
    view.planBar.matBtn.click();
    expect(model.sent).toEqual([]);
    expect(view.planBar.matBtn.title).toContain("This kernel has no cuda:0, cuda:1");
  });

  it("gives the plan bar's reasons to the keyboard too, in the widget", () => {
    const { root, model, view } = mount(smallTree());
    model.set("plan", twoDevicePlan());
    const described = document.getElementById(view.planBar.matBtn.getAttribute("aria-describedby")!)!;
    expect(root.contains(described)).toBe(true);
    expect(described.textContent).toContain("This kernel has no cuda:0, cuda:1");
  });

  it("says the whole model when the root is the one ticked subtree", () => {
    const { root } = mount(smallTree(), { selected: [""] });
    expect(root.querySelector(".jmi-save-what")!.textContent).toBe("the whole model");
  });

  it("keeps a device's 'over' whole however narrow its column", () => {
    const { root, model } = mount(smallTree());
    model.set("plan", { ...twoDevicePlan(), devices: twoDevicePlan().devices!.map((d) => ({ ...d, fits: false })) });
    const tag = root.querySelector(".jmi-dev-over .jmi-dev-overtag");
    expect(tag?.textContent).toBe(" over");
  });

  it("sends the path and format to save, and refuses two selected subtrees", () => {
    const { model, view } = mount(smallTree(), { selected: ["norm", "embed"] });
    view.saveBar.path.value = "ckpt";
    view.saveBar.format.value = "dcp";
    view.saveBar.el.dispatchEvent(new Event("submit", { cancelable: true }));
    expect(model.sent).toEqual([]);
    model.set("selected", ["norm"]);
    view.saveBar.el.dispatchEvent(new Event("submit", { cancelable: true }));
    expect(model.sent).toEqual([{ action: "save", path: "ckpt", format: "dcp", names: ["norm"], id: 1 }]);
  });
});

/** The focused element, and a key pressed on it as the browser sends it. */
const focused = () => document.activeElement as HTMLElement;
function press(key: string, init: KeyboardEventInit = {}): void {
  focused().dispatchEvent(new KeyboardEvent("keydown", { key, bubbles: true, ...init }));
}
const tick = () => new Promise((r) => setTimeout(r, 0));
const rowOfNode = (root: HTMLElement, node: number) => root.querySelector<HTMLElement>(`.jmi-rows [data-node="${node}"]`)!;

describe("focus and keys", () => {
  it("puts focus back on the tree row when Cancel goes away with the action it cancelled", async () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    rowOfNode(root, 9).focus();
    model.set("busy", "materialize cpu");
    const cancel = root.querySelector<HTMLButtonElement>(".jmi-cancel")!;
    cancel.focus();
    cancel.click();
    model.emit("msg:custom", { kind: "ack", id: 1 });
    model.set("busy", "");
    await tick();
    expect(focused().getAttribute("role")).toBe("treeitem");
    expect(focused().dataset.node).toBe("9");
  });

  it("declares every action's key on its button and says it in its tooltip", () => {
    const { root, model, view } = mount(smallTree(), { selected: ["norm"] });
    model.set("plan", twoDevicePlan());
    const buttons = [
      ...root.querySelectorAll<HTMLButtonElement>(".jmi-actions .jmi-btn"),
      view.planBar.matBtn, view.planBar.pinBtn, view.planBar.unpinBtn,
      root.querySelector<HTMLButtonElement>(".jmi-cancel")!,
      root.querySelector<HTMLButtonElement>(".jmi-table-toggle")!,
      view.valuesPanel.columnsBtn,
    ];
    const keys = buttons.map((b) => b.getAttribute("aria-keyshortcuts"));
    expect(keys).toEqual(["M", "G", "F", "V", "P", "S", "D", "Shift+M", "Shift+P", "U", "X", "T", "Shift+V"]);
    for (const b of buttons) expect(b.title).toMatch(/\(key on a tree row: [^)]+\)$/);
    expect(root.querySelector(".jmi-rows .jmi-copy")!.getAttribute("aria-keyshortcuts")).toBe("C");
  });

  it("runs an action from its key on a row, on the ticked rows, and the row keeps the focus", () => {
    const { root, model } = mount(smallTree(), { selected: ["norm"] });
    rowOfNode(root, 1).focus();
    press("m");
    expect(model.sent).toEqual([{ action: "materialize", device: "cpu", names: ["norm"], id: 1 }]);
    expect(focused().dataset.node).toBe("1");
  });

  it("runs an action on the focused row when nothing is ticked", () => {
    const { root, model } = mount(smallTree());
    rowOfNode(root, 1).focus();
    press("m");
    expect(model.sent).toEqual([{ action: "materialize", device: "cpu", names: ["embed"], id: 1 }]);
    expect(focused().dataset.node).toBe("1");
  });

  it("says why an action's key cannot run, and sends nothing", () => {
    const { root, model } = mount(smallTree());
    rowOfNode(root, 1).focus();
    press("f");
    expect(model.sent).toEqual([]);
    expect(root.querySelector(".jmi-notice")!.textContent).toBe("Free: Nothing in embed is materialized");
    press("g");
    expect(root.querySelector(".jmi-notice")!.textContent).toBe("Materialize → cuda: no GPU here");
    expect(focused().dataset.node).toBe("1");
  });

  it("frees the focused row from its key once it is real", () => {
    const { root, model } = mount(smallTree());
    model.emit("msg:custom", { kind: "patch", nodes: [[9, 5, 20, "cpu"]] });
    rowOfNode(root, 9).focus();
    press("f");
    expect(model.sent).toEqual([{ action: "free", names: ["norm"], id: 1 }]);
  });

  it("never collapses a row on Shift+Enter, and says what to do instead", () => {
    const { root, view } = mount(smallTree());
    rowOfNode(root, 0).focus();
    press("Enter", { shiftKey: true });
    expect(view.rows.length).toBe(4); // still open
    expect(root.querySelector(".jmi-notice")!.textContent).toContain("press Escape to go back to the notebook");
    expect(focused().dataset.node).toBe("0");
  });

  it("opens Plan… from its key with focus in the bar, and Escape brings focus back to the row", () => {
    const { root, view } = mount(smallTree());
    rowOfNode(root, 2).focus();
    press("p");
    expect(view.planBar.el.hidden).toBe(false);
    expect(focused()).toBe(view.planBar.devices);
    press("Escape");
    expect(view.planBar.el.hidden).toBe(true);
    expect(focused().dataset.node).toBe("2");
  });

  it("cancels the running action from its key", () => {
    const { root, model } = mount(smallTree());
    model.set("busy", "materialize cpu");
    rowOfNode(root, 1).focus();
    press("x");
    expect(model.sent).toEqual([{ action: "cancel", id: 1 }]);
    expect(focused().dataset.node).toBe("1");
  });

  it("lists every key on ?", () => {
    const { root } = mount(smallTree());
    rowOfNode(root, 1).focus();
    press("?", { shiftKey: true });
    const text = root.querySelector(".jmi-notice")!.textContent!;
    for (const part of ["m Materialize → CPU", "f Free", "x Cancel", "p Plan…", "s Save…", "Shift+M Materialize plan", "c Copy"]) {
      expect(text).toContain(part);
    }
  });

  it("makes the action bar one Tab stop, the arrows moving inside it", () => {
    const { root } = mount(smallTree());
    const bar = root.querySelector<HTMLElement>(".jmi-actions")!;
    expect(bar.getAttribute("role")).toBe("toolbar");
    const stops = [...bar.querySelectorAll<HTMLElement>("button, select")].filter((el) => el.tabIndex === 0);
    expect(stops.map((el) => el.textContent)).toEqual(["Materialize → CPU"]);
    stops[0].focus();
    press("ArrowRight");
    expect(focused().textContent).toBe("→ cuda");
    expect(focused().getAttribute("aria-label")).toBe("Materialize → cuda");
    expect(focused().tabIndex).toBe(0);
    expect(stops[0].tabIndex).toBe(-1);
  });

  it("groups the action bar: materialize and free per GPU, the tools, then the options", () => {
    const devices = [0, 1].map((i) => ({ name: `cuda:${i}`, label: "GPU" }));
    const { root } = mount(smallTree(), { devices });
    const groups = [...root.querySelectorAll<HTMLElement>(".jmi-actions > .jmi-group")];
    const texts = groups.map((g) => [...g.querySelectorAll("button")].map((b) => b.textContent));
    expect(texts).toEqual([
      ["Materialize → CPU", "→ cuda:0", "→ cuda:1", "Free"],
      ["Values", "Plan…", "Save…", "Compare with…"],
      [],
    ]);
    expect(groups[2].querySelectorAll("select").length).toBeGreaterThan(0);
    expect(groups[1].nextElementSibling!.classList.contains("jmi-sep")).toBe(true);
  });

  it("keeps the focused row in the page when it is scrolled out of view", () => {
    const { root, view } = mount(bigTree());
    view.expandToDepth(99);
    const row = root.querySelector<HTMLElement>(".jmi-rows [data-node='0']")!;
    row.focus();
    const scroller = root.querySelector<HTMLElement>(".jmi-scroll")!;
    scroller.scrollTop = 400 * 26;
    view.renderRows();
    expect(focused().dataset.node).toBe("0");
  });
});

describe("a widget that lost its kernel", () => {
  it("turns every control off, greys the tree and moves focus to its banner", () => {
    const { root, model, view } = mount(smallTree(), { selected: ["norm"], devices: [{ name: "cpu", label: "" }] });
    model.set("plan", { ...twoDevicePlan(), devices: [{ name: "cpu", peak: 1, capacity: 2, fits: true, parts: 1 }], nodes: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0] });
    rowOfNode(root, 1).focus();
    model.emit("comm_live_update");
    expect(root.querySelector(".jmi-root")!.classList.contains("jmi-off")).toBe(true);
    for (const sel of [".jmi-tools", ".jmi-actions", ".jmi-planbar", ".jmi-savebar", ".jmi-scroll"]) {
      expect(root.querySelector(sel)!.hasAttribute("inert")).toBe(true);
    }
    for (const b of root.querySelectorAll<HTMLButtonElement>(".jmi-btn")) {
      expect(b.disabled || b.closest("[inert]") !== null).toBe(true);
    }
    expect(view.planBar.matBtn.disabled).toBe(true);
    expect(view.planBar.matBtn.getAttribute("aria-disabled")).toBe("true");
    expect(focused()).toBe(root.querySelector(".jmi-disconnected"));
  });

  it("a running action's progress line says it stopped when the kernel dies, and Cancel goes", () => {
    const { root, model } = mount(smallTree());
    model.set("busy", "measure the values");
    model.set("progress", [0, 1024]);
    model.set("phase", "computing the statistics of the values");
    const cancel = root.querySelector<HTMLButtonElement>(".jmi-cancel")!;
    expect(cancel.hidden).toBe(false);
    model.emit("comm_live_update");
    expect(root.querySelector(".jmi-progress-text")!.textContent).toBe("measure the values: stopped, the kernel died or was restarted.");
    expect(cancel.hidden).toBe(true);
  });

  it("says so when the notebook's kernel shuts down, with no message from it", () => {
    const session = fakeSession("idle");
    const { root } = mount(smallTree(), {}, { context: { sessionContext: session }, kernel: session.session.kernel });
    session.statusChanged.emit("dead");
    expect(root.querySelector<HTMLElement>(".jmi-disconnected")!.hidden).toBe(false);
    expect(root.querySelector(".jmi-disconnected")!.textContent).toContain("The kernel was restarted or stopped");
  });

  it("says a tree its kernel does not know is not connected, and only waits for a busy kernel", async () => {
    vi.useFakeTimers();
    const answering = fakeSession("idle", true);
    const a = mount(smallTree(), {}, { context: { sessionContext: answering }, kernel: answering.session.kernel });
    expect(a.model.sent.map((m) => m.action)).toEqual(["ping"]); // the ping goes nowhere
    await vi.advanceTimersByTimeAsync(2000);
    expect(a.root.querySelector(".jmi-disconnected")!.textContent).toContain("not connected to a kernel");
    const busy = fakeSession("idle", false); // a cell holds the kernel: no answer at all yet
    const b = mount(smallTree(), {}, { context: { sessionContext: busy }, kernel: busy.session.kernel });
    await vi.advanceTimersByTimeAsync(20000);
    expect(b.root.querySelector<HTMLElement>(".jmi-disconnected")!.hidden).toBe(true);
    expect(b.root.querySelector<HTMLElement>(".jmi-waiting")!.hidden).toBe(false);
    const live = fakeSession("idle", true); // a kernel that knows the widget acknowledges it
    const c = mount(smallTree(), {}, { context: { sessionContext: live }, kernel: live.session.kernel });
    c.model.emit("msg:custom", { kind: "ack", id: c.model.sent[0].id });
    await vi.advanceTimersByTimeAsync(5000);
    expect(c.root.querySelector<HTMLElement>(".jmi-disconnected")!.hidden).toBe(true);
  });
});

describe("Plan… precision and pins", () => {
  it("sends the precision chosen in the plan bar", () => {
    const { model, view } = mount(smallTree());
    view.planBar.devices.value = "cpu=8GiB";
    view.planBar.seqLen.value = "16";
    view.planBar.precision.value = "bf16-mixed";
    view.planBar.el.dispatchEvent(new Event("submit", { cancelable: true }));
    expect(model.sent[0].precision).toBe("bf16-mixed");
    expect([...view.planBar.precision.options].map((o) => o.textContent)).toEqual(["as built", "bf16", "fp32", "bf16-mixed"]);
  });

  it("marks pinned rows with a pin beside their device", () => {
    const { root, model } = mount(smallTree());
    model.set("plan", { ...twoDevicePlan(), pins: { norm: "cuda:0" } });
    const norm = rowOfNode(root, 9);
    expect(norm.querySelector(".jmi-pin-mark svg")).not.toBeNull();
    expect(norm.querySelector(".jmi-pin-mark")!.textContent).toBe("pinned to cuda:0");
    expect(norm.getAttribute("aria-label")).toContain("pinned to cuda:0");
    expect(rowOfNode(root, 1).querySelector(".jmi-pin-mark")).toBeNull();
  });
});

/** A notebook session as JupyterLab's widget manager holds it: a kernel status and the two
 *  signals the widget follows (an in-memory stand-in with Lumino's connect/emit shape). */
class Signal {
  private slots: Array<(sender: unknown, value: unknown) => void> = [];
  connect(slot: (sender: unknown, value: unknown) => void) { this.slots.push(slot); return true; }
  disconnect(slot: (sender: unknown, value: unknown) => void) { this.slots = this.slots.filter((s) => s !== slot); return true; }
  emit(value: unknown) { for (const s of this.slots) s(this, value); }
}
function fakeSession(status: string, answers = true) {
  const requestKernelInfo = () => (answers ? Promise.resolve({}) : new Promise(() => undefined));
  return { statusChanged: new Signal(), kernelChanged: new Signal(), session: { kernel: { status, requestKernelInfo } } };
}

afterEach(() => {
  vi.useRealTimers();
  document.body.replaceChildren();
});

describe("Values", () => {
  const measured = {
    id: 1,
    fields: ["mean", "std", "absmax", "l2", "nan", "inf"],
    modules: [[0, 0, 0.5, 2, 9, 1, 0], [3, 0, 0.25, 1, 3, 0, 0], [4, 0, 0.25, 1, 3, 0, 0], [7, 0, null, 1, 3, 1, 0]],
    tensors: [
      ["layers.0.attn.weight", 4, 0, 0.25, 1, 3, 0, 0, -1, 1, [1, 2, 3]],
      ["layers.1.attn.weight", 7, 0, null, 1, 3, 1, 0, -1, 1, [1, 0, 3]],
    ],
  };

  it("v on a row measures the ticked rows; the button with none ticked, the whole model", () => {
    const { root, model } = mount(smallTree(), { selected: ["layers"] });
    rowOfNode(root, 1).focus();
    press("v");
    expect(model.sent.at(-1)).toMatchObject({ action: "values", names: ["layers"] });
    const other = mount(smallTree());
    other.root.querySelector<HTMLButtonElement>(".jmi-values")!.click();
    expect(other.model.sent.at(-1)).toMatchObject({ action: "values", names: [] });
  });

  it("shows std and absmax columns once values exist, and flags NaN rows in red", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    expect(root.querySelector(".jmi-values-panel")!.hasAttribute("hidden")).toBe(true);
    model.set("values", measured);
    expect(root.classList.contains("jmi-valued") || root.querySelector(".jmi-valued")).toBeTruthy();
    expect(rowOfNode(root, 3).querySelector(".jmi-c-std")!.textContent).toBe("0.25");
    expect(rowOfNode(root, 7).querySelector(".jmi-bad")!.textContent).toBe("NaN");
    expect(rowOfNode(root, 7).getAttribute("aria-label")).toMatch(/holds 1 NaN value$/);
    expect(rowOfNode(root, 4).querySelector(".jmi-bad")).toBeNull();
  });

  it("says NaN in the std cell of a row whose std NaN makes undefined", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    model.set("values", measured);
    expect(rowOfNode(root, 7).querySelector(".jmi-c-std .jmi-bad-val")!.textContent).toBe("NaN");
    expect(rowOfNode(root, 3).querySelector(".jmi-c-std .jmi-bad-val")).toBeNull();
  });

  it("Shift+V hides and shows the value columns; the NaN flag stays", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    model.set("values", measured);
    rowOfNode(root, 7).focus();
    press("V", { shiftKey: true });
    expect(rowOfNode(root, 7).querySelector(".jmi-c-std")).toBeNull();
    expect(rowOfNode(root, 7).querySelector(".jmi-bad")).not.toBeNull();
    expect(focused().dataset.node).toBe("7");
  });

  it("charts the chosen statistic along the depth and the focused row's histogram", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    model.set("values", measured);
    const role = root.querySelector<HTMLSelectElement>(".jmi-role-sel")!;
    expect([...role.options].map((o) => o.value)).toEqual(["attn.weight"]);
    expect(root.querySelectorAll(".jmi-chart-box .jmi-dot").length).toBe(1); // layer 1: NaN, a gap
    rowOfNode(root, 4).focus();
    const hist = root.querySelector(".jmi-hist-box")!;
    expect(hist.textContent).toContain("layers.0.attn.weight");
    expect(hist.querySelectorAll("rect").length).toBe(3);
  });

  it("shows no depth controls, only why, when the measured tensors have no repeated blocks", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    model.set("values", { ...measured, tensors: [["norm.weight", 9, 0, 0.5, 2, 9, 0, 0, -1, 1, [4, 1]]] });
    expect(root.querySelector<HTMLElement>(".jmi-role-sel")!.hidden).toBe(true);
    expect(root.querySelector<HTMLElement>(".jmi-depth-ctl")!.hidden).toBe(true);
    expect(root.querySelector(".jmi-chart-box")!.textContent).toContain("No repeated blocks");
    model.set("values", measured); // blocks again: the controls come back
    expect(root.querySelector<HTMLElement>(".jmi-role-sel")!.hidden).toBe(false);
    expect(root.querySelector<HTMLElement>(".jmi-depth-ctl")!.hidden).toBe(false);
  });

  it("shows a tied leaf's histogram: the shared tensor Values measured under its first holder", () => {
    const tree = smallTree();
    tree.nodes[1][ROW.tied] = [9]; // embed and norm share one tensor, measured as embed.weight
    tree.nodes[9][ROW.tied] = [1];
    const { root, model } = mount(tree, { expand_depth: 3 });
    model.set("values", { ...measured, tensors: [["embed.weight", 1, 0, 0.5, 2, 9, 0, 0, -1, 1, [4, 1]]] });
    rowOfNode(root, 9).focus();
    const hist = root.querySelector(".jmi-hist-box")!;
    expect(hist.querySelector(".jmi-chart-title")!.textContent).toBe("Histogram of norm, tied to embed.weight (2 bins, finite values)");
    expect(hist.querySelectorAll("rect").length).toBe(2);
  });
});

describe("Compare with…", () => {
  it("d opens the bar in the input; Enter sends the comparison of the ticked rows; Esc goes back", () => {
    const { root, model } = mount(smallTree(), { selected: ["layers"] });
    rowOfNode(root, 2).focus();
    press("d");
    const input = root.querySelector<HTMLInputElement>(".jmi-compare-other")!;
    expect(document.activeElement).toBe(input);
    input.value = "finetuned/";
    root.querySelector<HTMLFormElement>(".jmi-comparebar")!.requestSubmit();
    expect(model.sent.at(-1)).toMatchObject({ action: "compare", other: "finetuned/", names: ["layers"] });
    press("Escape");
    expect(root.querySelector<HTMLElement>(".jmi-comparebar")!.hidden).toBe(true);
    expect(focused().dataset.node).toBe("2");
  });

  it("colours the rows by their worst difference, with the numbers in the tooltip and a legend", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    model.set("comparison", {
      id: 1, other: "base", tiny: 1e-3, kinds: [], tensors: [],
      modules: [[0, "large", 2, 0.5], [1, "equal", 0, 0], [4, "tiny", 1, 1e-5], [9, "missing", 1, null]],
    });
    expect(rowOfNode(root, 1).classList.contains("jmi-cmp-equal")).toBe(true);
    expect(rowOfNode(root, 4).classList.contains("jmi-cmp-tiny")).toBe(true);
    expect(rowOfNode(root, 0).title).toBe("vs base: large difference, 2 tensors differ, rel_l2 up to 0.5");
    expect(rowOfNode(root, 9).getAttribute("aria-label")).toContain("vs base: missing on one side");
    expect(root.querySelector<HTMLElement>(".jmi-legend")!.hidden).toBe(false);
    expect(rowOfNode(root, 2).className).not.toContain("jmi-cmp");
  });

  it("says a rel_l2 that is not finite as inf or NaN in the tooltip and the accessible name", () => {
    const { root, model } = mount(smallTree(), { expand_depth: 3 });
    model.set("comparison", {
      id: 1, other: "odd", tiny: 1e-3, kinds: [], tensors: [],
      modules: [[0, "large", 2, "nan"], [1, "large", 1, "inf"], [4, "large", 1, 0]],
    });
    expect(rowOfNode(root, 0).title).toBe("vs odd: large difference, 2 tensors differ, rel_l2 up to NaN (not finite)");
    expect(rowOfNode(root, 1).getAttribute("aria-label")).toContain("vs odd: large difference, 1 tensor differs, rel_l2 up to inf");
  });
});
