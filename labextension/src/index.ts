// anywidget entry point of jupyter_metainit's model tree widget.

import "./style.css";

import type { PatchRow, TreeJSON } from "./tree";
import { TreeView, type WidgetModel } from "./view";

/** Keep the model's copy of the tree current, so views opened later show the latest state. */
function initialize({ model }: { model: WidgetModel }): () => void {
  const onMsg = (msg: any) => {
    if (!msg || msg.kind !== "patch") return;
    const tree = model.get("tree") as TreeJSON | undefined;
    if (!tree?.nodes) return;
    for (const [node, params, bytes, state, dtype, share, target, source, values] of msg.nodes as PatchRow[]) {
      const row = tree.nodes[node];
      if (row) {
        row[3] = params;
        row[4] = bytes;
        row[5] = state;
        if (dtype !== undefined) row[10] = dtype;
        if (share !== undefined) row[11] = share;
        if (target !== undefined) row[12] = target;
        if (source !== undefined) row[14] = source;
        if (values !== undefined) row[15] = values;
      }
    }
  };
  model.on("msg:custom", onMsg);
  return () => model.off("msg:custom", onMsg);
}

function render({ model, el }: { model: WidgetModel; el: HTMLElement }): () => void {
  const view = new TreeView(model, el);
  return () => view.dispose();
}

export default { initialize, render };
