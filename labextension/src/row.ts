// One row of the tree: tick box, name with its path to copy and its chips (tied, ×N identical,
// fast values), type, parameters, size, state, share of the model, and its planned device. Rows
// are made for the ones in view only (the tree is virtually scrolled) and made again on change.

import { badge, codePath, dtypeTag, fastTag, sourceTag, stateText } from "./cells";
import { appendHighlighted, appendName, cellWith, copyIcon, h, keyedChip, tieIcon } from "./dom";
import { humanBytes, humanCount, percent } from "./format";
import { deviceChip, pinMark, pinnedTo, type Plan } from "./plan";
import { CHECKED, PARTIAL, type Tree, type VisibleRow } from "./tree";
import { badFlag, badText, valueCells, type Values } from "./values";

export const ROW_HEIGHT = 26;

/** What a row needs from the view, read once per render. */
export interface RowContext {
  tree: Tree;
  /** Per node: CHECKED, PARTIAL or unchecked. */
  checks: Uint8Array;
  /** Whether visible row i is open (expanded, or showing children under a filter). */
  isOpen(i: number): boolean;
  focusNode: number;
  query: string;
  /** The name the model has in the notebook, for paths as code. */
  varName: string;
  /** Busy or disconnected: no ticking. */
  locked: boolean;
  plan: Plan;
  planned: boolean;
  /** What Values measured, if it ran; `valueColumns`: std and absmax shown as columns. */
  values: Values | null;
  valueColumns: boolean;
  /** What Compare with… found per node (the row's colour), and its words for the tooltip. */
  compared: { nodes: Map<number, { kind: string }> } | null;
  comparedText(node: number): string;
}

