"""scripts/bench.py keeps working: its quick mode runs and reports every row it should.

No timing is asserted (timings on a shared machine mean nothing in a test); the tests
check that each workload produced a measured row per subject, that the loaded values
were right (the worker compares them with the inputs in quick mode) and that the
markdown, JSON and goal list are complete.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench.py"


def run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out), "--md", str(md),
         "--png", "", "--dir", str(tmp_path / "data"), *args],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["_md"] = md.read_text()
    result["_stdout"] = proc.stdout
    return result


def rows_by(result: dict) -> dict[tuple[str, str, str], dict]:
    return {(r["workload"], r["op"], r["subject"]): r for r in result["rows"]}


def assert_measured(rows: dict, workload: str, op: str, subject: str) -> dict:
    row = rows.get((workload, op, subject))
    assert row is not None, f"no row for {workload}/{op}/{subject}"
    assert not row["errors"], f"{workload}/{op}/{subject}: {row['errors']}"
    assert len(row["times_s"]) == 1 and row["median_s"] > 0
    return row


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_quick_run_reports_raw_and_ckptvar(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--only", "big,small,lazy", "--subjects", "raw,ckptvar-h5")
    rows = rows_by(result)
    for subject in ("raw", "ckptvar-h5"):
        for op in ("save", "load_warm", "load_cold", "restore_warm", "restore_cold"):
            assert_measured(rows, "big", op, subject)
        for op in ("save", "load_warm"):
            assert_measured(rows, "small", op, subject)
        for op in ("lazy_warm", "lazy_cold"):
            assert_measured(rows, "lazy", op, subject)
    assert_measured(rows, "lazy", "lazy_warm_alone", "ckptvar-h5")
    # 149 tensors in the model; the small workload's count is what the row says
    assert rows[("big", "save", "raw")]["count"] == 149
    assert rows[("small", "save", "raw")]["count"] == rows[("small", "save", "ckptvar-h5")]["count"]
    # the pages really left the cache before each cold read
    assert rows[("big", "load_cold", "raw")]["extra"]["cached_before"] < 0.05
    goals = {g["goal"]: g for g in result["goals"]}
    assert goals["h5: 1 GiB load warm ≤ 1.5× raw"]["measured"] is not None
    assert goals["h5: small save ≤ 20 µs/tensor above raw"]["measured"] is not None
    assert goals["zarr: 1 GiB load warm ≤ 1.5× raw"]["measured"] is None  # not selected
    md = result["_md"]
    assert "## Summary" in md and "## Goals" in md and "| 1 GiB model: save |" in md
    assert "Where the run's time went: wall seconds per subject over 22 measurements" in md
    assert result["meta"]["quick"] is True and result["meta"]["machine"]["cpus"]
    assert set(result["meta"]["skipped"]) <= {"ckptvar-h5", "raw"}  # only the chosen ones


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_quick_run_of_the_count_open_and_framework_rows(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the framework rows save torch tensors (test extra)")
    pytest.importorskip("safetensors", reason="safetensors is the peer of these rows")
    subjects = "raw,raw+fsync,ckptvar-h5,ckptvar-h5 nd,safetensors,torch,ckptvar-h5 torch nd," \
               "safetensors torch"
    result = run_bench(tmp_path, "--only", "counts,open,frameworks", "--subjects", subjects,
                       "--extra-repeats", "2")
    rows = rows_by(result)
    for n in (50, 100, 200):  # the quick counts
        for subject in ("raw", "ckptvar-h5", "safetensors"):
            for op in ("save", "load_warm"):
                row = rows[(f"count{n}", op, subject)]
                # repeats are interleaved across subjects, then merged into one row
                assert not row["errors"] and len(row["times_s"]) == 2 and row["count"] == n
        assert len(rows[(f"count{n}", "restore_warm", "ckptvar-h5")]["times_s"]) == 2
        assert (f"count{n}", "save", "ckptvar-h5 nd") in rows
    for subject in ("raw", "ckptvar-h5", "safetensors"):
        for op in ("open_one_warm", "open_one_cold"):
            assert not rows[("open200", op, subject)]["errors"]
    for subject in ("raw", "torch", "ckptvar-h5 torch nd", "safetensors torch"):
        for op in ("save", "load_warm"):
            row = rows[("frameworks", op, subject)]
            assert not row["errors"] and len(row["times_s"]) == 2
    md = result["_md"]
    assert "## Cost per variable above the raw file, by count" in md
    assert "| 200 | save |" in md and "## Open a 200-variable checkpoint" in md
    assert "| ckptvar-h5 torch nd |" in md and "## Framework arrays" in md
    assert not (ROOT / "data").exists()  # the scratch files went to --dir, not the repo


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_quick_run_of_every_public_path_per_value(tmp_path: Path) -> None:
    # the Saver, Checkpoint and cv.save/cv.load rows exist so the per-value cost cannot slip
    result = run_bench(tmp_path, "--only", "paths", "--subjects",
                       "raw,raw+fsync,ckptvar-h5,ckptvar-h5 saver,ckptvar-h5 save")
    rows = rows_by(result)
    for subject in ("raw", "ckptvar-h5", "ckptvar-h5 saver", "ckptvar-h5 save"):
        for op in ("save", "load_warm"):
            assert_measured(rows, "paths200", op, subject)
        assert rows[("paths200", "save", subject)]["count"] == 200
    for subject in ("raw", "ckptvar-h5", "ckptvar-h5 saver"):
        assert_measured(rows, "paths200", "restore_warm", subject)
    assert ("paths200", "restore_warm", "ckptvar-h5 save") not in rows  # no variables
    md = result["_md"]
    assert "## Per-value cost of each public path" in md and "| 200 | restore_warm |" in md
    goals = {g["goal"] for g in result["goals"]}
    assert "h5 Saver: restore of 200 values ≤ 5 µs/value above raw" in goals


@pytest.mark.slow
def test_quick_run_of_every_workload_and_installed_peer(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    rows = rows_by(result)
    skipped = result["meta"]["skipped"]
    peers = ["safetensors", "torch", "npz", "h5py", "zarr", "zarr 1-chunk", "tf"]
    for subject in [p for p in peers if p not in skipped] + ["raw", "ckptvar-h5"]:
        for op in ("save", "load_warm", "load_cold"):
            assert_measured(rows, "big", op, subject)
        assert_measured(rows, "small", "load_warm", subject)
        assert_measured(rows, "lazy", "lazy_cold", subject)
    for fmt in ("h5", "zarr"):
        s = f"ckptvar-{fmt}"
        for op in ("init_build_restore", "init_restore_first"):
            assert_measured(rows, "init", op, s)
        assert_measured(rows, "bgsave", "bg_background", s)
        assert rows[("bgsave", "bg_background", s)]["extra"]["total_s"] > 0
        for op in ("verify_off", "verify_restore_off"):
            assert_measured(rows, "verify", op, s)
    assert_measured(rows, "bgsave", "bg_copy", "ckptvar-h5")
    md = result["_md"]
    for title in ("restore as initialization", "background save", "checksums on vs off"):
        assert f"## ckptvar: {title}" in md
    assert "GPU loading:" in md


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_spawn_mode_runs_each_measurement_in_a_new_interpreter(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--spawn", "--only", "big", "--subjects", "raw",
                       "--ops", "save,load_warm")
    rows = rows_by(result)
    assert_measured(rows, "big", "save", "raw")
    assert_measured(rows, "big", "load_warm", "raw")
    assert result["meta"]["spawn"] is True
    assert "(a new interpreter)" in result["_md"]


def test_fork_server_runs_each_job_in_its_own_process_and_survives_failures(
    tmp_path: Path,
) -> None:
    worker = ROOT / "scripts" / "_bench_worker.py"
    srv = subprocess.Popen([sys.executable, str(worker), "--serve", "raw"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           cwd=str(tmp_path))
    job = {"subject": "raw", "options": {}, "workload": "big", "path": str(tmp_path / "m.raw"),
           "quick": True, "count": 20}
    jobs = [{**job, "op": "save"}, {**job, "op": "no-such-op"}, {**job, "op": "load_warm"}]
    out, _ = srv.communicate("".join(json.dumps(j) + "\n" for j in jobs), timeout=120)
    assert srv.returncode == 0
    results = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
               if line.startswith("BENCHRESULT ")]
    assert len(results) == 3
    save, bad, load = results
    assert "unknown op 'no-such-op'" in bad["error"]
    assert save["t"] > 0 and load["t"] > 0 and load["nbytes"] == save["nbytes"]
    assert len({save["pid"], load["pid"], srv.pid}) == 3


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--only", "nope"], capture_output=True,
                          text=True, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2 and "unknown workload" in proc.stderr


def load_bench():  # type: ignore[no-untyped-def]
    """scripts/bench.py as a module (it puts the repository, and so ``benchmarks``, on the path)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("ckptvar_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["ckptvar_bench"] = bench
    spec.loader.exec_module(bench)
    return bench


def test_every_operation_the_plan_asks_for_has_a_worker_function() -> None:
    load_bench()
    from benchmarks import ops, plan, workloads  # noqa: PLC0415

    asked = {"setup"}
    for sd in plan.subject_defs({"durable": False}):
        for wl in workloads.WORKLOADS:
            asked |= set(plan.ops_for(sd, wl))
    assert "gpu_h2d" in asked and "bg_background" in asked
    assert asked <= set(ops.OPS), sorted(asked - set(ops.OPS))


def test_each_benchmark_module_is_small_and_says_what_it_owns() -> None:
    modules = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(modules) > 10
    for path in modules:
        text = path.read_text()
        assert text.startswith('"""'), f"{path}: no module docstring"
        assert len(text.splitlines()) <= 500, f"{path}: {len(text.splitlines())} lines"


def test_a_server_that_cannot_start_reports_why(tmp_path: Path) -> None:
    bench = load_bench()
    runner = bench.Runner(bench.parse_args(["--quick"]))
    job = {"subject": "no-such-subject", "op": "save", "workload": "big",
           "path": str(tmp_path / "x"), "quick": True, "count": 20}
    try:
        # the server imports nothing for an unknown subject, so the job itself fails ...
        assert "KeyError" in runner.call(sys.executable, job, timeout=60)["error"]
        # ... while an interpreter that cannot run the server at all is reported as such
        broken = tmp_path / "python"
        broken.write_text("#!/bin/sh\necho 'no interpreter here' >&2\nexit 3\n")
        broken.chmod(0o755)
        res = runner.call(str(broken), {**job, "subject": "raw"}, timeout=60)
        assert res["error"].startswith("worker server exited 3")
        assert "no interpreter" in res["error"]
    finally:
        runner.close()
    assert not runner.servers


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_the_convert_workload_reports_every_row(tmp_path: Path) -> None:
    """``python -m benchmarks.convert --quick --json --repeat 2 --formats ...``: raw floor,
    and for each output format ``save(load())``, streamed and in-memory rows with their
    ratios to it (medians, and the spread of the per-round ratios)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.convert", "--quick", "--json", "--repeat", "2",
         "--formats", ".h5", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows[0]["row"] == "source" and rows[0]["bytes"] >= 16 << 20
    assert rows[0]["repeat"] == 2
    names = [r["row"] for r in rows[1:]]
    assert names == ["cp (raw)", ".h5 save(load())", ".h5 streamed", ".h5 in memory"]
    for r in rows[1:]:
        assert r["wall"] > 0 and r["peak_mib"] > 0 and r["x_raw"] > 0 and r["rss_mib"] > 0
        assert r["wall_min"] <= r["wall"] <= r["wall_max"] and r["cpu"] > 0
        if r["row"] != "cp (raw)":
            assert r["x_save_load"] > 0
            assert 0 < r["x_save_load_min"] <= r["x_save_load_max"]
        if r["row"].endswith("save(load())"):
            assert r["x_save_load"] == r["x_save_load_min"] == r["x_save_load_max"] == 1
    assert list(tmp_path.iterdir()) == []  # the scratch files are gone


@pytest.mark.slow
def test_the_incremental_workload_reports_every_row(tmp_path: Path) -> None:
    """``python -m benchmarks.incremental --quick --json``: both formats, four workloads;
    an incremental frozen-backbone step writes about what changed, and so does a table
    with 10% of its rows touched by ``scatter_update`` (a row delta)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.incremental", "--quick", "--json", "--dir",
         str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["format"], r["workload"]) for r in rows] == [
        (f, w) for f in ("h5", "zarr")
        for w in ("frozen", "embedding-1%", "embedding-10%", "window-1%")]
    for r in rows:
        assert r["full"]["written"] >= r["state"]
        if r["workload"] == "frozen":
            assert r["written_over_changed"] <= 1.10
        if r["format"] == "zarr":  # a table in 4 MiB chunks: only the touched ones written
            assert r["written_over_chunks"] <= 1.10, r
        if r["workload"] == "embedding-10%":  # a row delta: the changed rows (0.5 MiB)
            assert r["written_over_changed"] <= 1.10, r
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a long run: the default suite keeps a shorter one of the same kind
def test_the_incremental_workload_takes_the_managers_options(tmp_path: Path) -> None:
    """``--max-patched-rows`` (and the other ``IncrementalOptions``) reach the incremental
    manager: with no share of rows the table is written whole at every step, by default
    it is a row delta; a bad value is refused, saying why."""
    load_bench()
    from benchmarks import incremental

    import ckptvar as cv

    def latest(options: cv.IncrementalOptions | None) -> list[object]:
        rows = incremental.run(tmp_path, 2 << 20, 2, workloads=("embedding-10%",),
                               options=options)
        return [r["last_delta"] and r["last_delta"]["patches"] for r in rows]

    assert latest(None) == [2, 2]  # h5, zarr: two patches on the first whole copy
    assert latest(cv.IncrementalOptions(max_patched_rows=0)) == [None, None]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.incremental", "--max-patched-rows", "2"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert proc.returncode == 2 and "max_patched_rows=2.0" in proc.stderr, proc.stderr


