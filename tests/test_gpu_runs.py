"""bench/gpu/gpu_runs.py, gpu-check's run plan and job runner, without a GPU: its runs fit a device call
(each variant in one run, the estimates within the budget), jobs are skipped or stopped at the
budget's end with everything they started, the results are rewritten after every job, and the best
result per size survives later runs."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import models.flops
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench/gpu/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
gpu_runs = sys.modules["bench.gpu.gpu_runs"]


def fake_jobs(monkeypatch, tmp_path, ran: list, seconds: dict | None = None, clock: list | None = None):
    """gpu_check's throughput and plain loop, and gpu_runs' e2e and EMA checks, replaced by fakes that
    record what ran (and, with `clock`, advance a fake clock by `seconds[name]`)."""
    base = next(iter(gpu_check.VARIANTS))

    def advance(name):
        if clock is not None:
            clock[0] += (seconds or {}).get(name, 1)

    def fake_throughput(n, out, resolution, name, overrides, batches, preset="sd2-base", timeout=900):
        ran.append((resolution, "base" if name == base else name))
        advance(name)
        result = tmp_path / f"{len(ran)}.json"
        img_s = 2.0 if "compile" in name else 1.0
        result.write_text(json.dumps({"img_per_sec_per_gpu": img_s, "recipe": "sd2", "device": "fake GPU"}))
        return {"variant": name, "resolution": resolution, "microbatch": 32, "ok": True, "img_s": img_s,
                "memory_gb": 1.0, "file": str(result), "mfu": 0.1, "timeout": timeout}  # fmt: skip

    def fake_plain_row(out, batches, microbatch):
        ran.append("plain")
        advance("plain")
        return {"variant": gpu_runs.PLAIN, "resolution": 256, "microbatch": 32, "ok": True, "img_s": 3.0,
                "memory_gb": None, "mfu": 0.2}  # fmt: skip

    def fake_e2e(n, out, composer, deterministic=False, deadline=None):
        ran.append(("e2e", deterministic))
        advance("e2e")
        return [], ["resumed: bitwise"]

    def fake_ema():
        ran.append("ema")
        advance("ema")
        return [], {"fp32": 4.4}

    monkeypatch.setattr(gpu_check, "throughput", fake_throughput)
    monkeypatch.setattr(gpu_check, "plain_row", fake_plain_row)
    monkeypatch.setattr(gpu_runs, "part_e2e", fake_e2e)
    monkeypatch.setattr(gpu_runs, "part_ema", fake_ema)
    monkeypatch.setattr(gpu_check, "gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    if clock is not None:
        monkeypatch.setattr(gpu_runs.time, "monotonic", lambda: clock[0])
        monkeypatch.setattr(gpu_runs.time, "time", lambda: clock[0])


@pytest.mark.parametrize(
    "resolutions, only, expected",
    [
        (
            (256, 512),
            ["compile"],
            [(256, "base"), (256, "compile"), (256, "compile + CUDA graphs"), (256, "compile, channels_last"),
             (256, gpu_runs.FULL), (256, gpu_runs.FULL_2), (256, gpu_runs.PER_SAMPLE), (512, "base"),
             (512, "compile"), "plain"],
        ),
        ((256,), ["bf16"],
         [(256, "base"), (256, "bf16 weights"), (256, gpu_runs.FULL), (256, gpu_runs.FULL_2),
          (256, gpu_runs.PER_SAMPLE), "plain"]),
        ((512,), ["2x"], [(512, "base"), (512, "2x microbatch")]),  # no 256 px best: the chosen ones
    ],
)  # fmt: skip
def test_chosen_variants_run_as_asked(monkeypatch, tmp_path, resolutions, only, expected):
    """--variants and --resolutions replace the run plan: the chosen variants at the lower size,
    the baseline and the lower size's best (the first of the fastest) at the higher, the plain loop."""
    ran = []
    fake_jobs(monkeypatch, tmp_path, ran)
    args = ["--out", str(tmp_path), "--parts", "throughput", "--variants", *only, "--budget", "0"]
    assert gpu_check.main([*args, "--resolutions", *map(str, resolutions)]) == 0
    assert ran == expected


