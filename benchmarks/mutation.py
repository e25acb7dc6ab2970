"""Mutation testing of the host-side core with cosmic-ray: how many small code changes do the fast
CPU tests notice? Not run in CI; the numbers go in benchmarks/results.md.

    pip install cosmic-ray           # once, into the project's venv
    nice -n 19 python benchmarks/mutation.py                       # sample, run, report ("before")
    nice -n 19 python benchmarks/mutation.py --after               # rerun that run's survivors
                                                                   # against tests/test_mutants.py

It never touches the checkout: the repo is copied to --work-dir/src (no .venv, no .git) and mutated
there, one mutant at a time; pytest runs with that copy as its working directory, so `graphrt` is
imported from the copy (checked before anything runs; graphrt.capture/kernels/profiling still come
from the editable install, and are not mutated). A mutant is killed when the module's tests fail
(-x: at the first failure) or run past the timeout (3x the unmutated suite, for mutants that hang).

All mutants of four modules take many hours on two cores, so each module's mutants are sampled
uniformly at random with a fixed seed (--sample, --seed), over a stable order of the mutants, so
the same command picks the same mutants on any machine.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PYTEST = [PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]

# The fast CPU tests that exercise each module, fastest-failing first.
TESTS = {
    "kv_cache": ["tests/engine/test_scheduler.py", "tests/engine/test_block_accounting.py"],
    "sampling": ["tests/runtime/test_sampling.py", "tests/test_errors.py"],
    "scheduler": ["tests/engine/test_scheduler.py", "tests/engine/test_block_accounting.py", "tests/runtime/test_ring.py"],
    "ring": ["tests/runtime/test_ring.py", "tests/engine/test_block_accounting.py"],
}
# The files each module's mutants are made in. The layout of issue 30 split two of the four files the
# first run mutated (graphrt/kv_cache.py: the block allocator and the cache tensors; graphrt/sampling.py:
# the sampler and SamplingParams); each module still covers what its file held.
MODULE_PATHS = {
    "kv_cache": ["graphrt/engine/block_allocator.py", "graphrt/model/kv_cache.py"],
    "sampling": ["graphrt/runtime/sampler.py", "graphrt/sampling_params.py"],
    "scheduler": ["graphrt/engine/scheduler.py"],
    "ring": ["graphrt/runtime/ring.py"],
}
NEW_TESTS = "tests/test_mutants.py"
SKIP_COPY = {".venv", ".git", "__pycache__", "graphrt.egg-info", ".pytest_cache"}


def copy_repo(src_dir: Path) -> None:
    if src_dir.exists():
        shutil.rmtree(src_dir)
    shutil.copytree(REPO, src_dir, ignore=lambda _dir, names: [n for n in names if n in SKIP_COPY])
    found = subprocess.run(
        [PYTHON, "-c", "import graphrt.engine.scheduler as m; print(m.__file__)"], cwd=src_dir, capture_output=True, text=True,
        check=True,
    ).stdout.strip()
    if Path(found).resolve() != (src_dir / MODULE_PATHS["scheduler"][0]).resolve():
        sys.exit(f"graphrt is imported from {found}, not from the copy in {src_dir}; the mutants would not be tested")


def test_command(module: str, after: bool) -> list[str]:
    # A survivor passed the module's tests already, so it survives them plus the new ones exactly
    # when it passes the new ones: --after runs only those.
    return PYTEST + ([NEW_TESTS] if after else TESTS[module])


def write_config(path: Path, module: str, command: list[str], timeout: float) -> None:
    path.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(MODULE_PATHS[module])}\n"  # a JSON list of strings is TOML's too
        f"timeout = {timeout:.0f}.0\n"
        "excluded-modules = []\n"
        f'test-command = "{" ".join(command)}"\n\n'
        '[cosmic-ray.distributor]\nname = "local"\n'
    )


def spec_key(item) -> tuple:
    spec = item.mutations[0]
    return (str(spec.module_path), spec.operator_name, tuple(spec.start_pos), tuple(spec.end_pos), spec.occurrence)


def sample_mutants(db_path: Path, sample: int, seed: int) -> tuple[int, int]:
    """Mark all but a uniform random sample of the mutants as skipped; returns (sampled, total)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db_path), WorkDB.Mode.open) as db:
        items = sorted(db.work_items, key=spec_key)
        keep = items if sample <= 0 or sample >= len(items) else random.Random(seed).sample(items, sample)
        kept = {item.job_id for item in keep}
        skipped = [item.job_id for item in items if item.job_id not in kept]
        if skipped:
            db.set_multiple_results(skipped, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
        return len(keep), len(items)


def summarize(db_path: Path) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "timeout": 0, "survived": 0, "incompetent": 0}
    survivors = []
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item, result in sorted(db.completed_work_items, key=lambda pair: spec_key(pair[0])):
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                spec = item.mutations[0]
                survivors.append(
                    {"job_id": item.job_id, "operator": spec.operator_name.removeprefix("core/"),
                     "path": str(spec.module_path), "line": spec.start_pos[0], "function": spec.definition_name, "diff": result.diff}
                )
            elif result.test_outcome == TestOutcome.KILLED:
                counts["timeout" if result.output == "timeout" else "killed"] += 1
            else:
                counts["incompetent"] += 1
    competent = counts["killed"] + counts["timeout"] + counts["survived"]
    counts["kill_rate"] = round((counts["killed"] + counts["timeout"]) / competent, 3) if competent else None
    return {"counts": counts, "survivors": survivors}


