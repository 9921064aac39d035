import { describe, expect, it } from "vitest";
import { appendName, nameEndAt } from "../src/dom";

describe("long names", () => {
  it("keep their last underscore part (3 to 10 characters) as the end that stays", () => {
    expect("post_attention_layernorm".slice(nameEndAt("post_attention_layernorm"))).toBe("layernorm");
    expect("encoder_block_12".slice(nameEndAt("encoder_block_12"))).toBe("block_12");
    expect("verylongnamewithoutparts".slice(nameEndAt("verylongnamewithoutparts"))).toBe("tparts");
  });
  it("are not split when short", () => {
    expect(nameEndAt("q_proj")).toBe(0);
    expect(nameEndAt("embeddings")).toBe(0);
  });
  it("read whole and keep the filter's match marked across the two parts", () => {
    const el = document.createElement("span");
    appendName(el, "post_attention_layernorm", "ion_layer");
    expect(el.textContent).toBe("post_attention_layernorm");
    expect([...el.querySelectorAll("mark")].map((m) => m.textContent)).toEqual(["ion_", "layer"]);
    expect(el.querySelector(".jmi-name-end")!.textContent).toBe("layernorm");
  });
});
