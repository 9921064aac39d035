// The plan and save bars: *Plan…* (devices, batch, seq len, inference/training), the plan's
// per-device bars (predicted peak against capacity) in the header, pins and *Materialize plan*;
// *Save…* (path, format). They only send actions: the kernel checks them, runs them on its
// worker thread and publishes the plan (the `plan` trait) or says why not (a notice).

import { busyWhy } from "./actions";
import { button, h, labelled, pinIcon, setEnabled } from "./dom";
import { humanBytes } from "./format";
import { type Action, declareKey, type Target, withKey } from "./keys";

/** The kernel's plan (tree_widget/plan_actions.py: plan_payload). */
export interface PlanDevice {
  name: string;
  peak: number;
  capacity: number;
  fits: boolean;
  parts: number;
}
export interface Plan {
  devices?: PlanDevice[];
  /** Per tree node: its device's position, -1 no tensors, -2 several devices. */
  nodes?: number[];
  fits?: boolean;
  headline?: string;
  advice?: string[];
  notes?: string[];
  pins?: Record<string, string>;
  request?: {
    devices?: string;
    batch?: number;
    seq_len?: number | null;
    training?: boolean;
    inputs?: number[][] | null;
    precision?: string | null;
  };
}

/** What the plan bar's Precision offers (plan/precision.py): value, label. */
export const PRECISIONS: Array<[string, string]> = [
  ["", "as built"],
  ["bf16", "bf16"],
  ["fp32", "fp32"],
  ["bf16-mixed", "bf16-mixed"],
];

/** One colour per device, told apart by people with the common colour-vision deficiencies
 *  (Okabe and Ito's palette); the device's name is always written beside it. */
export const DEVICE_COLORS = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#8c6d31", "#7f7f7f", "#f0e442"];

export function deviceColor(i: number): string {
  return DEVICE_COLORS[i % DEVICE_COLORS.length];
}

/** The device a module is pinned to in the plan, if it is. */
export function pinnedTo(plan: Plan, qname: string): string | undefined {
  return plan.pins?.[qname];
}

/** The pin marker of a pinned row: an icon beside its device, its meaning in words. */
export function pinMark(device: string): HTMLElement {
  const mark = h("span", "jmi-pin-mark");
  mark.append(pinIcon(), h("span", "jmi-sr", `pinned to ${device}`));
  mark.title = `Pinned to ${device}: the plan keeps it there (Clear pins drops the pins)`;
  return mark;
}

/** The device chip of a tree row: its colour, its name in words, "over" when it does not fit. */
export function deviceChip(plan: Plan, node: number): HTMLElement {
  const at = plan.nodes?.[node] ?? -1;
  const devices = plan.devices ?? [];
  if (at === -2) {
    const split = h("span", "jmi-devchip jmi-dev-split", "split");
    split.title = "Its parts go to several devices (see the rows below it)";
    return split;
  }
  const d = devices[at];
  if (!d) return h("span", "jmi-dev-none", "—");
  const chip = h("span", `jmi-devchip${d.fits ? "" : " jmi-dev-over"}`);
  // the name may shorten in a narrow column; "over" never does (style.css)
  chip.append(h("span", "jmi-dev-name", d.name));
  if (!d.fits) chip.append(h("span", "jmi-dev-overtag", " over"));
  chip.style.setProperty("--jmi-dev", deviceColor(at));
  chip.title = d.fits
    ? `Planned on ${d.name}`
    : `Planned on ${d.name}, which does not fit: ${humanBytes(d.peak)} predicted against ${humanBytes(d.capacity)}`;
  return chip;
}

