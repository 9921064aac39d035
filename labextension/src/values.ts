// Values: what `stats` measured (tree_widget/values.py publishes it as the `values` trait), shown
// as optional columns of the tree (std, absmax; NaN/inf as a red flag on the row), a chart of a
// statistic along the depth of the repeated blocks, and the histogram of the focused row's
// tensor. The charts are SVG drawn here, coloured by the theme's CSS variables (light and dark).

import { h } from "./dom";

/** The statistics of one module row or one tensor (null: not finite, see nan/inf). */
export interface Stat {
  mean: number | null;
  std: number | null;
  absmax: number | null;
  l2: number | null;
  nan: number;
  inf: number;
}
export interface TensorStat extends Stat {
  name: string;
  node: number;
  lo: number | null;
  hi: number | null;
  counts: number[];
}
/** The `values` trait as the page uses it. */
export interface Values {
  id: number;
  modules: Map<number, Stat>;
  tensors: TensorStat[];
}

export const STATS = ["std", "absmax", "l2", "mean"] as const;
export type StatName = (typeof STATS)[number];

function stat(fields: string[], row: unknown[], from: number): Stat {
  const out: Record<string, unknown> = {};
  fields.forEach((f, i) => (out[f] = row[from + i]));
  const num = (v: unknown) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  return {
    mean: num(out.mean), std: num(out.std), absmax: num(out.absmax), l2: num(out.l2),
    nan: Number(out.nan) || 0, inf: Number(out.inf) || 0,
  };
}

/** The trait's JSON as maps; null before any Values ran (or from an unknown shape). */
export function readValues(raw: any): Values | null {
  if (!raw || !Array.isArray(raw.modules) || !Array.isArray(raw.fields)) return null;
  const fields: string[] = raw.fields;
  const modules = new Map<number, Stat>();
  for (const row of raw.modules) modules.set(Number(row[0]), stat(fields, row, 1));
  const tensors: TensorStat[] = (raw.tensors ?? []).map((row: any[]) => {
    const s = stat(fields, row, 2);
    const at = 2 + fields.length;
    return { ...s, name: String(row[0]), node: Number(row[1]), lo: row[at], hi: row[at + 1], counts: row[at + 2] ?? [] };
  });
  return { id: Number(raw.id) || 0, modules, tensors };
}

/** A statistic in 4 significant digits: 0.02001, 1.234e-5, 3.5e+4. */
export function statText(v: number | null): string {
  if (v === null) return "—";
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a >= 1e-3 && a < 1e4 ? String(Number(v.toPrecision(4))) : v.toExponential(2).replace("e+", "e");
}

/** "2 NaN, 1 inf" or "" */
export function badText(s: Stat): string {
  return [s.nan ? `${s.nan.toLocaleString("en")} NaN` : "", s.inf ? `${s.inf.toLocaleString("en")} inf` : ""]
    .filter(Boolean)
    .join(", ");
}

/** The red flag of a row holding NaN or infinite values (never hidden, as the fast tag). */
export function badFlag(s: Stat): HTMLElement | null {
  const text = badText(s);
  if (!text) return null;
  const el = h("span", "jmi-bad", s.nan ? "NaN" : "inf");
  el.title = `Holds ${text} values`;
  return el;
}

/** The value cells of a row: std, absmax (blank where Values did not measure it). */
export function valueCells(s: Stat | undefined): HTMLElement[] {
  const cell = (cls: string, v: number | null | undefined) => {
    const el = h("div", `jmi-c-num jmi-c-val ${cls}`, s ? statText(v ?? null) : "");
    // a figure NaN or inf make undefined says so in red: the row's flag where the name has
    // no room for it (style.css hides the name's flag in narrow widgets)
    if (s && (v ?? null) === null && badText(s)) {
      el.replaceChildren(h("span", "jmi-bad-val", s.nan ? "NaN" : "inf"));
    }
    if (s) el.title = `mean ${statText(s.mean)}, std ${statText(s.std)}, absmax ${statText(s.absmax)}, l2 ${statText(s.l2)}${badText(s) ? `; ${badText(s)}` : ""}`;
    return el;
  };
  return [cell("jmi-c-std", s?.std), cell("jmi-c-absmax", s?.absmax)];
}

/** `layers.3.self_attn.q_proj.weight` -> layer 3, role `self_attn.q_proj.weight` (the last
 *  number in the name, as inspection/charts.py's along_depth); null outside repeated blocks. */
export function splitLayer(name: string): { layer: number; role: string } | null {
  const m = /^(?:.*\.)?(\d+)\.(.+)$/.exec(name); // greedy: the innermost block's number
  return m ? { layer: Number(m[1]), role: m[2] } : null;
}

/** The roles found in at least two layers: most layers first, then those whose values vary
 *  (a weight matrix before a norm's constant ones), then by name. */
export function depthRoles(tensors: TensorStat[]): string[] {
  const layers = new Map<string, Set<number>>();
  const varies = new Set<string>();
  for (const t of tensors) {
    const s = splitLayer(t.name);
    if (!s) continue;
    if (!layers.has(s.role)) layers.set(s.role, new Set());
    layers.get(s.role)!.add(s.layer);
    if (t.std) varies.add(s.role);
  }
  const rank = (r: string) => (varies.has(r) ? 0 : 1);
  return [...layers]
    .filter(([, l]) => l.size > 1)
    .sort((a, b) => b[1].size - a[1].size || rank(a[0]) - rank(b[0]) || (a[0] < b[0] ? -1 : 1))
    .map(([r]) => r);
}

