// Small DOM helpers shared by the view, its rows and the plan/save bars: elements, buttons that
// stay focusable while unavailable (with the reason read out), highlighted text, the copy icon.

/** An element with a class and text. */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls = "",
  text = "",
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text) el.textContent = text;
  return el;
}

/** A button whose clicks are ignored while it is `aria-disabled` (see setEnabled). */
export function button(label: string, cls: string, onClick: () => void): HTMLButtonElement {
  const b = h("button", `jmi-btn ${cls}`, label);
  b.type = "button";
  b.addEventListener("click", () => {
    if (b.getAttribute("aria-disabled") !== "true") onClick();
  });
  return b;
}

/** Available or not, keeping the button focusable: an unavailable action is `aria-disabled`
 *  rather than `disabled`, so keyboard users reach it and hear why (Reasons). `dead`: the
 *  widget is not connected to its model any more, so nothing in it is a control: `disabled`. */
export function setEnabled(b: HTMLButtonElement, enabled: boolean, dead = false): void {
  b.disabled = dead;
  b.setAttribute("aria-disabled", String(!enabled || dead));
  b.classList.toggle("jmi-disabled", !enabled || dead);
}

let reasonIds = 0;
/** Ids must be unique in the page, which may hold several widgets (and several pages). */
const pageId = Math.random().toString(36).slice(2, 8);

/** What each button does, or why it is unavailable: its tooltip, and a visually hidden text its
 *  `aria-describedby` points to, read out when it gets focus (a tooltip alone is a hover thing,
 *  which keyboard and screen-reader users never see). */
export class Reasons {
  readonly el = h("div", "jmi-sr");

  explain(b: HTMLButtonElement, why: string): void {
    b.title = why;
    let id = b.getAttribute("aria-describedby");
    if (!id) {
      const span = h("span", "jmi-sr");
      id = `jmi-why-${pageId}-${++reasonIds}`;
      span.id = id;
      this.el.append(span);
      b.setAttribute("aria-describedby", id);
    }
    const target = this.el.querySelector<HTMLElement>(`#${id}`);
    if (target && target.textContent !== why) target.textContent = why;
  }
}

/** A labelled form field: its name in words, then the control. */
export function labelled(text: string, control: HTMLElement): HTMLLabelElement {
  const l = h("label", "jmi-field");
  l.append(h("span", "jmi-field-label", text), control);
  return l;
}

export function cellWith(child: HTMLElement, cls: string): HTMLElement {
  const c = h("div", cls);
  c.append(child);
  return c;
}

/** `text` with the first match of the filter `query` marked. */
export function appendHighlighted(el: HTMLElement, text: string, query: string): void {
  appendMarked(el, text, 0, text.length, matchOf(text, query));
}

/** Where the filter `query` first matches `text`: [start, end), or null. */
function matchOf(text: string, query: string): [number, number] | null {
  const q = query.trim().toLowerCase();
  const at = q ? text.toLowerCase().indexOf(q) : -1;
  return at < 0 ? null : [at, at + q.length];
}

/** `text.slice(from, to)`, the part of `match` inside it marked. */
function appendMarked(el: HTMLElement, text: string, from: number, to: number, match: [number, number] | null): void {
  const a = match ? Math.min(Math.max(match[0], from), to) : to;
  const b = match ? Math.min(Math.max(match[1], from), to) : to;
  if (a > from) el.append(text.slice(from, a));
  if (b > a) el.append(h("mark", "jmi-hl", text.slice(a, b)));
  if (to > b) el.append(text.slice(b, to));
}

/** Where a long name's end starts: its last `_` part(s), 3 to 10 characters (`layernorm`,
 *  `block_12`), else its last 6 characters; 0 for a name too short to cut. */
export function nameEndAt(name: string): number {
  if (name.length <= 10) return 0;
  for (let p = name.lastIndexOf("_"); p > 0; p = name.lastIndexOf("_", p - 1)) {
    const end = name.length - p - 1;
    if (end > 10) break;
    if (end >= 3) return p + 1;
  }
  return name.length - 6;
}

