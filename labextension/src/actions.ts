// The action bar: Materialize → CPU / each GPU, Free, the Plan… and Save… toggles, then the RNG
// and dtype options. Each action is an entry of the widget's action table (keys.ts): its key on
// a tree row, why it cannot run now, what it does. The buttons are made once and updated in
// place, so the one with keyboard focus keeps it through every re-render; an unavailable one
// stays focusable and says why (dom.ts: setEnabled, Reasons). The bar is an ARIA toolbar: one
// Tab stop (the tree is one Shift+Tab away), ←/→ move inside it.

import { fitAmounts } from "./cells";
import { button, h, type Reasons, setEnabled } from "./dom";
import { type Action, declareKey, type Target, withKey } from "./keys";

type Fit = Record<string, { fits: boolean; need: number; free: number; why?: string }>;

export interface ActionHost {
  /** The widget model's `get`. */
  get(name: string): any;
  /** Send an action to the kernel (KernelLink.request). */
  request(content: Record<string, unknown>): void;
}

/** The key of the Materialize button of GPU `i`: g for the first, then its number (1–9). */
export function gpuShortcut(i: number): string | null {
  return i === 0 ? "G" : i <= 9 ? String(i) : null;
}

/** Why nothing can run: the kernel is gone, or an action runs or waits for its answer. */
export function busyWhy(busy: boolean, off: boolean): string {
  if (off) return "Unavailable: this widget is not connected to its model (see the banner)";
  return busy ? "Busy: wait for the running action, or Cancel it (key x)" : "";
}

/** A group of the bar's controls, kept on one line. */
function group(label: string): HTMLElement {
  const el = h("div", "jmi-group");
  el.setAttribute("role", "group");
  el.setAttribute("aria-label", label);
  return el;
}

/** Put `items` in `box`, touching the DOM only when they changed, so focus is never lost. */
function fill(box: HTMLElement, items: HTMLElement[]): void {
  const current = [...box.children];
  if (current.length !== items.length || current.some((el, i) => el !== items[i])) {
    box.replaceChildren(...items);
  }
}

export class ActionBar {
  readonly el = h("div", "jmi-actions");
  private readonly buttons = new Map<string, HTMLButtonElement>();
  private readonly sep = h("span", "jmi-sep");
  /** The bar wraps between groups, never inside one: materialize and free (one button per
   *  GPU), then the tools (values, plan, save, compare), then the options after the separator. */
  private readonly groups = {
    memory: group("Materialize and free"),
    tools: group("Measure, plan, save, compare"),
    options: group("Options"),
  };
  private table: Action[] = [];
  /** The toolbar item that Tab reaches (roving tabindex): the last one focused. */
  private current: HTMLElement | null = null;

  constructor(
    private readonly host: ActionHost,
    private readonly reasons: Reasons,
    /** The bars the Plan… and Save… toggles show, then the controls after the separator. */
    private readonly bars: { plan: HTMLElement; save: HTMLElement; compare: HTMLElement },
    private readonly trailing: HTMLElement[],
  ) {
    this.el.setAttribute("role", "toolbar");
    this.el.setAttribute("aria-label", "Actions on the ticked modules");
    this.sep.setAttribute("aria-hidden", "true");
    this.el.append(this.groups.memory, this.groups.tools, this.sep, this.groups.options);
    this.el.addEventListener("focusin", (ev) => {
      if (this.items().includes(ev.target as HTMLElement)) this.rove(ev.target as HTMLElement);
    });
  }

  /** The bar's actions as of the last render, for keys on tree rows. */
  get actions(): Action[] {
    return this.table;
  }

  /** The ticked rows as an action target (the selection summary describes them). */
  private ticked(): Target {
    const states: Record<string, number> = this.host.get("selection")?.states ?? {};
    const names: string[] = this.host.get("selected") ?? [];
    return { names, ticked: true, states: Object.keys(states) };
  }

