// @vitest-environment node
import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";

// The badge and focus colours are fixed in the CSS; their contrast is computed from it here
// (WCAG 2.x relative luminance), so a colour change that makes text unreadable fails.
const css = readFileSync(decodeURIComponent(new URL("../src/style.css", import.meta.url).pathname), "utf8");

function rule(selector: string): string {
  const at = css.indexOf(`${selector} {`);
  expect(at, selector).toBeGreaterThanOrEqual(0);
  return css.slice(at, css.indexOf("}", at));
}

function prop(block: string, name: string): string {
  const m = new RegExp(`(?:^|[;{\\s])${name}:\\s*(#[0-9a-fA-F]{6})`).exec(block);
  expect(m, `${name} in ${block}`).not.toBeNull();
  return m![1];
}

function luminance(hex: string): number {
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16) / 255).map((c) =>
    c <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4,
  );
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

export function contrast(a: string, b: string): number {
  const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
  return (hi + 0.05) / (lo + 0.05);
}

describe("colours", () => {
  // badges, the primary button and a toggle that is on: fixed colours, whatever the theme
  for (const sel of [".jmi-state-cpu", ".jmi-state-cuda", ".jmi-state-mixed", ".jmi-dtype.jmi-fast",
    ".jmi-btn.jmi-primary", ".jmi-btn.jmi-toggle.jmi-on", ".jmi-bad"]) {
    it(`${sel} text has a contrast of at least 4.5:1`, () => {
      const block = rule(sel);
      expect(contrast(prop(block, "color"), prop(block, "background"))).toBeGreaterThanOrEqual(4.5);
    });
  }

  it("the focus ring stands out at least 3:1 from light and dark backgrounds", () => {
    const light = prop(rule(".jmi-root"), "--jmi-focus");
    const dark = prop(rule('body[data-jp-theme-light="false"] .jmi-root'), "--jmi-focus");
    // JupyterLab's light and dark layout colours (--jp-layout-color0..2)
    for (const bg of ["#ffffff", "#eeeeee"]) expect(contrast(light, bg)).toBeGreaterThanOrEqual(3);
    for (const bg of ["#111111", "#212121", "#424242"]) expect(contrast(dark, bg)).toBeGreaterThanOrEqual(3);
    // and from the blue primary button it surrounds (2px away, on the background)
    expect(contrast(light, "#ffffff")).toBeGreaterThanOrEqual(3);
  });
});