/** A tree name, `query`'s match marked. A long one in two parts whose head gives way first
 *  (style.css: .jmi-name-head), so that a narrow tree shows `post_att…layernorm`: its end,
 *  which tells `input_layernorm` from `post_attention_layernorm`, stays. */
export function appendName(el: HTMLElement, name: string, query: string): void {
  const at = nameEndAt(name);
  const match = matchOf(name, query);
  if (!at) {
    appendMarked(el, name, 0, name.length, match);
    return;
  }
  const head = h("span", "jmi-name-head");
  const end = h("span", "jmi-name-end");
  appendMarked(head, name, 0, at, match);
  appendMarked(end, name, at, name.length, match);
  el.classList.add("jmi-name-split");
  el.append(head, end);
}

const SVG_NS = "http://www.w3.org/2000/svg";

/** An empty 16-unit icon of `size` px, hidden from assistive technology (the row says it). */
function iconSvg(size: number): SVGSVGElement {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 16 16");
  svg.setAttribute("width", String(size));
  svg.setAttribute("height", String(size));
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("focusable", "false");
  svg.classList.add("jmi-icon");
  return svg;
}

/** Two overlapping sheets, the usual "copy" icon, drawn in the text colour. */
export function copyIcon(): SVGSVGElement {
  const svg = iconSvg(12);
  // the front sheet whole, the back one as the corner that shows behind it: no fill needed,
  // so it reads on any row background (hover, selected, dark)
  const back = document.createElementNS(SVG_NS, "path");
  back.setAttribute("d", "M2.75 10.5V3.5a.75.75 0 0 1 .75-.75h7");
  const front = document.createElementNS(SVG_NS, "rect");
  for (const [k, v] of [["x", "5.25"], ["y", "5.25"], ["width", "8"], ["height", "8"], ["rx", "1"]]) {
    front.setAttribute(k, v);
  }
  for (const part of [back, front]) {
    part.setAttribute("fill", "none");
    part.setAttribute("stroke", "currentColor");
    part.setAttribute("stroke-width", "1.5");
    part.setAttribute("stroke-linecap", "round");
    svg.append(part);
  }
  return svg;
}

/** A chip whose key ("tied", "×4") is what must show, in two parts: the key, and the rest
 *  (", identical", ": lm_head"), each shown whole or not at all where the row has no room
 *  (style.css: .jmi-tags), never "×4, iden…". Its text reads whole: "×4, identical". */
export function keyedChip(cls: string, key: string, rest: string): HTMLElement {
  const chip = h("span", cls);
  chip.append(h("span", "jmi-chip-key", key), h("span", "jmi-chip-rest", rest));
  return chip;
}

/** Two opposed arrows ("⇄"), drawn in the text colour: a tied row's mark, which shows at every
 *  width (the chip saying with whom may not). An SVG, not the glyph: fonts vary. */
export function tieIcon(): SVGSVGElement {
  const svg = iconSvg(12);
  for (const d of ["M2 5.5h11M10 2.5l3 3-3 3", "M14 10.5H3M6 7.5l-3 3 3 3"]) {
    const arrow = document.createElementNS(SVG_NS, "path");
    arrow.setAttribute("d", d);
    arrow.setAttribute("fill", "none");
    arrow.setAttribute("stroke", "currentColor");
    arrow.setAttribute("stroke-width", "1.6");
    arrow.setAttribute("stroke-linecap", "round");
    arrow.setAttribute("stroke-linejoin", "round");
    svg.append(arrow);
  }
  return svg;
}

/** A push pin, drawn in the text colour: a pinned part of a plan. */
export function pinIcon(): SVGSVGElement {
  const svg = iconSvg(11);
  const head = document.createElementNS(SVG_NS, "path");
  head.setAttribute("d", "M5 1.5h6l-1 4.5 2.5 3h-9L6 6z");
  head.setAttribute("fill", "currentColor");
  const needle = document.createElementNS(SVG_NS, "path");
  needle.setAttribute("d", "M8 9v6");
  needle.setAttribute("stroke", "currentColor");
  needle.setAttribute("stroke-width", "1.6");
  needle.setAttribute("stroke-linecap", "round");
  svg.append(head, needle);
  return svg;
}