  /** `busy`: an action runs or waits for its answer; `off`: the kernel or the model is gone. */
  render(busy: boolean, off: boolean): void {
    this.table = this.build(busy, off);
    const ticked = this.ticked();
    for (const action of this.table) {
      const b = action.button;
      if (!b) continue;
      const why = action.blocked(ticked);
      setEnabled(b, !why, off);
      declareKey(action);
      this.reasons.explain(b, withKey(why || action.what || action.label, action.shortcut));
    }
    for (const control of this.trailing) (control as HTMLSelectElement).disabled = busy || off;
    const buttons = this.table.flatMap((a) => (a.button ? [a.button] : []));
    const tools = new Set(["values", "plan", "save", "compare"]);
    const inTools = new Set(this.table.filter((a) => tools.has(a.id)).map((a) => a.button));
    fill(this.groups.memory, buttons.filter((b) => !inTools.has(b)));
    fill(this.groups.tools, buttons.filter((b) => inTools.has(b)));
    fill(this.groups.options, this.trailing);
    const items = this.items();
    this.rove(this.current && items.includes(this.current) ? this.current : items[0]);
  }

  /** The separator only between groups on one line: a wrapped line never starts with it. */
  placeSeparator(): void {
    const prev = this.sep.previousElementSibling as HTMLElement | null;
    const next = this.sep.nextElementSibling as HTMLElement | null;
    this.sep.hidden = false;
    if (prev && next && prev.offsetTop !== next.offsetTop) this.sep.hidden = true;
  }

  /** ←/→/Home/End inside the toolbar; true if the key was the toolbar's. */
  onKey(ev: KeyboardEvent): boolean {
    const items = this.items();
    const at = items.indexOf(ev.target as HTMLElement);
    if (at < 0 || ev.altKey || ev.ctrlKey || ev.metaKey || ev.shiftKey) return false;
    const to =
      ev.key === "ArrowRight" ? (at + 1) % items.length
      : ev.key === "ArrowLeft" ? (at - 1 + items.length) % items.length
      : ev.key === "Home" ? 0
      : ev.key === "End" ? items.length - 1
      : -1;
    if (to < 0) return false;
    ev.preventDefault();
    this.rove(items[to]);
    items[to].focus();
    return true;
  }

  /** Every button and select of the bar, in order, across its groups. */
  private controls(): HTMLElement[] {
    return Object.values(this.groups).flatMap((g) => [...g.children] as HTMLElement[]);
  }

  private items(): HTMLElement[] {
    return this.controls().filter((el) => !(el as HTMLSelectElement).disabled);
  }

  private rove(item: HTMLElement | undefined): void {
    if (!item) return;
    this.current = item;
    for (const el of this.controls()) el.tabIndex = el === item ? 0 : -1;
  }