def run_jobs(run: int) -> list[tuple]:
    """A run's jobs as (variant, px), run 3's best as the combination it falls back to."""
    return [
        (gpu_runs.FULL if name == gpu_runs.BEST else name, px)
        for kind, name, px in gpu_runs.RUNS[run]
        if kind == "throughput"
    ]


def test_every_variant_runs_once_and_every_run_fits_its_budget():
    """Each sd2-base variant runs in exactly one run at 256 px, no (variant, px) twice; each run's
    estimated seconds fit --budget's default, which leaves a 600 s device call time to install the
    carried wheels and pack the results; run 1 (`make gpu-check`) holds the plain loop, run 2 starts
    with the e2e resume check, and the combination with 2 microbatches runs in run 3 or 4."""
    pairs = [job for run in gpu_runs.RUNS for job in run_jobs(run)]
    assert len(pairs) == len(set(pairs))
    at_256 = [name for name, px in pairs if px == 256]
    assert sorted(at_256) == sorted(gpu_check.VARIANTS)
    assert (gpu_runs.FULL, 512) in pairs and (gpu_runs.BASE, 512) in pairs
    assert gpu_runs.BUDGET_S <= 520  # a 600 s call: wheels 3 s, preflight 16-26 s, packing (2026-11-26)
    for run, jobs in gpu_runs.RUNS.items():
        total = sum(gpu_runs.estimate(job, gpu_check.VARIANTS) for job in jobs)
        assert total <= gpu_runs.BUDGET_S, f"run {run}: {total} s"
    assert ("plain", gpu_runs.PLAIN, 256) in gpu_runs.RUNS[1]
    assert gpu_runs.RUNS[2][0] == ("e2e", gpu_runs.E2E_CHECK, 256)
    assert gpu_runs.ESTIMATE_S["e2e"] >= 324  # measured on 2026-11-24, without deterministic mode
    assert any((gpu_runs.FULL_2, 256) in run_jobs(run) for run in (3, 4))
    compiled = gpu_runs.estimate(("throughput", gpu_runs.FULL, 256), gpu_check.VARIANTS)
    base = gpu_runs.estimate(("throughput", gpu_runs.BASE, 256), gpu_check.VARIANTS)
    assert compiled == base + gpu_runs.ESTIMATE_S["compile"]


def test_every_run_goes_cheapest_first():
    """A slow compile (113-124 s measured) must not cost the cheap, certain jobs: within each run the
    jobs go in order of their estimates, but for a first baseline (every ratio is against it) or e2e
    check (it needs most of a run); run 1 is the baseline, the plain loop, then the combination."""
    for run, jobs in gpu_runs.RUNS.items():
        assert all(kind != "e2e" for kind, _, _ in jobs[1:]), f"run {run}"
        rest = jobs[1:] if jobs[0][1] in (gpu_runs.BASE, gpu_runs.E2E_CHECK) else jobs
        estimates = [gpu_runs.estimate(job, gpu_check.VARIANTS) for job in rest]
        assert estimates == sorted(estimates), f"run {run}"
    assert [name for _, name, _ in gpu_runs.RUNS[1]] == [gpu_runs.BASE, gpu_runs.PLAIN, gpu_runs.FULL]