/** The statistic of `role` per layer, in layer order (a layer in two stacks: their mean). */
export function depthSeries(tensors: TensorStat[], role: string, which: StatName): Array<[number, number | null]> {
  const per = new Map<number, number[]>();
  let missing = new Set<number>();
  for (const t of tensors) {
    const s = splitLayer(t.name);
    if (!s || s.role !== role) continue;
    const v = t[which];
    if (v === null) missing.add(s.layer);
    else per.set(s.layer, [...(per.get(s.layer) ?? []), v]);
  }
  missing = new Set([...missing].filter((l) => !per.has(l)));
  const out: Array<[number, number | null]> = [...per].map(([l, vs]) => [l, vs.reduce((a, b) => a + b, 0) / vs.length]);
  for (const l of missing) out.push([l, null]);
  return out.sort((a, b) => a[0] - b[0]);
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag: string, attrs: Record<string, string | number>, text = ""): SVGElement {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text) el.textContent = text;
  return el;
}

/** A chart's frame: y axis with ticks from 0 (or the smallest value) to the largest. */
function frame(width: number, height: number, label: string, lo: number, hi: number, xlabel: string): { root: SVGElement; x0: number; y: (v: number) => number; plotW: number } {
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", class: "jmi-chart", role: "img", "aria-label": label });
  const x0 = 56;
  const top = 8;
  const bottom = height - 32; // room for the x ticks and, under them, the axis label
  const y = (v: number) => bottom - (hi > lo ? ((v - lo) / (hi - lo)) * (bottom - top) : (bottom - top) / 2);
  root.append(svg("line", { x1: x0, y1: top, x2: x0, y2: bottom, class: "jmi-axis" }));
  root.append(svg("line", { x1: x0, y1: bottom, x2: width - 6, y2: bottom, class: "jmi-axis" }));
  for (const v of [lo, (lo + hi) / 2, hi]) {
    root.append(svg("text", { x: x0 - 4, y: y(v) + 4, "text-anchor": "end", class: "jmi-tick" }, statText(v)));
    root.append(svg("line", { x1: x0, y1: y(v), x2: width - 6, y2: y(v), class: "jmi-grid" }));
  }
  root.append(svg("text", { x: (x0 + width) / 2, y: height - 4, "text-anchor": "middle", class: "jmi-tick" }, xlabel));
  return { root, x0, y, plotW: width - 6 - x0 };
}

/** A statistic along the depth as a line (dots on it) or bars; a gap where it is not finite. */
export function depthChart(points: Array<[number, number | null]>, title: string, bars: boolean, width = 640, height = 180): SVGElement {
  const vals = points.flatMap(([, v]) => (v === null ? [] : [v]));
  const lo = Math.min(0, ...vals);
  const hi = Math.max(0, ...vals);
  const f = frame(width, height, title, lo, hi, "layer");
  const n = Math.max(points.length, 1);
  const step = f.plotW / n;
  const x = (i: number) => f.x0 + step * (i + 0.5);
  let path = "";
  let pen = false; // a line is broken where a value is not finite
  points.forEach(([layer, v], i) => {
    if (v === null) {
      pen = false;
      return;
    }
    if (bars) {
      const r = svg("rect", { x: x(i) - step * 0.35, y: Math.min(f.y(v), f.y(0)), width: Math.max(step * 0.7, 1), height: Math.abs(f.y(0) - f.y(v)), class: "jmi-bar-mark" });
      r.append(svg("title", {}, `layer ${layer}: ${statText(v)}`));
      f.root.append(r);
      return;
    }
    path += `${pen ? "L" : "M"}${x(i).toFixed(1)},${f.y(v).toFixed(1)} `;
    pen = true;
    const dot = svg("circle", { cx: x(i), cy: f.y(v), r: 2.5, class: "jmi-dot" });
    dot.append(svg("title", {}, `layer ${layer}: ${statText(v)}`));
    f.root.append(dot);
  });
  if (path) f.root.insertBefore(svg("path", { d: path.trim(), class: "jmi-line" }), f.root.querySelector("circle"));
  const every = Math.ceil(n / 16);
  points.forEach(([layer], i) => {
    if (i % every === 0) f.root.append(svg("text", { x: x(i), y: height - 18, "text-anchor": "middle", class: "jmi-tick jmi-xtick" }, String(layer)));
  });
  return f.root;
}

/** The histogram of one tensor's finite values: `counts` in equal bins from `lo` to `hi`. */
export function histogramChart(t: TensorStat, width = 640, height = 150): SVGElement {
  const top = Math.max(2, ...t.counts);
  const most = top + (top % 2); // even: the middle tick is a count (768, not 767.5)
  const f = frame(width, height, `Histogram of ${t.name}`, 0, most, `${statText(t.lo)} … ${statText(t.hi)}`);
  const step = f.plotW / Math.max(t.counts.length, 1);
  t.counts.forEach((c, i) => {
    if (!c) return;
    const lo = t.lo ?? 0;
    const w = ((t.hi ?? 0) - lo) / t.counts.length;
    const r = svg("rect", { x: f.x0 + step * i, y: f.y(c), width: Math.max(step - 1, 1), height: f.y(0) - f.y(c), class: "jmi-bar-mark" });
    r.append(svg("title", {}, `${statText(lo + w * i)} … ${statText(lo + w * (i + 1))}: ${c.toLocaleString("en")}`));
    f.root.append(r);
  });
  return f.root;
}

/** The tensor a focused row's histogram shows: its own weight, else its first own tensor. */
export function tensorOf(values: Values, node: number): TensorStat | undefined {
  const own = values.tensors.filter((t) => t.node === node);
  return own.find((t) => t.name.endsWith(".weight") || t.name === "weight") ?? own[0];
}
