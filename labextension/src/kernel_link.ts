// Talking to the kernel: every message gets an id and the kernel acknowledges each one. An
// action not acknowledged soon means the kernel is busy running a cell (the message waits in its
// queue); only the comm's close or the kernel's restart means it is gone. The link says which,
// in words, in its two status lines.

import { h } from "./dom";

/** A message the kernel has not acknowledged by then means it is busy (running a cell): the
 *  page says it waits. */
export const ACK_TIMEOUT_MS = 1500;

/** After this long without an answer, the page no longer assumes the kernel is only busy. */
export const SILENCE_MS = 10_000;
export const SILENT_KERNEL =
  "No answer from the kernel for 10 s. It is still busy with a long cell (your action runs when it ends), or it was shut down: if the notebook shows no kernel, start one and run the cells that build the model again.";

/** What the page says when the kernel restarted or stopped: the model went with it. */
export const GONE_KERNEL =
  "The kernel was restarted or stopped, and the model went with it. Run the cells that build the model again to get a live tree.";
/** What the page says when a kernel that answers does not know this widget: a saved copy of
 *  the tree (a notebook reopened with its widget state saved), or a kernel restarted since. */
export const NOT_CONNECTED =
  "This tree is not connected to a kernel: it is a saved copy, or the kernel that made it was restarted. Run the cells that build the model again to get a live tree.";
/** Kernel statuses after which the widget's comm is gone with the kernel. */
const GONE_STATUSES = new Set(["dead", "terminating", "restarting", "autorestarting"]);

/** What the page says when the widget was closed while the kernel lives on. */
export const GONE_WIDGET =
  "This widget was closed in the kernel. The model is still there if a name holds it: show it again with jupyter_metainit.explore(model), no need to rebuild it.";

/** What the view does when the link's state changes. */
export interface LinkEvents {
  /** An action (not a ping) was sent: the last action's message is not about this one. */
  actionSent(): void;
  /** Waiting, answered, connected or not changed; `connection` when it went or came back. */
  changed(connection: boolean): void;
}

export class KernelLink {
  /** The kernel is gone (comm closed, kernel restarted or dead). */
  disconnected = false;
  /** Why, once disconnected: GONE_KERNEL, GONE_WIDGET or NOT_CONNECTED. */
  why = "";
  /** A message was sent that the kernel has not answered yet for a while: it is busy. */
  waiting = false;
  readonly disconnectedEl = h("div", "jmi-disconnected");
  readonly waitingEl = h("div", "jmi-waiting");
  private nextId = 1;
  private readonly pending = new Map<number, number>();
  /** The unanswered messages that are actions (not pings). */
  private readonly blocking = new Set<number>();
  /** What the unanswered action is, in words ("Free", "Materialize → cpu"). */
  private queuedLabel = "";
  private silenceTimer = 0;
  private unwatch: () => void = () => undefined;

  constructor(
    private readonly send: (content: unknown) => void,
    private readonly events: LinkEvents,
  ) {
    this.disconnectedEl.setAttribute("role", "alert");
    this.disconnectedEl.tabIndex = -1; // holds the focus of a widget that went dead
    this.disconnectedEl.hidden = true;
    this.waitingEl.setAttribute("role", "status");
    this.waitingEl.hidden = true;
  }

  /** An action was sent and not answered yet: it counts as running, no second one meanwhile. */
  get actionPending(): boolean {
    return this.blocking.size > 0;
  }

  /** Send a message (its id, 0 if none was sent); a ping only asks whether the kernel is
   *  there and holds back nothing. */
  request(content: Record<string, unknown>): number {
    if (this.disconnected) return 0;
    const id = this.nextId++;
    this.pending.set(
      id,
      window.setTimeout(() => this.setWaiting(true), ACK_TIMEOUT_MS),
    );
    if (content.action !== "ping") {
      this.blocking.add(id);
      this.queuedLabel = actionLabel(content);
      this.events.actionSent();
    }
    this.send({ ...content, id });
    this.events.changed(false);
    return id;
  }

  acknowledged(id: number): void {
    clearTimeout(this.pending.get(id));
    this.pending.delete(id);
    this.blocking.delete(id);
    // The kernel answers: whatever was said in doubt no longer holds.
    const back = this.disconnected;
    if (back) {
      this.disconnected = false;
      this.disconnectedEl.hidden = true;
    }
    if (!this.pending.size) this.setWaiting(false);
    this.events.changed(back);
  }