def test_runs_1_2_and_3_write_as_they_go_and_3_takes_run_1s_best_to_512(monkeypatch, tmp_path):
    ran = []
    fake_jobs(monkeypatch, tmp_path, ran)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0  # run 1 by default
    assert ran == [(256, "base"), "plain", (256, gpu_runs.FULL)]
    report = json.loads((tmp_path / "gpu-check-run1.json").read_text())
    assert [r["variant"] for r in report["rows"]][1] == gpu_runs.PLAIN and report["run"] == 1
    assert len(report["seconds"]) == 3 and not report["skipped"]
    table = (tmp_path / "gpu-check-run1.md").read_text()
    assert table.startswith("# gpu-check") and f"| {gpu_runs.FULL} | 256 |" in table
    best = json.loads((tmp_path / "throughput-256.json").read_text())
    assert best["img_per_sec_per_gpu"] == 2.0  # the fake result file of the fastest (compiled) variant

    ran.clear()  # run 2: the resume check alone, with --deterministic
    assert gpu_check.main(["--out", str(tmp_path), "--run", "2"]) == 0
    assert ran == [("e2e", True)]
    checks = json.loads((tmp_path / "gpu-check-run2.json").read_text())["checks"]
    e2e = {"check": gpu_runs.E2E_CHECK, "ok": True, "problems": [], "lines": ["resumed: bitwise"]}
    assert checks == [e2e]

    ran.clear()  # run 6: the EMA's storage variants, then compile (its fake result)
    assert gpu_check.main(["--out", str(tmp_path), "--run", "6"]) == 0
    assert ran[0] == "ema"
    checks = json.loads((tmp_path / "gpu-check-run6.json").read_text())["checks"]
    assert [(c["check"], c["ok"]) for c in checks] == [(gpu_runs.EMA_CHECK, True)]

    ran.clear()  # run 3: the baseline at 512 px, then run 1's best 256 px variant (here made "bf16 weights")
    report["rows"][-1].update(variant="bf16 weights", img_s=9.0)
    (tmp_path / "gpu-check-run1.json").write_text(json.dumps(report))
    assert gpu_check.main(["--out", str(tmp_path), "--run", "3"]) == 0
    assert ran == [(512, "base"), (512, "bf16 weights")]


def test_a_run_skips_what_does_not_fit_and_limits_each_job(monkeypatch, tmp_path, capsys):
    """Jobs start only while 75% of their estimate is left of --budget; each gets at most twice its
    estimate or what is left; what was measured before the budget ran out is saved."""
    ran, clock = [], [0.0]
    seconds = {"bf16 weights": 250, "FSDP per block": 90}  # the first job took long
    fake_jobs(monkeypatch, tmp_path, ran, seconds, clock)
    assert gpu_check.main(["--out", str(tmp_path), "--run", "4", "--budget", "400"]) == 0
    assert ran == [(256, "bf16 weights"), (256, "FSDP per block")]  # 60 s left < 75% of 215
    report = json.loads((tmp_path / "gpu-check-run4.json").read_text())
    need = gpu_runs.estimate(("throughput", gpu_runs.FULL_2, 256), gpu_check.VARIANTS)
    assert report["skipped"] == [{"job": f"{gpu_runs.FULL_2} at 256 px", "estimate_s": need, "left_s": 60}]
    assert [r["timeout"] for r in report["rows"]] == [180, 150]  # 2 x 90; what was left
    assert f"not run (out of --budget): {gpu_runs.FULL_2} at 256 px" in capsys.readouterr().out


def test_a_budget_counts_from_the_scripts_start(monkeypatch, tmp_path):
    """--budget is seconds from `start` (the script passes its import time): 300 s gone before main
    leaves 200 of 500, enough for the baseline (90) and the plain loop (60), not the combination."""
    ran, clock = [], [0.0]
    fake_jobs(monkeypatch, tmp_path, ran, {gpu_runs.BASE: 90, "plain": 60}, clock)
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "500"], start=-300.0) == 0
    assert ran == [(256, "base"), "plain"]


def test_a_failed_variants_log_keeps_its_own_number(monkeypatch, tmp_path):
    """A failed variant writes no json; the next variant takes the next number all the same (past
    an earlier run's files too), so the failed row's log is its own output."""
    (tmp_path / "tp-512-4.json").write_text("{}")  # an earlier run's

    def fake_composer(n, args, log, timeout):
        fails = not list(tmp_path.glob("tp-*.log"))  # the first variant
        log.write_text(f"{'first' if fails else 'second'} variant's output\n")
        assert args[args.index("--data") + 1] == str(tmp_path / "latents-256")  # gpu_check.latents's
        assert args[args.index("--warmup") + 1] == "5" and args[args.index("--profile-steps") + 1] == "3"
        if not fails:
            Path(args[args.index("--out") + 1]).write_text(json.dumps({"img_per_sec_per_gpu": 5.0}))
        return subprocess.CompletedProcess(args, 1 if fails else 0)

    monkeypatch.setattr(gpu_check, "composer", fake_composer)
    monkeypatch.setattr(gpu_check, "latents", lambda out, preset, px, n, batches: out / f"latents-{px}")
    monkeypatch.setattr(gpu_check, "peak_flops", lambda: 1e15)
    monkeypatch.setattr(models.flops, "training_flops_per_image", lambda preset, px: 1e12)
    failed = gpu_check.throughput(1, tmp_path, 256, gpu_runs.BASE, [], 20)
    done = gpu_check.throughput(1, tmp_path, 256, "bf16 weights", [gpu_check.BF16], 20)
    assert not failed["ok"] and Path(failed["log"]).read_text() == "first variant's output\n"
    assert done["ok"] and done["img_s"] == 5.0 and done["file"] == str(tmp_path / "tp-256-6.json")
    names = ["tp-256-5.log", "tp-256-6.json", "tp-256-6.log", "tp-512-4.json"]
    assert sorted(f.name for f in tmp_path.glob("tp-*")) == names


