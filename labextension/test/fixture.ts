import { type Row, rowOf } from "../src/rows";
import type { TreeJSON } from "../src/tree";

/**
 * model (Net)
 *   embed (Embedding)          own tensors, 100 params
 *   layers (ModuleList)
 *     0 (Block)  -> attn (Linear) 10, mlp (Linear) 20
 *     1 (Block)  -> attn (Linear) 10, mlp (Linear) 20
 *   norm (Norm)                own tensors, 5 params
 */
export function smallTree(): TreeJSON {
  const types = ["Net", "Embedding", "ModuleList", "Block", "Linear", "Norm"];
  const r = (
    parent: number, name: string, type: number, params: number, repI = 0, repN = 1, own = 0,
  ): Row =>
    rowOf({ parent, name, type, params, bytes: params * 4, state: "deferred", rep_i: repI, rep_n: repN, info: "", own });
  const nodes: Row[] = [
    r(-1, "", 0, 165), // 0
    r(0, "embed", 1, 100, 0, 1, 1), // 1
    r(0, "layers", 2, 60), // 2
    r(2, "0", 3, 30, 0, 2), // 3
    r(3, "attn", 4, 10, 0, 1, 1), // 4
    r(3, "mlp", 4, 20, 0, 1, 1), // 5
    r(2, "1", 3, 30, 1, 2), // 6
    r(6, "attn", 4, 10, 0, 1, 1), // 7
    r(6, "mlp", 4, 20, 0, 1, 1), // 8
    r(0, "norm", 5, 5, 0, 1, 1), // 9
  ];
  return { v: 1, types, nodes };
}

/** A tree shaped like a 70B Llama: 80 decoder layers of 12 modules each. */
export function bigTree(layers = 80): TreeJSON {
  const types = ["LlamaForCausalLM", "LlamaModel", "Embedding", "ModuleList", "LlamaDecoderLayer",
    "LlamaAttention", "Linear", "LlamaMLP", "SiLU", "LlamaRMSNorm"];
  const nodes: Row[] = [];
  const add = (p: number, name: string, t: number, params: number, ri = 0, rn = 1): number => {
    nodes.push(
      rowOf({ parent: p, name, type: t, params, bytes: params * 2, state: "deferred", rep_i: ri, rep_n: rn, info: "", own: 0 }),
    );
    return nodes.length - 1;
  };
  const root = add(-1, "", 0, 70e9);
  const model = add(root, "model", 1, 69e9);
  add(model, "embed_tokens", 2, 1e9);
  const list = add(model, "layers", 3, 68e9);
  for (let i = 0; i < layers; i++) {
    const l = add(list, String(i), 4, 0.85e9, i, layers);
    const a = add(l, "self_attn", 5, 0.15e9);
    for (const n of ["q_proj", "k_proj", "v_proj", "o_proj"]) add(a, n, 6, 0.03e9);
    const m = add(l, "mlp", 7, 0.7e9);
    for (const n of ["gate_proj", "up_proj", "down_proj"]) add(m, n, 6, 0.23e9);
    add(m, "act_fn", 8, 0);
    add(l, "input_layernorm", 9, 8192);
    add(l, "post_attention_layernorm", 9, 8192);
  }
  add(model, "norm", 9, 8192);
  add(root, "lm_head", 6, 1e9);
  return { v: 1, types, nodes };
}