def test_the_count_table_ignores_rows_of_the_counts_workload_itself() -> None:
    load_bench()
    from benchmarks import round2
    from benchmarks.results import Row

    rows = [Row("counts", "setup", "raw", "raw", times=[0.1]),
            Row("count1000", "save", "raw", "raw", times=[0.01], count=1000),
            Row("count1000", "save", "ckptvar-h5", "ckptvar", times=[0.02], count=1000)]
    rows += [Row("open", "open_one_warm", "raw", "raw", times=[0.001]),
             Row("open100k", "open_one_warm", "safetensors", "peer", times=[0.2])]
    table = "\n".join(round2.tables(rows))
    assert "| 1,000 |" in table or "| 1000 |" in table
    assert "Open a 100k-variable checkpoint" in table and "Open a -variable" not in table


def test_measurements_are_written_before_a_failing_report(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import argparse
    import json

    load_bench()
    from benchmarks import report
    from benchmarks.results import Row

    def broken(rows):  # type: ignore[no-untyped-def]
        raise RuntimeError("a report bug")

    monkeypatch.setattr(report, "all_goals", broken)  # the first step of the report
    args = argparse.Namespace(json=str(tmp_path / "b.json"), md=str(tmp_path / "b.md"), png="")
    rows = [Row("big", "save", "raw", "raw", times=[0.25])]
    with pytest.raises(RuntimeError, match="a report bug"):
        report.write_outputs(args, {"labels": ["raw"]}, rows)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert [r["times_s"] for r in saved["rows"]] == [[0.25]]


def test_the_protocol_overhead_leaves_out_the_ranks_write_skew() -> None:
    load_bench()
    from benchmarks import scale

    # one save, two ranks started at one barrier: rank 0 wrote for 0.1 s and waited 0.3 s
    # in the vote for rank 1, which wrote for 0.4 s
    laps = [[{"plan": 0.01, "write": 0.1, "vote": 0.3, "commit": 0.02},
             {"plan": 0.01, "write": 0.4, "vote": 0.0, "commit": 0.02}]]
    assert scale.overheads(laps) == pytest.approx([0.33])
    assert scale.wall_overheads(laps) == pytest.approx([0.03])


@pytest.mark.parametrize("module", sorted(
    p.stem for p in (ROOT / "benchmarks").glob("*.py")
    if p.stem != "worker" and "__main__" in p.read_text()))
def test_each_benchmark_answers_help(module: str) -> None:
    """``python -m benchmarks.<module> --help`` prints its usage (a ``%`` in a help text,
    as in a workload named ``embedding-1%``, once made argparse fail)."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
