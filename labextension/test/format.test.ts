import { describe, expect, it } from "vitest";
import { humanBytes, humanCount, percent, stateKind } from "../src/format";
import cases from "./format_cases.json";

describe("format", () => {
  it("writes bytes like the kernel (shared cases)", () => {
    for (const [n, text] of cases.bytes as Array<[number, string]>) expect(humanBytes(n)).toBe(text);
  });
  it("writes parameter counts like the kernel (shared cases)", () => {
    for (const [n, text] of cases.counts as Array<[number, string]>) expect(humanCount(n)).toBe(text);
  });
  it("writes shares as percentages", () => {
    expect(percent(1, 0)).toBe("");
    expect(percent(1, 3)).toBe("33%");
    expect(percent(1, 100000)).toBe("<0.1%");
  });
  it("maps states to badge kinds", () => {
    expect(stateKind("cuda:1")).toBe("cuda");
    expect(stateKind("deferred")).toBe("deferred");
    expect(stateKind("")).toBe("none");
  });
});
