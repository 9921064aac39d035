"""The committed front end (jupyter_metainit/jupyter/static/) is built from labextension/ as is."""

from __future__ import annotations

import hashlib
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABEXT = ROOT / "labextension"
STATIC = ROOT / "jupyter_metainit" / "jupyter" / "static"
BUILT = ("widget.js", "widget.css")


def source_hash() -> str:
    """The same hash labextension/build.mjs writes into the built files' first line."""
    files = [p for p in (LABEXT / "src").rglob("*") if p.is_file() and ".test." not in p.name]
    files += [LABEXT / "build.mjs", LABEXT / "package.json", LABEXT / "package-lock.json"]
    h = hashlib.sha256()
    for rel in sorted(p.relative_to(LABEXT).as_posix() for p in files):
        h.update(rel.encode() + b"\0" + (LABEXT / rel).read_bytes() + b"\0")
    return h.hexdigest()


@pytest.mark.parametrize("name", BUILT)
def test_built_file_records_current_sources(name):
    first = (STATIC / name).read_text().split("\n", 1)[0]
    recorded = re.search(r"sources sha256: ([0-9a-f]{64})", first)
    assert recorded, f"{name} has no source hash; rebuild with: cd labextension && npm run build"
    assert recorded.group(1) == source_hash(), (
        f"{name} is stale; rebuild with: cd labextension && npm run build"
    )


@pytest.mark.skipif(
    shutil.which("node") is None or not (LABEXT / "node_modules" / "esbuild").exists(),
    reason="needs node and labextension/node_modules (cd labextension && npm ci)",
)
def test_rebuild_gives_the_same_bytes(tmp_path):
    subprocess.run(
        ["node", "build.mjs", str(tmp_path)], cwd=LABEXT, check=True, capture_output=True
    )
    for name in BUILT:
        assert (tmp_path / name).read_bytes() == (STATIC / name).read_bytes(), name


@pytest.mark.skipif(
    shutil.which("npm") is None or not (LABEXT / "node_modules" / "vitest").exists(),
    reason="needs npm and labextension/node_modules (cd labextension && npm ci)",
)
def test_front_end_unit_tests_and_type_check_pass():
    out = subprocess.run(
        ["npm", "test", "--silent"], cwd=LABEXT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