  /** The bar's action table for the current devices. */
  private build(busy: boolean, off: boolean): Action[] {
    const fit: Fit = this.host.get("selection")?.fit ?? {};
    const common = (t: Target): string =>
      busyWhy(busy, off) || (t.names.length ? "" : "Select modules first (tick their checkboxes)");
    const noRoom = (device: string, t: Target): string => {
      const f = t.ticked ? fit[device] : undefined; // a focused row's fit: the kernel checks it
      if (!f || f.fits) return "";
      return f.why ?? `Does not fit: the selection ${fitAmounts(device, f)}. Select less, pick a smaller dtype or free something first.`;
    };
    const materialize = (id: string, label: string, device: string, cls: string, shortcut: string, what: string): Action => ({
      id,
      label: device === "cpu" ? "Materialize → CPU" : `Materialize → ${device}`,
      shortcut,
      what,
      button: this.button(id, label, cls),
      blocked: (t) => common(t) || noRoom(device, t),
      run: (t) => this.host.request({ action: "materialize", device, names: t.names }),
    });
    const table: Action[] = [
      materialize("cpu", "Materialize → CPU", "cpu", "jmi-primary jmi-mat-cpu", "M", "Allocate the selected subtrees on the CPU and compute their values"),
    ];
    const devices: Array<{ name: string; label: string }> = this.host.get("devices") ?? [];
    if (!devices.length) {
      const why = this.host.get("no_cuda_reason") || "No CUDA device is visible to this kernel.";
      // "→ cuda" as each GPU's "→ cuda:0" beside "Materialize → CPU": the bar fits one line
      // at 1400 px (JupyterLab with its file browser open); its name is said in full
      const b = this.button("nocuda", "→ cuda", "jmi-mat-cuda");
      b.setAttribute("aria-label", "Materialize → cuda");
      table.push({ id: "nocuda", label: "Materialize → cuda", shortcut: "G", button: b, blocked: () => why, run: () => undefined });
    }
    devices.forEach((d, i) => {
      const key = gpuShortcut(i);
      const action = materialize(`cuda ${d.name}`, `→ ${d.name}`, d.name, "jmi-mat-cuda", key ?? "", `Materialize on ${d.name} (${d.label})`);
      if (!key) action.shortcut = "";
      table.push(action);
    });
    table.push({
      id: "free",
      label: "Free",
      shortcut: "F",
      what: "Back to deferred: release the memory",
      button: this.button("free", "Free", "jmi-free"),
      blocked: (t) => {
        const why = common(t);
        if (why) return why;
        const real = t.states.some((s) => s && s !== "deferred" && s !== "meta");
        if (real) return "";
        return t.ticked ? "Nothing selected is materialized" : `Nothing in ${t.names[0] || "the model"} is materialized`;
      },
      run: (t) => this.host.request({ action: "free", names: t.names }),
    });
    table.push({
      id: "values",
      label: "Values",
      shortcut: "V",
      what: "Measure the values (std, absmax, NaN/inf, histograms) of the selected subtrees, or of the whole model if none is ticked; nothing is materialized",
      button: this.button("values", "Values", "jmi-values"),
      blocked: () => busyWhy(busy, off),
      run: (t) => this.host.request({ action: "values", names: t.names }),
    });
    table.push(this.toggle("plan", "Plan…", "P", this.bars.plan, off, "Plan which device each part goes to for a workload (allocates nothing)"));
    table.push(this.toggle("save", "Save…", "S", this.bars.save, off, "Write the model, or the selected subtree, as a checkpoint (safetensors or torch DCP)"));
    table.push(this.toggle("compare", "Compare with…", "D", this.bars.compare, off, "Compare with a checkpoint or a model in the notebook, tensor by tensor (the differences colour the rows)"));
    return table.filter((a) => a.shortcut || a.button);
  }

  private button(key: string, label: string, cls: string): HTMLButtonElement {
    let b = this.buttons.get(key);
    if (!b) {
      b = button(label, cls, () => {
        const action = this.table.find((a) => a.button === b);
        const target = this.ticked();
        if (action && !action.blocked(target)) action.run(target);
      });
      this.buttons.set(key, b);
    }
    b.textContent = label;
    return b;
  }

  /** An action that shows or hides one of the bars (plan, save), focus moving into it. */
  private toggle(key: string, label: string, shortcut: string, bar: HTMLElement, off: boolean, what: string): Action {
    const b = this.button(key, label, `jmi-toggle jmi-${key}-toggle`);
    b.setAttribute("aria-expanded", String(!bar.hidden));
    b.classList.toggle("jmi-on", !bar.hidden);
    return {
      id: key,
      label,
      shortcut,
      what,
      button: b,
      blocked: () => busyWhy(false, off),
      run: () => {
        bar.hidden = !bar.hidden;
        b.classList.toggle("jmi-on", !bar.hidden);
        b.setAttribute("aria-expanded", String(!bar.hidden));
        if (!bar.hidden) focusFirstField(bar);
      },
      focusAfter: () => (bar.hidden ? null : bar.querySelector<HTMLElement>("input, select")),
    };
  }
}

/** Focus a bar's first field; its text (a prefilled "auto", the last path) selected, so that
 *  typing replaces it, as JupyterLab's rename and save dialogs do. */
function focusFirstField(bar: HTMLElement): void {
  const field = bar.querySelector<HTMLElement>("input, select");
  field?.focus();
  if (field instanceof HTMLInputElement && field.type === "text") field.select();
}
