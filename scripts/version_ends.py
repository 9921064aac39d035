"""Test both ends of what ``pyproject.toml`` admits, each in its own virtual environment.

The pinned environment of ``scripts/setup.sh`` (torch's CPU build at one version) runs the whole
suite; this runs the ends' subset of the core tests (``END_TESTS``: the files whose outcome
depends on the releases; ``--all-core`` for every core file) and ``scripts/smoke_exactness.py``
at the two ends of the declared ranges, as users' environments are:

- ``newest``: the newest Python tested, with the newest torch, transformers and accelerate that
  the package's requirements admit (whatever the index has today, resolved by the installer);
- ``lowest``: the oldest Python declared, with the lowest torch, transformers and accelerate the
  requirements declare (``torch>=X`` installs ``torch==X``).

Each end lives in ``.version-ends/<end>/venv`` (git-ignored) and is made with uv, whose cache
(``UV_CACHE_DIR``, by default ``~/.cache/uv``) keeps the multi-GB CUDA builds of torch that PyPI
serves (they run on the CPU) for the next run: a second run on the same machine downloads
nothing, and an unchanged end is not reinstalled. Each end writes
``.version-ends/<end>/result.json``; the table of ``docs/compatibility.md`` is made from those
results and the ones recorded in ``scripts/compatibility_runs.json``:

    python scripts/version_ends.py                  # both ends; exits 1 if either fails
    python scripts/version_ends.py --ends newest    # one end
    python scripts/version_ends.py --record         # and record the results, rewrite the page
    python scripts/version_ends.py --all-core       # every core test file (about an hour an end)

CI (``.ci/run``) runs it before the full suite. ``--record`` is for a developer (it changes
tracked files); without it the regenerated page goes to ``.version-ends/compatibility.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from compatibility_table import RUNS, read_pyproject, requirement, write_page  # noqa: E402

ENDS_DIR = Path(os.environ.get("VERSION_ENDS_DIR", ROOT / ".version-ends"))

# The core tests: everything but the browser, notebook, documentation, packaging, lint and
# front-end build tests (tools, not torch/transformers behaviour), the benchmarks' own test
# (timings) and the checks of this repository's version claims (the whole suite runs those).
NOT_CORE = {
    "test_benchmarks.py",
    "test_compatibility.py",
    "test_docs.py",
    "test_labextension_build.py",
    "test_lint.py",
    "test_notebooks.py",
    "test_package.py",
    "test_widget_browser.py",
}
# What each end runs by default: the core test files whose outcome hangs on the torch,
# transformers, accelerate, IPython or Python release, small enough that both ends (downloads,
# environments, tests, smoke check) fit beside the whole suite in CI's 90 minutes on 2 cores
# (figures: docs/compatibility.md). ``--all-core`` runs every core file instead. Left out: the
# files that test the package's own bookkeeping (plans, estimates' tables, the widget, stats,
# progress, locks, argument parsing), which call torch only through what these files cover.
END_TESTS = {
    "test_op_db.py": "every operator of the release's own op database, deferred against eager: "
    "operator schemas, overloads, the writes kernels make without declaring them",
    "test_record.py": "recording: the dispatch and torch-function modes, schemas read per overload",
    "test_replay.py": "replay of the records a set of storages depends on",
    "test_realized_ops.py": "ops that need real values while recording (item, nonzero, ...)",
    "test_autograd_in_init.py": "autograd inside a deferred build (grad mode, version counters)",
    "test_rng.py": "each random op's place in its generator's stream; draw counts checked "
    "against the kernel at import",
    "test_mt19937.py": "the CPU generator's MT19937 state layout and the jump-ahead",
    "test_trunc_normal.py": "trunc_normal_'s fast path against the kernel (failed on 2.10, 2.11)",
    "test_split_fill.py": "random fills cut across cores equal the serial kernel",
    "test_native_fill.py": "the native normal_/uniform_ against the release's own kernels "
    "(2.12 makes bfloat16/float16 normal_ another way: torch's kernel runs there)",
    "test_stream_fill.py": "a batch's random fills as one run of the stream",
    "test_init_functions.py": "every torch.nn.init function, deferred against eager",
    "test_exactness.py": "materialize equals eager construction, model by model",
    "test_materialize.py": "materialize / dematerialize, the walker of a module's tensors",
    "test_swap.py": "torch._C._swap_tensor_impl and the autograd state it must keep",
    "test_sparse.py": "sparse layouts (their constructors and checks change between releases)",
    "test_from_pretrained.py": "transformers' from_pretrained / from_config, deferred",
    "test_save_pretrained.py": "save_pretrained of a deferred model against eager's files "
    "(transformers 5.0 to 5.14 differed)",
    "test_save.py": "save(): safetensors and torch.save files written tensor by tensor",
    "test_save_dcp.py": "torch.distributed.checkpoint's writer and metadata",
    "test_magics.py": "the magics and their tracebacks (IPython 8 on Python 3.10, 9 after)",
    "test_dry_run.py": "dry_run: the flop counter and the fake-tensor forward",
    "test_distributed.py": "DTensor / FSDP2 shards made on each rank (gloo)",
}
# What an end's pytest needs besides the package and its ``hf`` extra.
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.2", "expecttest>=0.2"]
PACKAGES = ["python", "torch", "transformers", "accelerate", "ipython", "numpy"]


def core_tests() -> list[str]:
    """The test files every end runs, relative to the repository root."""
    files = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in files if p.name not in NOT_CORE]


def end_tests() -> list[str]:
    """The ends' subset (``END_TESTS``), relative to the repository root."""
    return [f"tests/{name}" for name in END_TESTS]