/** The header's per-device bars: predicted peak against capacity, a legend of the colours. */
export function planHead(plan: Plan): HTMLElement {
  const head = h("div", "jmi-planhead");
  const devices = plan.devices ?? [];
  if (!devices.length) {
    head.hidden = true;
    return head;
  }
  head.setAttribute("role", "group");
  head.setAttribute("aria-label", "Planned peak per device");
  const title = h("div", `jmi-plan-headline${plan.fits ? "" : " jmi-nofit-text"}`);
  title.append(h("span", "jmi-label", "Plan"), ` ${plan.headline ?? ""}`);
  head.append(title);
  devices.forEach((d, i) => {
    const row = h("div", `jmi-devbar${d.fits ? "" : " jmi-dev-over"}`);
    const name = h("span", "jmi-devchip", d.name);
    name.style.setProperty("--jmi-dev", deviceColor(i));
    const track = h("div", "jmi-devbar-track");
    const fill = h("div", "jmi-devbar-fill");
    const frac = d.capacity ? d.peak / d.capacity : 0;
    fill.style.width = `${Math.min(100, 100 * frac).toFixed(1)}%`;
    fill.style.background = d.fits ? deviceColor(i) : "var(--jmi-err)";
    track.append(fill);
    track.setAttribute("role", "meter");
    track.setAttribute("aria-valuemin", "0");
    track.setAttribute("aria-valuemax", String(d.capacity));
    track.setAttribute("aria-valuenow", String(Math.min(d.peak, d.capacity)));
    track.setAttribute("aria-label", `${d.name}: predicted peak against capacity`);
    const amount = `${humanBytes(d.peak)} / ${humanBytes(d.capacity)} (${Math.round(100 * frac)}%)`;
    const text = h("span", "jmi-devbar-text", amount);
    const parts = h("span", "jmi-muted", `${d.parts} part${d.parts === 1 ? "" : "s"}`);
    row.append(name, track, text, parts);
    if (!d.fits) row.append(h("strong", "jmi-over-text", `over by ${humanBytes(d.peak - d.capacity)}`));
    head.append(row);
  });
  return head;
}

export interface BarHost {
  /** Send an action to the kernel (TreeView.request). */
  request(content: Record<string, unknown>): void;
  /** The model's `get`. */
  get(name: string): any;
  /** Say what a button does or why it is unavailable, to the mouse and the keyboard (Reasons). */
  explain(b: HTMLButtonElement, why: string): void;
  /** Say something in the widget's live region (its notice), e.g. why Enter did nothing. */
  say(text: string): void;
}

/** Enter in a bar's field: run it, or, with its button unavailable, say why in the live region
 *  (a screen reader hears nothing from a disabled button) and leave the focus in the field. */
export function submitOrSay(host: BarHost, b: HTMLButtonElement, label: string, run: () => void): void {
  if (b.getAttribute("aria-disabled") !== "true") run();
  else host.say(`${label}: ${b.title || "not available now"}`);
}

/** Available or not (focusable either way), with what it does or why not; `dead`: the widget is
 *  not connected to its model, nothing in it is a control. */
function enable(host: BarHost, b: HTMLButtonElement, on: boolean, why: string, dead = false): void {
  setEnabled(b, on, dead);
  host.explain(b, why);
}

/** The *Plan…* bar: the plan's options, then pins and *Materialize plan* once there is a plan. */
export class PlanBar {
  readonly el = h("form", "jmi-bar-form jmi-planbar");
  readonly devices = h("input", "jmi-input jmi-plan-devices");
  readonly batch = h("input", "jmi-input jmi-num");
  readonly seqLen = h("input", "jmi-input jmi-num");
  readonly inputs = h("input", "jmi-input jmi-plan-inputs");
  readonly mode = h("select", "jmi-select jmi-plan-mode");
  readonly precision = h("select", "jmi-select jmi-plan-precision");
  readonly planBtn = h("button", "jmi-btn jmi-primary jmi-plan-go", "Plan");
  readonly pinSel = h("select", "jmi-select jmi-pin-device");
  readonly pinBtn: HTMLButtonElement;
  readonly unpinBtn: HTMLButtonElement;
  readonly matBtn: HTMLButtonElement;
  private readonly after = h("div", "jmi-plan-after");
  private readonly advice = h("ul", "jmi-plan-advice");
  /** Why each of the plan's actions cannot run now (as of the last render), "" if it can. */
  private readonly blocked = { plan: "", pin: "", unpin: "", mat: "" };

