// The action buttons under the toolbar: Materialize → CPU / each GPU, Free, the Plan… and Save…
// toggles. Each is made once and updated in place, so the one with keyboard focus keeps it
// through every re-render (after Enter, while busy, when it ends); an unavailable one stays
// focusable and says why (dom.ts: setEnabled, Reasons).

import { fitAmounts } from "./cells";
import { button, h, type Reasons, setEnabled } from "./dom";

type Fit = Record<string, { fits: boolean; need: number; free: number }>;

export interface ActionHost {
  /** The widget model's `get`. */
  get(name: string): any;
  /** Send an action to the kernel (KernelLink.request). */
  request(content: Record<string, unknown>): void;
}

export class ActionBar {
  readonly el = h("div", "jmi-actions");
  private readonly buttons = new Map<string, HTMLButtonElement>();
  private readonly sep = h("span", "jmi-sep");

  constructor(
    private readonly host: ActionHost,
    private readonly reasons: Reasons,
    /** The bars the Plan… and Save… toggles show, then the controls after the separator. */
    private readonly bars: { plan: HTMLElement; save: HTMLElement },
    private readonly trailing: HTMLElement[],
  ) {}

  /** `busy`: an action runs or waits for its answer; `disconnected`: the kernel is gone. */
  render(busy: boolean, disconnected: boolean): void {
    const names: string[] = this.host.get("selected") ?? [];
    const s = this.host.get("selection") ?? {};
    const states: Record<string, number> = s.states ?? {};
    const anyReal = Object.keys(states).some((k) => k !== "deferred");
    const none = names.length === 0;
    const why = none ? "Select modules first (tick their checkboxes)" : "";
    const fit: Fit = s.fit ?? {};
    const noRoom = (device: string): string => {
      const f = fit[device];
      return f && !f.fits
        ? `Does not fit: the selection ${fitAmounts(device, f)}. Select less, pick a smaller dtype or free something first.`
        : "";
    };
    const act = (action: string, device?: string) => () =>
      this.host.request({ action, device, names: this.host.get("selected") ?? [] });

    const cpu = this.button("cpu", "Materialize → CPU", "jmi-primary jmi-mat-cpu", act("materialize", "cpu"));
    setEnabled(cpu, !(busy || none || noRoom("cpu")));
    this.reasons.explain(cpu, why || noRoom("cpu") || "Allocate the selected subtrees on the CPU and compute their values");
    const shown: HTMLElement[] = [cpu];
    const devices: Array<{ name: string; label: string }> = this.host.get("devices") ?? [];
    if (!devices.length) {
      const b = this.button("nocuda", "Materialize → cuda", "jmi-mat-cuda", () => undefined);
      setEnabled(b, false); // focusable, so that its reason reaches the keyboard
      this.reasons.explain(b, this.host.get("no_cuda_reason") || "No CUDA device is visible to this kernel.");
      shown.push(b);
    }
    for (const d of devices) {
      const b = this.button(`cuda ${d.name}`, `→ ${d.name}`, "jmi-mat-cuda", act("materialize", d.name));
      setEnabled(b, !(busy || none || noRoom(d.name)));
      this.reasons.explain(b, why || noRoom(d.name) || `Materialize on ${d.name} (${d.label})`);
      shown.push(b);
    }
    const free = this.button("free", "Free", "jmi-free", act("free"));
    setEnabled(free, !(busy || none || !anyReal));
    this.reasons.explain(free, why || (anyReal ? "Back to deferred: release the memory" : "Nothing selected is materialized"));
    const plan = this.toggle("plan", "Plan…", this.bars.plan, disconnected, "Plan which device each part goes to for a workload (allocates nothing)");
    const save = this.toggle("save", "Save…", this.bars.save, disconnected, "Write the model, or the selected subtree, as a checkpoint (safetensors or torch DCP)");
    shown.push(free, plan, save, this.sep, ...this.trailing);
    // only touch the DOM when the set of buttons changed, so focus is never lost
    const current = [...this.el.children];
    if (current.length !== shown.length || current.some((el, i) => el !== shown[i])) {
      this.el.replaceChildren(...shown);
    }
  }

  private button(key: string, label: string, cls: string, onClick: () => void): HTMLButtonElement {
    let b = this.buttons.get(key);
    if (!b) {
      b = button(label, cls, onClick);
      this.buttons.set(key, b);
    }
    b.textContent = label;
    return b;
  }

  /** A button that shows or hides one of the bars (plan, save), focus moving into it. */
  private toggle(key: string, label: string, bar: HTMLElement, disconnected: boolean, why: string): HTMLButtonElement {
    const b = this.button(key, label, `jmi-toggle jmi-${key}-toggle`, () => {
      bar.hidden = !bar.hidden;
      b.classList.toggle("jmi-on", !bar.hidden);
      b.setAttribute("aria-expanded", String(!bar.hidden));
      if (!bar.hidden) bar.querySelector<HTMLElement>("input, select")?.focus();
    });
    b.setAttribute("aria-expanded", String(!bar.hidden));
    setEnabled(b, !disconnected);
    this.reasons.explain(b, why);
    return b;
  }
}