def test_the_best_file_keeps_an_earlier_runs_faster_result(monkeypatch, tmp_path, capsys):
    """Runs 1 and 4-7 all time 256 px: OUT/throughput-PX.json keeps an earlier run's faster result of
    the same recipe on the same device, and says so; a slower one, or another device's, is replaced by
    this run's best."""
    ran = []
    fake_jobs(monkeypatch, tmp_path, ran)
    earlier = {"img_per_sec_per_gpu": 3.0, "recipe": "sd2", "device": "fake GPU"}
    (tmp_path / "throughput-256.json").write_text(json.dumps(earlier))
    (tmp_path / "throughput-512.json").write_text(json.dumps({**earlier, "device": "another GPU"}))
    assert gpu_check.main(["--out", str(tmp_path), "--run", "4"]) == 0  # best at 256: 2.0 (compiled)
    assert json.loads((tmp_path / "throughput-256.json").read_text()) == earlier
    best = json.loads((tmp_path / "gpu-check-run4.json").read_text())["best"]
    kept = f"an earlier run's 3.0 img/s, kept over this run's best, {gpu_runs.FULL_2} at 2.0 img/s"
    assert best["256"].endswith(kept)
    assert f"for recipes.plan: {tmp_path / 'throughput-256.json'}: {kept}" in capsys.readouterr().out
    assert gpu_check.main(["--out", str(tmp_path), "--run", "3"]) == 0  # best at 512: the combination's 2.0
    assert json.loads((tmp_path / "throughput-512.json").read_text())["img_per_sec_per_gpu"] == 2.0
    best = json.loads((tmp_path / "gpu-check-run3.json").read_text())["best"]
    assert best["512"].endswith(f"best, {gpu_runs.FULL} at 2.0 img/s")

    (tmp_path / "throughput-256.json").write_text(json.dumps({**earlier, "img_per_sec_per_gpu": 1.5}))
    assert gpu_check.main(["--out", str(tmp_path), "--run", "4"]) == 0
    assert json.loads((tmp_path / "throughput-256.json").read_text())["img_per_sec_per_gpu"] == 2.0


class FakeGroup:
    """A launcher's process group on a fake clock: the launcher exits on SIGTERM at once, the
    processes it started `term_s` later (None: never); SIGKILL ends them all. `signals`: what was
    sent, and when."""

    pid = 4242

    def __init__(self, clock: list, term_s: float | None, interrupt=False):
        self.clock, self.term_s, self.interrupt = clock, term_s, interrupt
        self.launcher, self.children_end, self.reaped, self.signals = None, float("inf"), False, []

    def popen(self, command, **kwargs):
        return self

    def poll(self):
        self.reaped = self.launcher is not None
        return self.launcher

    def wait(self, timeout=None):
        if self.interrupt:  # Ctrl-C, or SIGTERM's SystemExit, while the job runs
            raise KeyboardInterrupt
        if self.launcher is None:
            self.clock[0] += timeout
            raise subprocess.TimeoutExpired("composer", timeout)
        return self.poll()

    def killpg(self, group, sig):
        assert group == self.pid
        if sig:
            self.signals.append((sig, self.clock[0]))
        if self.reaped and self.clock[0] >= self.children_end:
            raise ProcessLookupError
        if sig == signal.SIGTERM:
            self.launcher = -sig
            self.children_end = self.clock[0] + (float("inf") if self.term_s is None else self.term_s)
        elif sig == signal.SIGKILL:
            self.launcher, self.children_end = self.launcher or -sig, self.clock[0]

    def patch(self, monkeypatch):
        monkeypatch.setattr(gpu_runs.subprocess, "Popen", self.popen)
        monkeypatch.setattr(gpu_runs.os, "killpg", self.killpg)
        monkeypatch.setattr(gpu_runs.time, "monotonic", lambda: self.clock[0])
        monkeypatch.setattr(gpu_runs.time, "sleep", lambda s: self.clock.__setitem__(0, self.clock[0] + s))


