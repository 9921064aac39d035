import { describe, expect, it } from "vitest";
import { humanBytes, humanCount, percent, stateKind } from "../src/format";

describe("format", () => {
  it("writes bytes in binary units", () => {
    expect(humanBytes(0)).toBe("0 B");
    expect(humanBytes(1536)).toBe("1.5 KiB");
    expect(humanBytes(282214826496)).toBe("262.8 GiB");
  });
  it("writes parameter counts in K/M/B", () => {
    expect(humanCount(999)).toBe("999");
    expect(humanCount(8192)).toBe("8.2 K");
    expect(humanCount(70553706496)).toBe("70.55 B");
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
