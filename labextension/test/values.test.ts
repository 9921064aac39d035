import { describe, expect, it } from "vitest";
import { badText, depthChart, depthRoles, depthSeries, histogramChart, readValues, splitLayer, statText, tensorOf } from "../src/values";

const raw = {
  id: 1,
  fields: ["mean", "std", "absmax", "l2", "nan", "inf"],
  modules: [[0, 0.1, 0.5, 2, 9, 1, 0], [4, 0, null, 1, 3, 0, 2]],
  tensors: [
    ["layers.0.attn.weight", 4, 0, 0.25, 1, 3, 0, 0, -1, 1, [1, 2, 3]],
    ["layers.1.attn.weight", 7, 0, 0.5, 1, 3, 0, 0, -1, 1, [1, 0, 3]],
    ["layers.1.attn.bias", 7, 0, null, 1, 3, 1, 0, -1, 1, [0, 0, 1]],
    ["layers.0.attn.bias", 4, 0, 0.1, 1, 3, 0, 0, -1, 1, [0, 0, 1]],
    ["embed.weight", 1, 0, 0.2, 1, 3, 0, 0, -1, 1, [1, 1, 1]],
  ],
};

describe("values", () => {
  it("reads the trait: module rows by node, null where not finite", () => {
    const v = readValues(raw)!;
    expect(v.modules.get(4)).toEqual({ mean: 0, std: null, absmax: 1, l2: 3, nan: 0, inf: 2 });
    expect(v.tensors[0]).toMatchObject({ name: "layers.0.attn.weight", node: 4, std: 0.25, lo: -1, hi: 1, counts: [1, 2, 3] });
    expect(readValues({})).toBeNull();
  });

  it("says NaN and inf counts in words", () => {
    expect(badText({ mean: 0, std: 0, absmax: 0, l2: 0, nan: 1200, inf: 1 })).toBe("1,200 NaN, 1 inf");
    expect(badText({ mean: 0, std: 0, absmax: 0, l2: 0, nan: 0, inf: 0 })).toBe("");
  });

  it("writes statistics in four digits, tiny and huge ones as exponents", () => {
    expect([statText(0.020012345), statText(1.5e-5), statText(35000), statText(null), statText(0)]).toEqual(["0.02001", "1.50e-5", "3.50e4", "—", "0"]);
  });

  it("finds the layer and role of a tensor by its innermost block number", () => {
    expect(splitLayer("model.layers.12.self_attn.q_proj.weight")).toEqual({ layer: 12, role: "self_attn.q_proj.weight" });
    expect(splitLayer("layers.3.experts.7.w1")).toEqual({ layer: 7, role: "w1" });
    expect(splitLayer("embed.weight")).toBeNull();
  });

  it("offers the roles of the repeated blocks and their series in layer order", () => {
    const v = readValues(raw)!;
    expect(depthRoles(v.tensors)).toEqual(["attn.bias", "attn.weight"]);
    const flat = v.tensors.map((t) => (t.name.endsWith("bias") ? { ...t, std: 0 } : t));
    expect(depthRoles(flat)).toEqual(["attn.weight", "attn.bias"]); // varying values first
    expect(depthSeries(v.tensors, "attn.weight", "std")).toEqual([[0, 0.25], [1, 0.5]]);
    expect(depthSeries(v.tensors, "attn.bias", "std")).toEqual([[0, 0.1], [1, null]]);
  });

  it("draws a line with a dot per layer, bars as one rect each, a gap where not finite", () => {
    const line = depthChart([[0, 1], [1, null], [2, 3], [3, 2]], "std", false);
    expect(line.querySelectorAll("circle").length).toBe(3);
    const d = line.querySelector("path")!.getAttribute("d")!;
    expect([d.match(/M/g)!.length, d.match(/L/g)!.length]).toEqual([2, 1]); // 2 to 3 joined
    expect(line.getAttribute("aria-label")).toBe("std");
    const bars = depthChart([[0, 1], [1, 2]], "std", true);
    expect(bars.querySelectorAll("rect").length).toBe(2);
  });

  it("draws the focused row's weight histogram, one bar per non-empty bin", () => {
    const v = readValues(raw)!;
    const t = tensorOf(v, 7)!;
    expect(t.name).toBe("layers.1.attn.weight");
    expect(histogramChart(t).querySelectorAll("rect").length).toBe(2);
    expect(tensorOf(v, 0)).toBeUndefined();
  });

  it("labels the histogram's count axis with whole counts", () => {
    const t = { ...tensorOf(readValues(raw)!, 7)!, counts: [1535, 3, 0, 7] };
    const ticks = [...histogramChart(t).querySelectorAll("text")].map((e) => e.textContent);
    expect(ticks.slice(0, 3)).toEqual(["0", "768", "1536"]);
  });
});