  constructor(private readonly host: BarHost) {
    this.el.hidden = true;
    this.el.setAttribute("aria-label", "Plan where each part goes");
    this.devices.type = "text";
    this.devices.placeholder = "cuda:0=80GiB, cuda:1=80GiB  or  auto";
    this.devices.value = "auto";
    this.devices.title = "Devices in pipeline order, each with its capacity (GiB 1024-based, GB 1000-based); auto: the visible devices' free memory";
    this.batch.type = "number";
    this.batch.min = "1";
    this.batch.value = "1";
    this.seqLen.type = "number";
    this.seqLen.min = "1";
    this.seqLen.placeholder = "tokens";
    this.seqLen.title = "Tokens per sample (prompt + generated) for a language model";
    this.inputs.type = "text";
    this.inputs.placeholder = "(8, 3, 224, 224)";
    this.inputs.title =
      "Instead of Seq len, for a model whose forward takes other inputs: their shapes, batch included (several: (8, 3, 224, 224), (8,))";
    for (const [v, t] of [["inference", "Inference"], ["training", "Training (AdamW)"]]) {
      const o = h("option", "", t);
      o.value = v;
      this.mode.append(o);
    }
    this.mode.setAttribute("aria-label", "Workload");
    for (const [v, t] of PRECISIONS) this.precision.append(Object.assign(h("option", "", t), { value: v }));
    this.precision.title =
      "How weights, gradients, optimizer states and activations are stored: as built (each tensor's own dtype), bf16, fp32, or bf16-mixed (autocast: fp32 weights, bf16 activations). Materialize plan makes the weights this dtype.";
    this.planBtn.type = "submit";
    // Enter in any field plans, as the button does
    this.el.addEventListener("submit", (ev) => {
      ev.preventDefault();
      submitOrSay(host, this.planBtn, "Plan", () => this.submit());
    });
    this.pinSel.setAttribute("aria-label", "Device to pin the selected parts to");
    this.pinBtn = button("Pin selection", "jmi-pin", () =>
      host.request({ action: "pin", device: this.pinSel.value, names: host.get("selected") ?? [] }),
    );
    this.unpinBtn = button("Clear pins", "jmi-unpin", () => host.request({ action: "unpin" }));
    this.matBtn = button("Materialize plan", "jmi-primary jmi-mat-plan", () =>
      host.request({ action: "materialize_plan" }),
    );
    const form = h("div", "jmi-bar-row");
    form.append(
      labelled("Devices", this.devices),
      labelled("Batch", this.batch),
      labelled("Seq len", this.seqLen),
      labelled("or Inputs", this.inputs),
      this.mode,
      labelled("Precision", this.precision),
      this.planBtn,
    );
    const pinLabel = h("span", "jmi-field-label", "Pin selection to");
    this.after.append(pinLabel, this.pinSel, this.pinBtn, this.unpinBtn, this.matBtn);
    this.after.classList.add("jmi-bar-row");
    this.el.append(form, this.after, this.advice);
  }

  submit(): void {
    const seq = this.seqLen.value.trim();
    this.host.request({
      action: "plan",
      devices: this.devices.value,
      batch: Number(this.batch.value) || 1,
      seq_len: seq ? Number(seq) : null,
      training: this.mode.value === "training",
      inputs: this.inputs.value.trim() || null,
      precision: this.precision.value || null,
    });
  }

  /** The plan's actions for keys on tree rows: Materialize plan, Pin, Clear pins. */
  actions(): Action[] {
    const run = (content: Record<string, unknown>) => () => this.host.request(content);
    const table: Action[] = [
      { id: "mat-plan", label: "Materialize plan", shortcut: "Shift+M", button: this.matBtn, blocked: () => this.blocked.mat, run: run({ action: "materialize_plan" }) },
      {
        id: "pin",
        label: "Pin selection",
        shortcut: "Shift+P",
        button: this.pinBtn,
        blocked: (t: Target) => this.blocked.plan || (this.pinSel.options.length ? "" : "Plan first (Plan…), then pin parts to its devices") || (t.names.length ? "" : "Select parts first (tick their checkboxes)"),
        run: (t: Target) => this.host.request({ action: "pin", device: this.pinSel.value, names: t.names }),
      },
      { id: "unpin", label: "Clear pins", shortcut: "U", button: this.unpinBtn, blocked: () => this.blocked.unpin, run: run({ action: "unpin" }) },
    ];
    for (const a of table) declareKey(a);
    return table;
  }