@pytest.mark.parametrize("term_s", [5, None])
def test_a_job_past_its_limit_gets_20_s_after_sigterm(monkeypatch, tmp_path, term_s):
    """Past the time limit the group gets SIGTERM, and SIGKILL only if something in it is still
    there 20 s later, even though the launcher itself exits at once."""
    group = FakeGroup([0.0], term_s)
    group.patch(monkeypatch)
    done = gpu_runs.run_group(["composer"], tmp_path / "log", timeout=100)
    assert done.returncode == 124 and group.signals[0] == (signal.SIGTERM, 100)
    assert group.clock[0] == pytest.approx(100 + (term_s or 20), abs=0.3)
    if term_s is None:
        assert [sig for sig, _ in group.signals] == [signal.SIGTERM, signal.SIGKILL]
        assert group.signals[1][1] >= 120  # not at once when the launcher exited
    else:
        assert [sig for sig, _ in group.signals] == [signal.SIGTERM]


@pytest.mark.parametrize("gone", [False, True])
def test_a_stopped_check_kills_the_group_and_keeps_its_own_exit(monkeypatch, tmp_path, gone):
    """Ctrl-C (or SIGTERM's SystemExit) while a job runs: the group gets SIGKILL at once, and a
    group that is gone already (ProcessLookupError) does not hide the interrupt."""
    group = FakeGroup([0.0], None, interrupt=True)
    group.reaped, group.children_end = gone, 0.0 if gone else float("inf")
    group.patch(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        gpu_runs.run_group(["composer"], tmp_path / "log", timeout=100)
    assert group.signals == [(signal.SIGKILL, 0.0)]


@pytest.mark.subprocess
def test_a_job_past_its_limit_is_stopped_with_everything_it_started(tmp_path):
    """run_group (what launches each variant) kills the whole process group at the time limit: the
    launcher and the process it started, as `composer -n 1` starts the training process."""
    pid_file = tmp_path / "child.pid"
    child = "import time; time.sleep(60)"
    parent = (
        "import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    began = time.monotonic()
    done = gpu_runs.run_group([sys.executable, "-c", parent], tmp_path / "log", timeout=3)
    assert done.returncode == 124 and time.monotonic() - began < 30
    assert "stopped after its time limit of 3 s" in (tmp_path / "log").read_text()
    pid = int(pid_file.read_text())
    for _ in range(50):  # killed; init reaps it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the launched process {pid} outlived the time limit")


def test_a_job_that_raises_is_a_failed_row_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    ran = []
    fake_jobs(monkeypatch, tmp_path, ran)

    def out_of_memory(out, batches, microbatch):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_check, "plain_row", out_of_memory)
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert ran == [(256, "base"), (256, gpu_runs.FULL)]
    rows = json.loads((tmp_path / "gpu-check-run1.json").read_text())["rows"]
    assert rows[1] == {"variant": gpu_runs.PLAIN, "resolution": 256, "microbatch": 32, "ok": False,
                       "log": "RuntimeError: CUDA out of memory"}  # fmt: skip
    assert f"FAILED: throughput variant failed: {gpu_runs.PLAIN} at 256 px" in capsys.readouterr().out


def test_run_takes_no_selection():
    with pytest.raises(SystemExit):
        gpu_check.main(["--run", "2", "--variants", "compile"])
