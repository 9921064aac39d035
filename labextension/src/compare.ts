// *Compare with…*: a bar that takes a checkpoint path or the name of a model / state dict in the
// kernel, asks the kernel to `compare` (tree_widget/comparing.py), and the row colours that show
// the answer (the `comparison` trait): equal, tiny (rel_l2 <= 1e-3), large, missing, shape.

import { type BarHost, submitOrSay } from "./plan";
import { busyWhy } from "./actions";
import { h, labelled, setEnabled } from "./dom";
import { statText } from "./values";

export const KIND_WORDS: Record<string, string> = {
  equal: "equal",
  tiny: "tiny difference",
  large: "large difference",
  missing: "missing on one side",
  shape: "shape differs",
};

/** A measure as the kernel sends it: a number, or "inf" / "-inf" / "nan" (JSON has no inf). */
export type Measure = number | "inf" | "-inf" | "nan";

/** Per tree node: the worst kind under it, how many tensors differ, the largest rel_l2. */
export interface Compared {
  other: string;
  tiny: number;
  nodes: Map<number, { kind: string; differ: number; relL2: Measure | null }>;
}

function readMeasure(v: unknown): Measure | null {
  if (typeof v === "number") return v;
  return v === "inf" || v === "-inf" || v === "nan" ? v : null;
}

/** A measure in words: the number, "inf", or "NaN (not finite)". */
export function measureText(v: Measure | null): string {
  if (v === "nan") return "NaN (not finite)";
  return typeof v === "string" ? v : statText(v);
}

export function readComparison(raw: any): Compared | null {
  if (!raw || !Array.isArray(raw.modules)) return null;
  const nodes = new Map<number, { kind: string; differ: number; relL2: Measure | null }>();
  for (const [node, kind, differ, rel] of raw.modules) nodes.set(Number(node), { kind: String(kind), differ: Number(differ) || 0, relL2: readMeasure(rel) });
  return { other: String(raw.other ?? ""), tiny: Number(raw.tiny) || 1e-3, nodes };
}

/** A row's tooltip part: "vs finetuned/: large difference, 3 tensors differ, rel_l2 up to 0.5". */
export function comparedText(c: Compared, node: number): string {
  const n = c.nodes.get(node);
  if (!n) return "";
  const differ = n.differ ? `, ${n.differ} tensor${n.differ > 1 ? "s" : ""} differ${n.differ > 1 ? "" : "s"}` : "";
  const rel = n.relL2 !== null && n.kind !== "equal" ? `, rel_l2 up to ${measureText(n.relL2)}` : "";
  return `vs ${c.other}: ${KIND_WORDS[n.kind] ?? n.kind}${differ}${rel}`;
}

export class CompareBar {
  readonly el = h("form", "jmi-bar-form jmi-comparebar");
  readonly other = h("input", "jmi-input jmi-compare-other");
  readonly goBtn = h("button", "jmi-btn jmi-primary jmi-compare-go", "Compare");
  readonly legend = h("div", "jmi-legend");
  private readonly what = h("span", "jmi-muted");

  constructor(private readonly host: BarHost) {
    this.el.hidden = true;
    this.el.setAttribute("aria-label", "Compare the model or the ticked subtrees with a checkpoint or a model");
    this.other.type = "text";
    this.other.placeholder = "checkpoint path, or a model / state dict: base_model";
    this.goBtn.type = "submit";
    this.el.addEventListener("submit", (ev) => {
      ev.preventDefault();
      submitOrSay(host, this.goBtn, "Compare", () =>
        this.host.request({ action: "compare", other: this.other.value, names: this.host.get("selected") ?? [] }),
      );
    });
    for (const [kind, words] of Object.entries(KIND_WORDS)) {
      const item = h("span", `jmi-legend-item jmi-cmp-${kind}`);
      item.append(h("span", "jmi-swatch"), words === "tiny difference" ? "tiny (rel_l2 ≤ 1e-3)" : words);
      this.legend.append(item);
    }
    this.legend.hidden = true;
    const row = h("div", "jmi-bar-row");
    row.append(labelled("Compare with", this.other), this.goBtn, this.what);
    this.el.append(row);
  }

  render(busy: boolean, off = false): void {
    const names: string[] = this.host.get("selected") ?? [];
    this.other.disabled = off;
    this.what.textContent = names.length === 0 || (names.length === 1 && !names[0]) ? "the whole model" : `the ${names.length} ticked`;
    setEnabled(this.goBtn, !busy, off);
    this.host.explain(this.goBtn, busyWhy(busy, off) || "Compare tensor by tensor (compare): nothing changes on either side");
  }
}