export function treeRow(ctx: RowContext, row: VisibleRow, i: number): HTMLElement {
  const t = ctx.tree;
  const n = row.node;
  const el = h("div", "jmi-row");
  el.dataset.node = String(n);
  el.style.top = `${i * ROW_HEIGHT}px`;
  if (row.match) el.classList.add("jmi-match");
  const check = ctx.checks[n];
  if (check === CHECKED) el.classList.add("jmi-selected");
  const hasKids = t.children[n].length > 0;
  const open = hasKids && ctx.isOpen(i);
  el.setAttribute("role", "treeitem");
  el.setAttribute("aria-level", String(row.depth + 1));
  el.setAttribute("aria-selected", String(check === CHECKED));
  if (hasKids) el.setAttribute("aria-expanded", String(open));
  const chip = ctx.planned ? deviceChip(ctx.plan, n) : null;
  const pin = ctx.planned ? pinnedTo(ctx.plan, t.qname[n]) : undefined;
  const on =
    (chip && chip.textContent !== "—" ? `, planned on ${chip.textContent}` : "") +
    (pin ? `, pinned to ${pin}` : "");
  const cmp = ctx.compared?.nodes.get(n);
  if (cmp) el.classList.add(`jmi-cmp-${cmp.kind}`);
  const m = ctx.values?.modules.get(n);
  const holds = m && badText(m) ? `, holds ${badText(m)} value${badCount(m) === 1 ? "" : "s"}` : "";
  // the tie is said whatever the width (its chip may be hidden in a narrow widget)
  const tiedTo = t.tied[n].length ? `tied to ${t.tied[n].map((k) => t.qname[k] || "the whole model").join(", ")}` : "";
  if (tiedTo) el.title = tiedTo;
  const repeated = repeatedText(t, n);
  if (cmp) el.title = [tiedTo, ctx.comparedText(n)].filter(Boolean).join("; ");
  el.setAttribute("aria-label", `${t.qname[n] || "the whole model"}, ${t.type[n]}, ${humanBytes(t.bytes[n])}, ${stateText(t.state[n], t.target[n])}${tiedTo ? `, ${tiedTo}` : ""}${repeated.text ? `, ${repeated.text}` : ""}${on}${holds}${cmp ? `; ${ctx.comparedText(n)}` : ""}`);
  el.tabIndex = n === ctx.focusNode ? 0 : -1;
  if (n === ctx.focusNode) el.classList.add("jmi-focus");

  const cbCell = h("div", "jmi-c-check");
  const cb = h("input", "jmi-check");
  cb.type = "checkbox";
  cb.tabIndex = -1; // the row is the focus stop; Space ticks
  cb.checked = check === CHECKED;
  cb.indeterminate = check === PARTIAL;
  cb.disabled = ctx.locked;
  cb.setAttribute("aria-label", `Select ${t.qname[n] || "the whole model"}`);
  cbCell.append(cb);

  const nameCell = h("div", "jmi-c-name");
  // the indent narrows with the widget and, below the first two levels, with depth
  // (style.css: --jmi-indent, --jmi-indent-deep), so that deep names keep their room
  const top = Math.min(row.depth, 2);
  nameCell.style.paddingLeft = `calc(${top} * var(--jmi-indent, 16px) + ${row.depth - top} * var(--jmi-indent-deep, 12px))`;
  const caret = h("span", `jmi-caret${hasKids ? "" : " jmi-leaf"}`, hasKids ? (open ? "▾" : "▸") : "");
  caret.setAttribute("aria-hidden", "true");
  const name = h("span", "jmi-name");
  const label = n === 0 ? "(model)" : t.name[n];
  appendName(name, label, row.match ? ctx.query : "");
  name.title = t.qname[n] || "the whole model";
  // the path as code the magics take, to copy (shown on hover and on the focused row)
  const code = codePath(ctx.varName, t.qname[n]);
  // an inline SVG, not a glyph: "⧉" and its kin are missing from common Linux fonts (tofu)
  const copy = h("button", "jmi-copy");
  copy.append(copyIcon());
  copy.type = "button";
  copy.tabIndex = -1; // the row is the focus stop
  copy.title = `Copy ${code} (the path %materialize and the other magics take; key on the row: c)`;
  copy.setAttribute("aria-label", `Copy ${code}`);
  copy.setAttribute("aria-keyshortcuts", "C");
  copy.dataset.code = code;
  // in a box that gives way first and wraps the button onto a hidden line: on a hovered or
  // focused row it shows whole where there is room, and never takes the name's
  const copyBox = h("span", "jmi-copybox");
  copyBox.append(h("span", "jmi-tags-spacer"), copy);
  nameCell.append(caret, name, copyBox);
  // A tied row's mark: an icon that shows at every width (in a leaf's empty caret slot, so it
  // takes no room from the name), whatever room its chip finds.
  const tied = t.tied[n];
  const names = tied.map((k) => t.qname[k] || "(model)");
  const sharesWith = `Shares a tensor with ${names.join(", ")}: counted once, and real or deferred together`;
  if (tied.length) {
    const mark = hasKids ? h("span", "jmi-tie-mark") : caret;
    mark.classList.add("jmi-tie-mark");
    mark.append(tieIcon());
    mark.title = sharesWith;
    if (hasKids) nameCell.insertBefore(mark, name);
  }
  // The chips beside the name, most important first (tied, repeated): each shows whole, or its
  // key alone ("tied", "×4"), or not at all, never cut to "×4, iden…" (style.css: .jmi-tags
  // wraps what does not fit onto a hidden line); their text stays in the row's title or
  // accessible name.
  const tags: HTMLElement[] = [];
  if (repeated.text) {
    const chip = keyedChip("jmi-chip", `×${repeated.count}`, repeated.same ? ", identical" : ", same structure");
    chip.title = repeated.title;
    tags.push(chip);
  }
  if (tied.length) {
    // the holder's last name ("embed_tokens"), "tied" alone where that does not fit; the
    // whole names are in the title and the row's accessible name
    const chip = keyedChip("jmi-chip jmi-tied", "tied", `: ${shortName(names[0])}${names.length > 1 ? ` +${names.length - 1}` : ""}`);
    chip.title = sharesWith;
    tags.unshift(chip);
  }

  // non-eager values are never hidden: the tag keeps its width, the name shrinks
  if (t.values[n]) nameCell.append(fastTag(t.values[n]));
  const measured = ctx.values?.modules.get(n);
  const bad = measured ? badFlag(measured) : null;
  if (bad) {
    nameCell.append(bad); // NaN and inf are never hidden, columns shown or not
    el.classList.add("jmi-has-bad");
  }
  if (tags.length) {
    const box = h("span", "jmi-tags");
    box.append(h("span", "jmi-tags-spacer"), ...tags);
    nameCell.append(box);
  }

  const typeCell = h("div", "jmi-c-type");
  appendHighlighted(typeCell, t.type[n], row.match ? ctx.query : "");
  if (t.info[n]) typeCell.title = `${t.type[n]}(${t.info[n]})`;

  const share = h("div", "jmi-c-share");
  const track = h("div", "jmi-bar");
  const fill = h("div", "jmi-bar-fill");
  const frac = t.totalBytes ? t.share[n] / t.totalBytes : 0;
  fill.style.width = `${Math.max(frac > 0 ? 1 : 0, 100 * frac).toFixed(1)}%`;
  track.append(fill);
  share.append(track, h("span", "jmi-pct", percent(t.share[n], t.totalBytes)));
  share.title = "Share of the model's memory (a tied tensor counts for its first holder)";

  // the figure in a box of its own width, so the dtype tags before it line up in a column
  const size = h("div", "jmi-c-num jmi-c-size");
  size.append(h("span", "jmi-bytes", humanBytes(t.bytes[n])));
  if (t.dtype[n]) size.prepend(dtypeTag(t.dtype[n]), " ");
  if (t.source[n]) size.prepend(sourceTag(t.source[n]), " ");

  el.append(
    cbCell,
    nameCell,
    typeCell,
    h("div", "jmi-c-num jmi-c-params", humanCount(t.params[n])),
    size,
    cellWith(badge(t.state[n], t.target[n]), "jmi-c-state"),
    share,
  );
  if (ctx.valueColumns) el.append(...valueCells(ctx.values?.modules.get(n)));
  if (chip) {
    const cell = cellWith(chip, "jmi-c-device");
    if (pin) {
      cell.prepend(pinMark(pin));
      el.classList.add("jmi-pinned");
    }
    el.append(cell);
  }
  return el;
}