def lowest_pins(project: dict[str, Any]) -> list[str]:
    """``name==X`` for each of torch, transformers and accelerate declared ``name>=X``."""
    pins = []
    declared = project["dependencies"] + [r for rs in project["extras"].values() for r in rs]
    for name in ("torch", "transformers", "accelerate"):
        for declared_requirement in declared:
            found = re.match(rf"{name}\s*>=\s*([\w.]+)", declared_requirement)
            if found:
                pins.append(f"{name}=={found.group(1)}")
                break
    return pins


def find_python(version: str) -> str | None:
    """An interpreter for ``version`` ("3.13"): ``python3.13`` on PATH when it runs, else
    pyenv's newest 3.13.x; None when neither is there."""
    on_path = shutil.which(f"python{version}")
    if on_path and subprocess.run([on_path, "-c", ""], capture_output=True).returncode == 0:
        return on_path
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(
        pyenv_root.glob(f"{version}.*/bin/python{version}"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parts[-3])],
    )
    return str(found[-1]) if found else None


def uv() -> str:
    """uv, installed once into ``.version-ends/tools`` (it caches downloads, pip does not here:
    the index's responses carry no caching headers)."""
    tools = ENDS_DIR / "tools"
    exe = tools / "bin" / "uv"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
        pip = [str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet", "uv>=0.5"]
        # PyPI only: this machine's pip configuration adds local indexes that warn per package
        subprocess.run(pip, check=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    return str(exe)


def make_env(end: str, python: str, requirements: list[str]) -> Path:
    """The end's venv with ``requirements`` and the package (editable, with ``hf``); reused when
    nothing changed (a hash of the requirements, the interpreter and pyproject.toml)."""
    venv = ENDS_DIR / end / "venv"
    stamp = venv / ".version-ends-stamp"
    pyproject = (ROOT / "pyproject.toml").read_text()
    want = hashlib.sha256(json.dumps([python, requirements, pyproject]).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want and (venv / "bin" / "python").exists():
        log(f"{end}: environment up to date")
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    log(f"{end}: creating {venv} with {python}: {' '.join(requirements)}")
    subprocess.run([uv(), "venv", "--quiet", "--python", python, str(venv)], check=True)
    install = [uv(), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python")]
    subprocess.run([*install, *requirements, "-e", f"{ROOT}[hf]"], check=True, cwd=ROOT)
    stamp.write_text(want)
    return venv


def versions(venv: Path) -> dict[str, str]:
    """The versions of ``PACKAGES`` in ``venv``."""
    script = (
        "import importlib.metadata as m, json, platform\n"
        f"names = {PACKAGES[1:]!r}\n"
        "v = {n: m.version(n) for n in names}\n"
        "v['python'] = platform.python_version()\n"
        "print(json.dumps(v))\n"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def counts(junit: Path) -> dict[str, int]:
    """passed / failed / errors / skipped from pytest's JUnit XML."""
    if not junit.exists():
        return {"passed": 0, "failed": 0, "errors": 1, "skipped": 0}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return {
        "passed": passed,
        "failed": n["failures"],
        "errors": n["errors"],
        "skipped": n["skipped"],
    }


def _outcome(case: ET.Element) -> str:
    for tag, outcome in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return outcome
    return "passed"


def rerun(end: str, files: list[str]) -> dict[str, Any]:
    """Run ``files`` again, alone, in the end's environment, and count their tests from this
    run instead of the first (for spawned ranks that timed out on a loaded machine); the
    end's result, updated and rewritten, says which files were rerun."""
    venv, again = ENDS_DIR / end / "venv", ENDS_DIR / end / "rerun.xml"
    pytest = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    subprocess.run([*pytest, f"--junitxml={again}", *files], cwd=ROOT)
    return merge_rerun(end, files)


def merge_rerun(end: str, files: list[str]) -> dict[str, Any]:
    """The end's result with the tests of ``files`` counted from ``rerun.xml``."""
    junit, again = ENDS_DIR / end / "junit.xml", ENDS_DIR / end / "rerun.xml"
    modules = {"tests." + Path(f).stem for f in files}
    cases = [c for c in ET.parse(junit).iter("testcase") if c.get("classname") not in modules]
    cases += list(ET.parse(again).iter("testcase"))
    tally = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in cases:
        tally[_outcome(case)] += 1
    path = ENDS_DIR / end / "result.json"
    result = json.loads(path.read_text())
    result["tests"] = tally
    result["rerun"] = {"files": [Path(f).name for f in files]}
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the finished subprocesses so far: the tests' cost
    without the other work of a shared machine, unlike their wall time."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_end(end: str, python: str, requirements: list[str], tests: list[str]) -> dict[str, Any]:
    """Make the end's environment, run ``tests`` and the smoke check; its result."""
    start = time.monotonic()
    venv = make_env(end, python, requirements)
    made, cpu = time.monotonic(), _children_cpu_s()
    vpy = str(venv / "bin" / "python")
    junit = ENDS_DIR / end / "junit.xml"
    junit.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)  # the end's own editable install, not another checkout
    log(f"{end}: {len(tests)} test files")
    pytest = [vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    subprocess.run([*pytest, *tests], cwd=ROOT, env=env)
    smoke = subprocess.run(
        [vpy, "scripts/smoke_exactness.py"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    print(smoke.stdout + smoke.stderr, end="", flush=True)
    result = {
        "end": end,
        "versions": versions(venv),
        "tests": counts(junit),
        "test_files": None if tests == core_tests() else [Path(t).name for t in tests],
        "subset": "ends" if tests == end_tests() else None,
        "smoke": "exact" if smoke.returncode == 0 else "differs",
        "install_s": round(made - start),
        "test_s": round(time.monotonic() - made),
        "test_cpu_s": round(_children_cpu_s() - cpu),
        "load": round(os.getloadavg()[1], 1),  # the machine's, over the last 5 minutes
    }
    (ENDS_DIR / end / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def passed(result: dict[str, Any]) -> bool:
    """An end passes when no test failed or errored and the smoke check was exact."""
    t = result["tests"]
    return t["failed"] == 0 and t["errors"] == 0 and t["passed"] > 0 and result["smoke"] == "exact"


def record(results: list[dict[str, Any]]) -> None:
    """Merge ``results`` into ``scripts/compatibility_runs.json`` (a result replaces the one
    recorded for the same end) and rewrite ``docs/compatibility.md``."""
    runs = json.loads(RUNS.read_text())
    ends = {r["end"] for r in results}
    runs = [r for r in runs if r.get("end") not in ends] + [
        {**r, "date": time.strftime("%Y-%m-%d")} for r in results
    ]
    RUNS.write_text(json.dumps(runs, indent=1) + "\n")
    write_page(runs, ROOT / "docs" / "compatibility.md")


def log(message: str) -> None:
    print(f"[version-ends] {message}", flush=True)


def main() -> int:
    """Run the ends asked for; print one verdict line per end; 0 when every end passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ends",
        default="newest,lowest",
        help="comma-separated: newest, lowest, or py3.N (a one-off: that Python, the newest rest)",
    )
    parser.add_argument("--record", action="store_true", help="record results, rewrite the page")
    parser.add_argument("--tests", nargs="+", help="these test files instead of the ends' subset")
    parser.add_argument(
        "--all-core", action="store_true", help="every core test file, not the ends' subset"
    )
    parser.add_argument(
        "--rerun",
        nargs="+",
        help="rerun these files alone in the (one) end made before, count them",
    )
    args = parser.parse_args()
    project = read_pyproject()
    python_newest, python_lowest = project["pythons"][-1], project["pythons"][0]
    accelerate = "accelerate" + requirement(project, "accelerate")  # the test extra's
    plans = {
        "newest": (python_newest, [accelerate, *TEST_TOOLS]),
        "lowest": (python_lowest, [*lowest_pins(project), *TEST_TOOLS]),
    }
    results = []
    if args.rerun:
        results = [rerun(end, args.rerun) for end in args.ends.split(",")]
    for end in [] if args.rerun else args.ends.split(","):
        if re.fullmatch(r"py3\.\d+", end):  # a one-off: that Python, the newest of the rest
            plans[end] = (end[2:], plans["newest"][1])
        version, requirements = plans[end]
        python = find_python(version)
        if python is None:
            log(f"{end}: no Python {version} here (python{version} or pyenv): end skipped")
            return 1
        tests = args.tests or (core_tests() if args.all_core else end_tests())
        results.append(run_end(end, python, requirements, tests))
    for r in results:
        v, t = r["versions"], r["tests"]
        log(
            f"{r['end']}: python {v['python']}, torch {v['torch']}, transformers "
            f"{v['transformers']}, accelerate {v['accelerate']}: {t['passed']} passed, "
            f"{t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped; smoke "
            f"{r['smoke']}; install {r['install_s']} s, tests {r['test_s']} s "
            f"({r['test_cpu_s']} s CPU)"
        )
    if args.record:
        record(results)
    else:
        runs = json.loads(RUNS.read_text())
        ends = {r["end"] for r in results}
        fresh = [r for r in runs if r.get("end") not in ends] + results
        write_page(fresh, ENDS_DIR / "compatibility.md")
    return 0 if all(passed(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
