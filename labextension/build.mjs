// Builds the widget's ES module and CSS into the Python package (jupyter_metainit/jupyter/static/).
// The first line of each output records a hash of the sources, so a test can tell whether the
// committed files are fresh without Node.  Usage: node build.mjs [outdir]
import { createHash } from "node:crypto";
import { readdirSync, readFileSync, mkdirSync, writeFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const here = dirname(fileURLToPath(import.meta.url));
const outdir = resolve(process.argv[2] ?? join(here, "..", "jupyter_metainit", "jupyter", "static"));

/** Files whose content determines the build: src/ (not tests), this script, the lockfile. */
export function sourceFiles() {
  const out = [];
  const walk = (dir) => {
    for (const e of readdirSync(dir, { withFileTypes: true })) {
      const p = join(dir, e.name);
      if (e.isDirectory()) walk(p);
      else if (!e.name.includes(".test.")) out.push(p);
    }
  };
  walk(join(here, "src"));
  out.push(join(here, "build.mjs"), join(here, "package.json"), join(here, "package-lock.json"));
  return out.map((p) => relative(here, p).split("\\").join("/")).sort();
}

export function sourceHash() {
  const h = createHash("sha256");
  for (const rel of sourceFiles()) {
    h.update(rel);
    h.update("\0");
    h.update(readFileSync(join(here, rel)));
    h.update("\0");
  }
  return h.digest("hex");
}

const hash = sourceHash();
const banner = `/* jupyter_metainit widget, built by labextension/build.mjs; sources sha256: ${hash} */`;
const result = await esbuild.build({
  entryPoints: { widget: join(here, "src", "index.ts") },
  bundle: true,
  format: "esm",
  target: "es2020",
  minify: true,
  legalComments: "none",
  write: false,
  outdir,
  banner: { js: banner, css: banner },
  logLevel: "warning",
});
mkdirSync(outdir, { recursive: true });
for (const f of result.outputFiles) {
  writeFileSync(f.path, f.contents);
  console.log(`wrote ${relative(process.cwd(), f.path)} (${f.contents.length} bytes)`);
}
