// The Values panel under the tree, once Values ran: the control that shows the value columns,
// a chart of one statistic along the depth (the role chosen among the repeated blocks' tensors),
// and the histogram of the focused row's tensor. Every control is a plain form control, reached
// with Tab; the charts are images with their numbers in their titles.

import { button, h } from "./dom";
import { depthChart, depthRoles, depthSeries, histogramChart, STATS, type StatName, tensorOf, type Values } from "./values";

export class ValuesPanel {
  readonly el = h("div", "jmi-values-panel");
  readonly columnsBtn: HTMLButtonElement;
  private readonly statSel = h("select", "jmi-select jmi-stat-sel");
  private readonly roleSel = h("select", "jmi-select jmi-role-sel");
  private readonly kindSel = h("select", "jmi-select jmi-kind-sel");
  private readonly chartEl = h("div", "jmi-chart-box");
  private readonly depthEl = h("span", "jmi-depth-ctl");
  private readonly histEl = h("div", "jmi-chart-box jmi-hist-box");
  private values: Values | null = null;
  private node = 0;
  private roles: string[] = [];
  columns = false;

  constructor(
    private readonly onColumns: () => void,
    private readonly nameOf: (node: number) => string,
    private readonly tiedOf: (node: number) => number[] = () => [],
  ) {
    this.columnsBtn = button("Value columns", "jmi-toggle jmi-values-cols", () => this.toggleColumns());
    this.columnsBtn.setAttribute("aria-pressed", "false");
    this.columnsBtn.setAttribute("aria-keyshortcuts", "Shift+V");
    this.columnsBtn.title = "Show std and absmax as columns of the tree (key on a tree row: Shift+V)";
    for (const s of STATS) this.statSel.append(option(s, s));
    for (const [v, t] of [["line", "Line"], ["bars", "Bars"]]) this.kindSel.append(option(v, t));
    this.statSel.value = "std";
    this.kindSel.value = "line";
    this.statSel.setAttribute("aria-label", "Statistic along the depth");
    this.roleSel.setAttribute("aria-label", "Tensor of each repeated block");
    this.kindSel.setAttribute("aria-label", "Chart kind");
    for (const sel of [this.statSel, this.roleSel, this.kindSel]) sel.addEventListener("change", () => this.renderChart());
    const controls = h("div", "jmi-values-controls");
    // the statistic and the chart kind stay beside their label; the role (a long tensor
    // name) is the part that goes to its own line in a narrow widget
    this.depthEl.append(h("span", "jmi-muted", "Along the depth:"), this.statSel, this.kindSel);
    controls.append(this.columnsBtn, this.depthEl, this.roleSel);
    this.el.append(controls, this.chartEl, this.histEl);
    this.el.hidden = true;
    this.el.setAttribute("role", "region");
    this.el.setAttribute("aria-label", "Values of the model");
  }

  toggleColumns(): void {
    this.columns = !this.columns;
    this.columnsBtn.setAttribute("aria-pressed", String(this.columns));
    this.columnsBtn.classList.toggle("jmi-on", this.columns);
    this.onColumns();
  }

  /** New values from the kernel: the first ones show the columns. */
  setValues(values: Values | null): void {
    const first = !this.values && values;
    this.values = values;
    this.el.hidden = !values;
    if (!values) return;
    this.roles = depthRoles(values.tensors);
    const keep = this.roleSel.value;
    this.roleSel.replaceChildren(...this.roles.map((r) => option(r, r)));
    this.roleSel.value = this.roles.includes(keep) ? keep : (this.roles[0] ?? "");
    this.roleSel.disabled = !this.roles.length;
    // no repeated blocks: no chart along the depth, so none of its controls (an empty
    // tensor list and a statistic that chooses nothing); the chart box says why
    this.roleSel.hidden = !this.roles.length;
    this.depthEl.hidden = !this.roles.length;
    if (first && !this.columns) this.toggleColumns();
    this.renderChart();
    this.renderHistogram();
  }

  /** The focused row changed: its tensor's histogram. */
  focus(node: number): void {
    if (node === this.node) return;
    this.node = node;
    this.renderHistogram();
  }

  /** The charts are drawn at the panel's width (their text stays 10 px, never scaled down). */
  private width(): number {
    return Math.max(280, Math.min(720, this.el.clientWidth || 640));
  }

  /** The widget changed width: draw the charts again at the new one. */
  resized(): void {
    this.renderChart();
    this.renderHistogram();
  }

  private renderChart(): void {
    const v = this.values;
    if (!v) return;
    const role = this.roleSel.value;
    if (!role) {
      this.chartEl.replaceChildren(h("div", "jmi-muted", "No repeated blocks among the measured tensors: no chart along the depth."));
      return;
    }
    const stat = this.statSel.value as StatName;
    const title = `${stat} of ${role} per layer`;
    this.chartEl.replaceChildren(h("div", "jmi-chart-title", title), depthChart(depthSeries(v.tensors, role, stat), title, this.kindSel.value === "bars", this.width()));
  }

  private renderHistogram(): void {
    const v = this.values;
    if (!v) return;
    let t = tensorOf(v, this.node);
    const where = this.nameOf(this.node) || "the whole model";
    let tied = "";
    if (!t) {
      // a tied leaf (lm_head sharing the embedding's weight): Values measured the shared
      // tensor once, under its first holder's name, which is this row's tensor too
      for (const k of this.tiedOf(this.node)) {
        t = tensorOf(v, k);
        if (t) {
          tied = `${where}, tied to ${t.name}`;
          break;
        }
      }
    }
    if (!t) {
      this.histEl.replaceChildren(h("div", "jmi-muted", `Histogram: ${where} holds no tensor of its own that Values measured; focus a leaf row (Linear, Embedding…).`));
      return;
    }
    this.histEl.replaceChildren(h("div", "jmi-chart-title", `Histogram of ${tied || t.name} (${t.counts.length} bins, finite values)`), histogramChart(t, this.width()));
  }
}

function option(value: string, text: string): HTMLOptionElement {
  const o = h("option", "", text);
  o.value = value;
  return o;
}
