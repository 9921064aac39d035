import { describe, expect, it } from "vitest";
import { CHECKED, PARTIAL, Tree, UNCHECKED } from "../src/tree";
import { bigTree, smallTree } from "./fixture";

const names = (t: Tree, nodes: number[]) => t.namesOf(nodes);

describe("Tree", () => {
  it("derives qualified names", () => {
    const t = new Tree(smallTree());
    expect(t.qname).toEqual(["", "embed", "layers", "layers.0", "layers.0.attn",
      "layers.0.mlp", "layers.1", "layers.1.attn", "layers.1.mlp", "norm"]);
    expect(t.index.get("layers.1.mlp")).toBe(8);
  });

  it("shows only expanded nodes' children", () => {
    const t = new Tree(smallTree());
    const rows = t.visibleRows(t.expandedToDepth(1));
    expect(rows.map((r) => t.qname[r.node])).toEqual(["", "embed", "layers", "norm"]);
    const open = new Set([0, 2]);
    expect(t.visibleRows(open).map((r) => r.node)).toEqual([0, 1, 2, 3, 6, 9]);
  });

  it("filters by name or type and reveals collapsed matches", () => {
    const t = new Tree(smallTree());
    const rows = t.visibleRows(new Set(), "MLP");
    expect(rows.map((r) => t.qname[r.node])).toEqual(["", "layers", "layers.0", "layers.0.mlp",
      "layers.1", "layers.1.mlp"]);
    expect(rows.filter((r) => r.match).map((r) => r.node)).toEqual([5, 8]);
    const byType = t.visibleRows(new Set(), "norm");
    expect(byType.filter((r) => r.match).map((r) => t.qname[r.node])).toEqual(["norm"]);
  });

  it("shows an expanded match's children while filtering", () => {
    const t = new Tree(smallTree());
    const rows = t.visibleRows(new Set([3]), "layers.0");
    expect(rows.map((r) => r.node)).toEqual([0, 2, 3, 4, 5]);
  });

  it("computes tri-state checks", () => {
    const t = new Tree(smallTree());
    const st = t.checkStates(new Set([3]));
    expect(st[3]).toBe(CHECKED);
    expect(st[4]).toBe(CHECKED);
    expect(st[2]).toBe(PARTIAL);
    expect(st[0]).toBe(PARTIAL);
    expect(st[6]).toBe(UNCHECKED);
  });

  it("selecting every child selects a tensor-less parent instead", () => {
    const t = new Tree(smallTree());
    let sel = t.toggle(new Set(), 3);
    expect(names(t, sel)).toEqual(["layers.0"]);
    sel = t.toggle(new Set(sel), 6);
    expect(names(t, sel)).toEqual(["layers"]);
  });

  it("unticking inside a selected subtree keeps its siblings", () => {
    const t = new Tree(smallTree());
    const sel = t.toggle(new Set([0]), 4);
    expect(names(t, sel)).toEqual(["embed", "layers.0.mlp", "layers.1", "norm"]);
  });

  it("selecting a parent drops its selected descendants", () => {
    const t = new Tree(smallTree());
    const sel = t.toggle(new Set([4, 9]), 2);
    expect(names(t, sel)).toEqual(["layers", "norm"]);
  });

  it("applies patches", () => {
    const t = new Tree(smallTree());
    t.applyPatch([[4, 10, 40, "cpu"], [3, 30, 120, "mixed"]]);
    expect(t.state[4]).toBe("cpu");
    expect(t.state[3]).toBe("mixed");
  });

  it("recognises repeated blocks", () => {
    const t = new Tree(smallTree());
    expect(t.repeatedChildren(2)).toEqual([2, "Block"]);
    expect(t.repeatedChildren(0)).toBeNull();
  });

  it("expands and filters a 70B-sized tree quickly", () => {
    const t = new Tree(bigTree());
    expect(t.n).toBeGreaterThan(1000);
    const t0 = performance.now();
    const all = t.visibleRows(t.expandedToDepth(99));
    const filtered = t.visibleRows(new Set(), "down_proj");
    const took = performance.now() - t0;
    expect(all.length).toBe(t.n);
    expect(filtered.filter((r) => r.match).length).toBe(80);
    expect(took).toBeLessThan(100);
  });
});