/** What a row's ×N chip says in full: its count, whether the blocks are still identical (one
 *  cast to another dtype since differs), and its words for the chip's title and the row's
 *  accessible name; no text where the row starts no run of repeated blocks. */
function repeatedText(t: Tree, n: number): { count: number; same: boolean; text: string; title: string } {
  const rep = t.repeatedChildren(n);
  if (rep) {
    const same = t.stillIdentical(t.children[n][0], rep[0]);
    const title = same
      ? `${rep[0]} identical ${rep[1]} blocks`
      : `${rep[0]} ${rep[1]} blocks built identical; their dtypes or sizes now differ`;
    return { count: rep[0], same, text: title, title };
  }
  // a run of identical blocks among other children; leaves (two equal Linears) are not blocks
  const run = t.repN[n];
  if (t.children[n].length > 0 && run > 1 && t.repI[n] === 0 && t.children[t.parent[n]].length !== run) {
    const same = t.stillIdentical(n, run);
    const title = same
      ? `This ${t.type[n]} and the next ${run - 1} are identical blocks`
      : `This ${t.type[n]} and the next ${run - 1} were built identical; their dtypes or sizes now differ`;
    return { count: run, same, text: `first of ${run} ${same ? "identical" : "same-structure"} ${t.type[n]} blocks`, title };
  }
  return { count: 0, same: false, text: "", title: "" };
}

/** A tied holder's compact name: its last part ("embed_tokens"), or the last two where the last
 *  is an index ("layers.0"). */
function shortName(qname: string): string {
  const parts = qname.split(".");
  const last = parts.length > 1 && /^\d+$/.test(parts[parts.length - 1]) ? parts.slice(-2) : parts.slice(-1);
  return last.join(".");
}

function badCount(s: { nan: number; inf: number }): number {
  return (s.nan || 0) + (s.inf || 0);
}