  render(busy: boolean, off = false): void {
    this.actions(); // declares their keys on the buttons
    for (const field of [this.devices, this.batch, this.seqLen, this.inputs, this.mode, this.precision]) field.disabled = off;
    const plan: Plan = this.host.get("plan") ?? {};
    const devices = plan.devices ?? [];
    const names: string[] = this.host.get("selected") ?? [];
    this.blocked.plan = busyWhy(busy, off);
    enable(this.host, this.planBtn, !busy, this.blocked.plan || "Plan where each part goes (allocates nothing)", off);
    this.after.hidden = !devices.length;
    const keep = this.pinSel.value;
    this.pinSel.replaceChildren(
      ...devices.map((d) => {
        const o = h("option", "", d.name);
        o.value = d.name;
        return o;
      }),
    );
    if (devices.some((d) => d.name === keep)) this.pinSel.value = keep;
    this.pinSel.disabled = busy;
    const pins = Object.keys(plan.pins ?? {});
    const pinWhy = this.blocked.plan || (names.length ? "" : "Select parts first (tick their checkboxes)");
    enable(this.host, this.pinBtn, !pinWhy, withKey(pinWhy || "Put the selected parts on this device and re-plan the rest", "Shift+P"), off);
    this.blocked.unpin = this.blocked.plan || (pins.length ? "" : "Nothing is pinned");
    enable(this.host, this.unpinBtn, !this.blocked.unpin, withKey(this.blocked.unpin || `Drop the pins (${pins.join(", ")}) and re-plan`, "U"), off);
    this.unpinBtn.textContent = pins.length ? `Clear pins (${pins.length})` : "Clear pins";
    // a plan over devices this kernel lacks (planned for another machine) cannot be materialized here
    const usable = new Set(["cpu", ...((this.host.get("devices") ?? []) as Array<{ name: string }>).map((d) => d.name)]);
    const missing = devices.filter((d) => !usable.has(d.name)).map((d) => d.name);
    this.blocked.mat =
      this.blocked.plan ||
      (!devices.length
        ? "Plan first (Plan…): there is no plan to materialize"
        : missing.length
          ? `This kernel has no ${missing.join(", ")}: plan over its own devices (auto) to materialize here`
          : "");
    enable(this.host, this.matBtn, !this.blocked.mat, withKey(this.blocked.mat || "Materialize every part on its planned device", "Shift+M"), off);
    this.advice.replaceChildren(
      ...[...(plan.advice ?? []).map((a) => `To fit: ${a}`), ...(plan.notes ?? [])].map((t) => h("li", "", t)),
    );
    this.advice.hidden = !this.advice.children.length;
  }
}

/** The *Save…* bar: where, in which format; progress and Cancel are the widget's own. */
export class SaveBar {
  readonly el = h("form", "jmi-bar-form jmi-savebar");
  readonly path = h("input", "jmi-input jmi-save-path");
  readonly format = h("select", "jmi-select jmi-save-format");
  readonly saveBtn = h("button", "jmi-btn jmi-primary jmi-save-go", "Save");
  private readonly what = h("span", "jmi-muted jmi-save-what");

  constructor(private readonly host: BarHost) {
    this.el.hidden = true;
    this.el.setAttribute("aria-label", "Save the model or the selected subtree");
    this.path.type = "text";
    this.path.placeholder = "directory, e.g. checkpoints/seed";
    for (const [v, t] of [["safetensors", "safetensors"], ["dcp", "torch DCP"]]) {
      const o = h("option", "", t);
      o.value = v;
      this.format.append(o);
    }
    this.format.setAttribute("aria-label", "Checkpoint format");
    this.saveBtn.type = "submit";
    this.el.addEventListener("submit", (ev) => {
      ev.preventDefault();
      submitOrSay(host, this.saveBtn, "Save", () => this.submit());
    });
    const row = h("div", "jmi-bar-row");
    row.append(labelled("Save to", this.path), this.format, this.saveBtn, this.what);
    this.el.append(row);
  }

  submit(): void {
    this.host.request({
      action: "save",
      path: this.path.value,
      format: this.format.value,
      names: this.host.get("selected") ?? [],
    });
  }

  render(busy: boolean, off = false): void {
    const names: string[] = this.host.get("selected") ?? [];
    this.path.disabled = off;
    this.format.disabled = off;
    this.what.textContent =
      names.length === 0 || (names.length === 1 && !names[0]) ? "the whole model" : names.length === 1 ? `only ${names[0]}` : "select one subtree, or none";
    enable(this.host, this.saveBtn, !busy && names.length <= 1, busyWhy(busy, off) || (names.length > 1 ? "Select one subtree, or none for the whole model" : "Write the values materialize would give, tensor by tensor; nothing in the model changes"), off);
  }
}