def forget_results(db_path: Path, job_ids: list[str]) -> None:
    """Make these mutants pending again, so `cosmic-ray exec` runs them (it has no command for it)."""
    from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db

    with use_db(str(db_path), WorkDB.Mode.open) as db, db._session_maker.begin() as session:
        session.query(WorkResultStorage).filter(WorkResultStorage.job_id.in_(job_ids)).delete()


def run_module(module: str, args, work: Path, src: Path) -> dict:
    before_db, after_db = work / f"{module}.sqlite", work / f"{module}.after.sqlite"
    config = work / f"{module}.toml"
    cosmic_ray = [PYTHON, "-m", "cosmic_ray.cli"]
    if args.after:
        if not before_db.exists():
            sys.exit(f"no earlier run for {module} in {work}: run without --after first")
        shutil.copy(before_db, after_db)
        survivors = [s["job_id"] for s in summarize(before_db)["survivors"]]
        forget_results(after_db, survivors)
        db_path, sampled, total = after_db, len(survivors), None
        timeout = json.loads((work / f"{module}.json").read_text())["timeout_s"]
    else:
        started = time.monotonic()
        baseline = subprocess.run(test_command(module, False), cwd=src, capture_output=True, text=True)
        baseline_s = time.monotonic() - started
        if baseline.returncode != 0:
            sys.exit(f"the unmutated tests for {module} fail in the copy:\n{baseline.stdout[-3000:]}")
        timeout = max(60.0, 3 * baseline_s)
        write_config(config, module, test_command(module, False), timeout)
        if before_db.exists():
            before_db.unlink()
        subprocess.run(cosmic_ray + ["init", str(config), str(before_db)], cwd=src, check=True)
        sampled, total = sample_mutants(before_db, args.sample.get(module, 0), args.seed)
        db_path = before_db
        print(f"{module}: {sampled} of {total} mutants; unmutated suite {baseline_s:.0f} s, timeout {timeout:.0f} s", flush=True)
    write_config(config, module, test_command(module, args.after), timeout)
    started = time.monotonic()
    subprocess.run(cosmic_ray + ["exec", str(config), str(db_path)], cwd=src, check=True)
    report = summarize(db_path)
    report.update(module=module, sampled=sampled, total=total, seed=args.seed, timeout_s=timeout,
                  wall_s=round(time.monotonic() - started))
    if args.after:  # the killed mutants keep their results: added tests cannot make them survive
        before = json.loads((work / f"{module}.json").read_text())
        report["sampled"], report["total"], report["counts_before"] = before["sampled"], before["total"], before["counts"]
    (work / f"{module}{'.after' if args.after else ''}.json").write_text(json.dumps(report, indent=1))
    return report


def parse_sample(text: str) -> dict[str, int]:
    """'kv_cache=30,sampling=40' -> sample sizes (0: all mutants)."""
    return {name: int(count) for name, count in (part.split("=") for part in text.split(",") if part)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=list(TESTS), choices=list(TESTS))
    parser.add_argument("--sample", type=parse_sample, default=parse_sample("kv_cache=25,sampling=35,scheduler=25,ring=25"),
                        help="mutants per module, e.g. kv_cache=25,sampling=35 (0: all)")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/graphrt-mutation"))
    parser.add_argument("--after", action="store_true", help=f"rerun the last run's survivors against {NEW_TESTS}")
    args = parser.parse_args()
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    copy_repo(src)
    for module in args.modules:
        report = run_module(module, args, work, src)
        counts = report["counts"]
        line = f"{module}: kill rate {counts['kill_rate']} {counts}, {report['wall_s']} s"
        if args.after:
            line += f" (before: {report['counts_before']['kill_rate']})"
        print(line, flush=True)
        for s in report["survivors"]:
            print(f"  survived {s['operator']} at {s['path']}:{s['line']} ({s['function']})", flush=True)


if __name__ == "__main__":
    main()
