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

// JupyterLab 4's light and dark themes (@jupyterlab/theme-*-extension/index.css): the colours
// the widget's variables take there; a text colour with alpha is blended over its background.
const THEMES: Record<string, Record<string, string>> = {
  light: {
    "--jp-ui-font-color1": "rgba(0,0,0,.87)", "--jp-ui-font-color2": "rgba(0,0,0,.54)",
    "--jp-ui-font-color3": "rgba(0,0,0,.38)", "--jp-layout-color1": "#ffffff",
    "--jp-layout-color2": "#eeeeee", "--jp-layout-color3": "#bdbdbd", "--jp-warn-color1": "#f57c00",
  },
  dark: {
    "--jp-ui-font-color1": "rgba(255,255,255,.87)", "--jp-ui-font-color2": "rgba(255,255,255,.54)",
    "--jp-ui-font-color3": "rgba(255,255,255,.38)", "--jp-layout-color1": "#212121",
    "--jp-layout-color2": "#424242", "--jp-layout-color3": "#616161", "--jp-warn-color1": "#ff9800",
  },
};

/** A declaration's colour in a theme: var(--jmi-x) -> the root's var(--jp-y, fallback) -> the theme's. */
function themed(block: string, name: string, theme: string): string {
  const m = new RegExp(`(?:^|[;{\\s])${name}:\\s*var\\((--jmi-[a-z0-9-]+)\\)`).exec(block);
  expect(m, `${name} in ${block}`).not.toBeNull();
  const root = rule(".jmi-root");
  const jp = new RegExp(`${m![1]}:\\s*var\\((--jp-[a-z0-9-]+)`).exec(root);
  expect(jp, m![1]).not.toBeNull();
  const value = THEMES[theme][jp![1]];
  expect(value, jp![1]).toBeDefined();
  return value;
}

function rgb(colour: string, over = "#ffffff"): string {
  const m = /^rgba\((\d+),(\d+),(\d+),([\d.]+)\)$/.exec(colour.replace(/\s/g, ""));
  if (!m) return colour;
  const a = Number(m[4]);
  const bg = [1, 3, 5].map((i) => parseInt(over.slice(i, i + 2), 16));
  return "#" + [1, 2, 3].map((k) => Math.round(a * Number(m[k]) + (1 - a) * bg[k - 1]).toString(16).padStart(2, "0")).join("");
}

describe("text in JupyterLab's themes", () => {
  // [selector, what it is, the background it sits on]
  const cases: Array<[string, string, string]> = [
    [".jmi-chip", "the ×N, identical chip", "background"],
    [".jmi-state-none", "the — state badge", "--jp-layout-color1"],
    [".jmi-also", "also makes … real (tied)", "--jp-layout-color1"],
  ];
  for (const theme of ["light", "dark"]) {
    for (const [sel, what, on] of cases) {
      it(`${what} has a contrast of at least 4.5:1 in the ${theme} theme`, () => {
        const block = rule(sel);
        const bg = on === "background" ? themed(block, "background", theme) : THEMES[theme][on];
        expect(contrast(rgb(themed(block, "color", theme), bg), bg)).toBeGreaterThanOrEqual(4.5);
      });
    }
  }
});