  /** Follow the notebook's kernel through the widget manager (JupyterLab 4, Notebook 7): its
   *  shutdown, restart or replacement ends this widget at once. And a first ping tells whether
   *  the kernel knows this widget: the kernel answers the messages of its shell channel in
   *  order, so once it has answered a `kernel_info` request sent after the ping, a ping still
   *  unanswered a moment later went nowhere (a saved copy of the tree, no comm behind it); a
   *  kernel busy with a cell answers neither, and the widget only waits. Anything missing
   *  (another front end, a test page) leaves the link as it was. */
  watchKernel(manager: any): void {
    const session = manager?.context?.sessionContext;
    let kernel: any = null;
    try {
      kernel = manager?.kernel ?? session?.session?.kernel ?? null;
    } catch {
      kernel = null;
    }
    const onStatus = (_: unknown, status: string) => {
      if (GONE_STATUSES.has(status)) this.setDisconnected(GONE_KERNEL);
    };
    const onKernel = () => this.setDisconnected(GONE_KERNEL);
    const signals: Array<[any, (...a: any[]) => void]> = [];
    if (session?.statusChanged?.connect && session?.kernelChanged?.connect) {
      signals.push([session.statusChanged, onStatus], [session.kernelChanged, onKernel]);
    } else if (kernel?.statusChanged?.connect) {
      signals.push([kernel.statusChanged, onStatus]);
    }
    for (const [signal, slot] of signals) signal.connect(slot, this);
    this.unwatch = () => {
      for (const [signal, slot] of signals) signal.disconnect(slot, this);
    };
    if (!kernel) return;
    if (GONE_STATUSES.has(String(kernel.status))) {
      this.setDisconnected(GONE_KERNEL);
      return;
    }
    if (typeof kernel.requestKernelInfo !== "function") return;
    const ping = this.request({ action: "ping" });
    Promise.resolve(kernel.requestKernelInfo()).then(
      () => {
        window.setTimeout(() => {
          if (this.pending.has(ping)) this.setDisconnected(NOT_CONNECTED);
        }, ACK_TIMEOUT_MS);
      },
      () => undefined,
    );
  }

  setDisconnected(why = GONE_KERNEL): void {
    if (this.disconnected) return;
    this.disconnected = true;
    this.why = why;
    for (const timer of this.pending.values()) clearTimeout(timer);
    this.pending.clear();
    this.blocking.clear();
    this.setWaiting(false);
    this.disconnectedEl.textContent = `Disconnected. ${why}`;
    this.disconnectedEl.hidden = false;
    this.events.changed(true);
  }

  dispose(): void {
    this.unwatch();
    clearTimeout(this.silenceTimer);
    for (const timer of this.pending.values()) clearTimeout(timer);
  }

  private setWaiting(on: boolean): void {
    if (this.waiting === on) return;
    this.waiting = on;
    this.waitingEl.hidden = !on;
    const what = this.blocking.size && this.queuedLabel ? `your ${this.queuedLabel}` : "your action";
    this.waitingEl.textContent = on
      ? `Waiting for the kernel… it is busy (a cell is running); ${what} is queued and runs when it is free.`
      : "";
    clearTimeout(this.silenceTimer);
    // A shut-down kernel closes no comm and restarts nothing: it just never answers. After a
    // long silence the page says both possibilities, and what to do in each.
    if (on) {
      this.silenceTimer = window.setTimeout(() => {
        if (this.waiting) this.waitingEl.textContent = SILENT_KERNEL;
      }, SILENCE_MS);
    }
    this.events.changed(false);
  }
}

/** An action message in words, for the page to say what waits. */
export function actionLabel(content: Record<string, unknown>): string {
  if (content.action === "materialize") return `Materialize → ${String(content.device ?? "its device")}`;
  if (content.action === "free") return "Free";
  if (content.action === "materialize_plan") return "Materialize plan";
  if (content.action === "plan" || content.action === "pin" || content.action === "unpin") return "Plan";
  if (content.action === "save") return "Save";
  return String(content.action ?? "action");
}
