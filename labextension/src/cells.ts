// The small pieces a tree row and the header show: state badges, dtype/source/fast tags, a
// module's path as code, a fit in words.

import { h } from "./dom";
import { humanBytes, stateKind } from "./format";

/** "needs 3.64 TiB, 19.8 GiB free on cpu": by how much a selection misses a device. */
export function fitAmounts(device: string, f: { need: number; free: number }): string {
  return `needs ${humanBytes(f.need)}, ${humanBytes(f.free)} free on ${device}`;
}

/** A module's qualified name as Python the magics take: `model.layers.5` of `model` is
 *  `model.model.layers[5]`. */
export function codePath(varName: string, qname: string): string {
  if (!qname) return varName;
  let out = varName;
  for (const part of qname.split(".")) {
    if (/^\d+$/.test(part)) out += `[${part}]`;
    else if (/^[A-Za-z_][A-Za-z0-9_]*$/.test(part)) out += `.${part}`;
    else return `${varName}.get_submodule(${JSON.stringify(qname)})`;
  }
  return out;
}

/** What a state badge says: `deferred → cuda:0` when deferred parts have a target. */
export function stateText(state: string, target = ""): string {
  return state === "deferred" && target ? `deferred → ${target}` : state || "—";
}

export function badge(state: string, target = ""): HTMLElement {
  const b = h("span", `jmi-badge jmi-state-${stateKind(state)}`);
  if (state === "deferred" && target) {
    // two parts, so that a narrow column shortens "deferred" and keeps the device readable
    b.classList.add("jmi-badge-split");
    b.append(h("span", "jmi-badge-state", "deferred"), h("span", "jmi-badge-target", ` → ${target}`));
  } else {
    b.textContent = stateText(state, target);
  }
  b.title = state
    ? state === "deferred"
      ? `No memory allocated yet${target ? `; will be materialized on ${target} unless told otherwise` : ""}`
      : state === "mixed"
        ? "Partly materialized"
        : state === "meta"
          ? "On PyTorch's meta device: no values and no recording, cannot be materialized"
          : `Materialized on ${state}`
    : "Holds no parameters or buffers";
  return b;
}

/** Where the values come from, when it is a checkpoint file. */
export function sourceTag(source: string): HTMLElement {
  const tag = h("span", "jmi-dtype jmi-source", source === "checkpoint" ? "file" : "file+init");
  tag.title =
    source === "checkpoint"
      ? "Values come from a checkpoint file (read when materialized)"
      : "Partly from a checkpoint file, partly from the model's init (keys missing from the file)";
  return tag;
}

/** Values replayed with rng="fast": deterministic, but not what eager construction gives. */
export function fastTag(values: string): HTMLElement {
  const tag = h("span", "jmi-dtype jmi-fast");
  // "part " goes first when the widget is narrow (style.css), "fast" never
  if (values === "mixed") tag.append(h("span", "jmi-fast-part", "part "));
  tag.append("fast");
  tag.title =
    (values === "mixed" ? "Part of these values" : "These values") +
    ' were generated with RNG "fast": deterministic, but not the values eager construction gives. Materialize with RNG "exact" to re-generate them exactly.';
  return tag;
}

/** A small dtype tag: bf16, fp32, mixed. */
export function dtypeTag(dtype: string): HTMLElement {
  // "multi", not "mixed": the state badge beside it says "mixed" for something else
  const tag = h("span", "jmi-dtype", dtype === "mixed" ? "multi" : dtype);
  tag.title = dtype === "mixed" ? "Tensors of several dtypes" : `dtype ${dtype}`;
  return tag;
}
