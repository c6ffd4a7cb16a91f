"""The run plan of bench/gpu/gpu_check.py and what runs it (its docstring says why the runs are as they are).

RUNS: the jobs of each device call (`make gpu-check PART=N`), with each job's estimated seconds
(ESTIMATE_S, estimate); custom_jobs: the jobs --variants, --parts, --resolutions, --quick or another
preset select instead. run_and_report runs them in order (run_jobs): a job starts only while 75% of
its estimate is left of --budget; a variant's `composer -n GPUS` process group is killed past twice
its estimate or the budget's end (composer, run_group); run 3's 512 px variant is run 1's best
(best_variant); the fastest variant per size goes to OUT/throughput[-PRESET]-PX.json, unless an
earlier run's there is faster (write_best); after every job OUT/STEM.md (the table) and .json are
rewritten. gpu_check hands in the variants' overrides (`target`: its TARGETS entry for the preset) and
rows (`measure`: its throughput, bench/plain_loop.py's ceiling, bench/gpu/depth_extrapolation.py's depth
job for a preset too large for one GPU); the checks are bench/gpu/gpu_e2e.py's."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu.gpu_e2e import part_e2e, part_ema

REPO = Path(__file__).resolve().parents[2]

# The jobs' names: the variants the plan is built around (gpu_check's VARIANTS: their overrides),
# the plain loop, run 1's best carried to 512 px, and the two checks.
BASE = "eager step (_step=eager; sdpa, DDP / no wrapper on 1 GPU)"
FULL = "compile + CUDA graphs + bf16 weights + channels_last"  # the recipe's step (yamls/_step/compiled.yaml)
FULL_2 = f"{FULL}, 2 microbatches"  # with gradient accumulation: graphs replayed twice a batch
PER_SAMPLE = f"{FULL}, per-sample draws"  # model.train_draws=sample (models/engine/draw_keys.py)
PLAIN = "plain PyTorch loop, 1 GPU (the ceiling)"
BEST = "run 1's best"  # at 512 px: the fastest 256 px variant of run 1 (or of this run)
E2E_CHECK = "e2e: train, save, resume (--deterministic), export, generate"
EMA_CHECK = "EMA storage variants"
# (kind, name, px); each run cheapest and most certain first (a slow compile, a guess, costs only what
# follows); seconds as estimated (ESTIMATE_S): no two compiled variants (215 s each) fit one run.
RUNS = {
    1: [("throughput", BASE, 256), ("plain", PLAIN, 256), ("throughput", FULL, 256)],  # 90 + 30 + 215
    2: [("e2e", E2E_CHECK, 256)],  # 515: both runs compile the recipe's step
    3: [("throughput", BASE, 512), ("throughput", BEST, 512)],  # 90 + 215
    4: [("throughput", "bf16 weights", 256), ("throughput", "FSDP per block", 256),
        ("throughput", FULL_2, 256)],  # 90 + 90 + 215
    5: [("throughput", "2x microbatch", 256), ("throughput", "compile + CUDA graphs", 256)],  # 90 + 215
    6: [("ema", EMA_CHECK, None), ("throughput", "compile", 256)],  # 45 + 215
    7: [("throughput", "compile, channels_last", 256), ("throughput", PER_SAMPLE, 256)],  # 215 + 215
}  # fmt: skip
# Seconds per job on one H100 (gpu_check's docstring): a variant's process per size, compiling, the rest.
# Measured on 2026-11-26 (runs 1 and 3): a variant's process 90 s at 256 px, 75 at 512; compiling the
# recipe's step added 113-124 s; the plain loop 21 s. e2e: 330 s measured eager on 2026-11-24, plus a
# cold compile in run A and a warm one (inductor's cache, same shapes) in run B, a guess of 60 s.
ESTIMATE_S = {256: 90, 512: 90, 1024: 150, "compile": 125, "plain": 30, "e2e": 330 + 125 + 60, "ema": 45}
# The depth job (bench/gpu/depth_extrapolation.py, flux-schnell): a guess, not measured: ~20 s of imports,
# ~15 s counting the full model's FLOPs on the meta device, 4 depths of ~15 s (building up to 1.9 B
# parameters on the GPU, 23 steps of up to ~0.3 s).
ESTIMATE_S["depth"] = 120
# Of a 600 s device call, which also installs the carried wheels (3 s on 2026-11-26), runs the preflight
# (16-26 s) and packs the results.
BUDGET_S = 520
COMPILED_STEP = "_step=compiled"  # sd2-base's default step (yamls/_step/), named in a variant: it compiles


def estimate(job: tuple, variants: dict) -> int:
    """A job's estimated seconds (ESTIMATE_S): a variant's process at its size, plus compiling;
    `variants` is the preset's (name -> overrides), where BEST counts as FULL."""
    kind, name, resolution = job
    if kind != "throughput":
        return ESTIMATE_S[kind]
    variant = variants[FULL if name == BEST else name]
    compiles = any("compile_unet" in o or o == COMPILED_STEP for o in variant)
    return ESTIMATE_S[resolution] + ESTIMATE_S["compile"] * compiles


def custom_jobs(preset: str, target: dict, quick: bool, only, resolutions, parts) -> list[tuple]:
    """The jobs --variants/--parts/--resolutions/--quick select: the variants at the lower size, the
    baseline and the lower size's best at the higher (or the chosen variants alone), the plain loop."""
    variants = list(target["variants"])
    low, high = sorted(target["microbatch"])
    names = variants[:1] if quick else variants
    if only:  # the baseline always runs: every ratio in the table is against it
        names = [variants[0], *(name for name in variants[1:] if any(o in name for o in only))]
    jobs = []
    if "throughput" in parts:
        jobs += [("throughput", name, low) for name in names if low in resolutions]
        if high in resolutions:
            rest = [BEST] if low in resolutions else names[1:]
            jobs += [("throughput", name, high) for name in [names[0], *rest]]
        if preset == "sd2-base" and 256 in resolutions:  # last: the GPU is free of variants then
            jobs.append(("plain", PLAIN, 256))
    return jobs + [("ema", EMA_CHECK, None)] * ("ema" in parts) + [("e2e", E2E_CHECK, 256)] * ("e2e" in parts)


def run_and_report(jobs: list[tuple], n: int, args, stem: str, target: dict, measure: dict) -> int:
    """Runs `jobs` on `n` GPUs (run_jobs), rewriting OUT/STEM.md and .json after each; prints the
    table and what failed or was not run; 1 if a job failed, else 0."""
    import torch

    device = torch.cuda.get_device_name()
    title = f"# gpu-check {time.strftime('%Y-%m-%d')}: {n} x {device}, torch {torch.__version__}"
    title += f", run {args.run} of {len(RUNS)}" if args.run else ""
    print(title, flush=True)
    report = {"title": title, "device": device, "gpus": n, "torch": torch.__version__, "run": args.run,
              "budget_s": args.budget, "rows": [], "checks": [], "seconds": [], "skipped": [],
              "best": {}}  # fmt: skip
    anchors = target["anchors"]

    def save() -> None:  # after every job: a run killed later still leaves what it measured
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (args.out / f"{stem}.md").write_text(f"{title}\n\n{table(report['rows'], anchors)}")

    save()
    handler = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the job's processes too
    try:
        run_jobs(jobs, n, args.out, args, report, save, target, measure)
    finally:
        signal.signal(signal.SIGTERM, handler)
    print(table(report["rows"], anchors))
    problems = [
        f"throughput variant {'timed out' if r.get('timed_out') else 'failed'}: {r['variant']} at "
        f"{r['resolution']} px" for r in report["rows"] if not r["ok"]
    ] + [f"{c['check']}: {problem}" for c in report["checks"] for problem in c["problems"]]  # fmt: skip
    for job in report["skipped"]:
        print(f"not run (out of --budget): {job['job']}")
    for problem in problems:
        print(f"FAILED: {problem}")
    for line in report["best"].values():
        print(f"for recipes.plan: {line}")
    anchor = target.get("mfu_anchor")  # an MFU measured elsewhere: (fraction, where)
    for row in (r for r in report["rows"] if anchor and r["ok"]):
        versus = f"{row['mfu'] / anchor[0]:.2f}x {anchor[1]}'s {anchor[0]:.1%}"
        print(f"MFU {row['mfu']:.1%} at {row['resolution']} px: {versus}")
    print(f"results: {args.out / stem}.md and .json, profiles: {args.out}/profile-*.json")
    return 1 if problems else 0


def run_jobs(
    jobs: list[tuple], n: int, out: Path, args, report: dict, save, target: dict, measure: dict
) -> None:
    """Runs `jobs` within args.budget from args.start (a time.monotonic()), each under its time limit,
    calling `save()` after each. `measure` holds the rows: "throughput" (n, out, px, name, overrides,
    batches, preset, timeout) and "plain" (out, batches, microbatch)."""
    start, variants = args.start, target["variants"]
    for kind, name, resolution in jobs:
        if name == BEST:
            name = best_variant(report["rows"], out, args.preset, target)
            done = {(r["variant"], r["resolution"]) for r in report["rows"]}
            if name is None or (name, resolution) in done:
                continue
        need = estimate((kind, name, resolution), variants)
        label = name + (f" at {resolution} px" if kind == "throughput" else "")
        left = start + args.budget - time.monotonic() if args.budget else float("inf")
        if left < 0.75 * need:
            report["skipped"].append({"job": label, "estimate_s": need, "left_s": round(left)})
            print(f"skipped: {label} (needs ~{need} s, {left:.0f} s of --budget left)", flush=True)
            save()
            continue
        limit, began = min(left, 2 * need), time.monotonic()
        if kind in ("throughput", "depth"):
            if kind == "throughput":
                tried = (n, out, resolution, name, variants[name], args.batches, args.preset, limit)
                row = measure["throughput"](*tried)
            else:  # one GPU, whatever n: the model at reduced depth, extrapolated
                row = measure["depth"](out, resolution, name, args.batches, target, limit)
            report["rows"].append(row)
            report["best"] = write_best(report["rows"], out, args.preset, target)
            print(f"measured: {row}", flush=True)  # a run cut short still shows what it measured
        elif kind == "plain":
            micro = target["microbatch"][256]  # the plain loop runs sd2-base only
            try:
                report["rows"].append(measure["plain"](out, args.batches, micro))
            except Exception as err:  # noqa: BLE001 - e.g. out of memory: the run goes on
                report["rows"].append({"variant": PLAIN, "resolution": 256, "microbatch": micro,
                                       "ok": False, "log": f"{type(err).__name__}: {err}"[:300]})  # fmt: skip
                free_gpu()
        else:
            try:
                if kind == "ema":
                    found, ms = part_ema()
                    lines = ["EMA ms per update: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())]
                else:
                    deterministic = args.deterministic or args.run is not None
                    found, lines = part_e2e(n, out, composer, deterministic, deadline=time.time() + limit)
            except Exception as err:  # noqa: BLE001 - reported as the check's problem
                found, lines = [f"{type(err).__name__}: {err}"[:300]], []
                free_gpu()
            report["checks"].append({"check": name, "ok": not found, "problems": found, "lines": lines})
            print("\n".join([*lines, f"{name}: " + ("ok" if not found else "; ".join(found))]), flush=True)
        seconds = round(time.monotonic() - began, 1)
        report["seconds"].append({"job": label, "estimate_s": need, "seconds": seconds})
        save()


def best_variant(rows: list[dict], out: Path, preset: str, target: dict) -> str | None:
    """The fastest variant at the preset's lower size in `rows`, else in run 1's results in `out`;
    without either, sd2-base's FULL."""
    low, variants = min(target["microbatch"]), target["variants"]

    def fastest(candidates):
        ok = [r for r in candidates if r["ok"] and r["variant"] in variants and r["resolution"] == low]
        return max(ok, key=lambda r: r["img_s"])["variant"] if ok else None

    earlier = out / "gpu-check-run1.json"
    if fastest(rows) is None and preset == "sd2-base" and earlier.exists():
        return fastest(json.loads(earlier.read_text())["rows"]) or FULL
    return fastest(rows) or (FULL if preset == "sd2-base" else None)


def write_best(rows: list[dict], out: Path, preset: str, target: dict) -> dict[int, str]:
    """The fastest variant per size in `rows` to OUT/throughput[-PRESET]-PX.json, for recipes.plan, unless
    the file holds a faster result of the same recipe on the same device, an earlier run's (runs 1 and
    4-7 all time 256 px), which is kept then; returns, per size, what the file holds."""
    held, suffix = {}, "" if preset == "sd2-base" else f"-{preset}"
    for resolution in target["microbatch"]:
        done = [r for r in rows if r["ok"] and r["variant"] != PLAIN and r["resolution"] == resolution]
        if not done:
            continue
        top = max(done, key=lambda r: r["img_s"])
        path = out / f"throughput{suffix}-{resolution}.json"
        new = json.loads(Path(top["file"]).read_text())
        try:
            old = json.loads(path.read_text())
            same = old["recipe"] == new.get("recipe") and old["device"] == new.get("device")
            kept = same and old["img_per_sec_per_gpu"] > top["img_s"]
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one this can compare
            kept = False
        if not kept:
            path.write_text(Path(top["file"]).read_text())
        earlier = f"an earlier run's {old['img_per_sec_per_gpu']:.1f} img/s, kept over " if kept else ""
        held[resolution] = f"{path}: {earlier}this run's best, {top['variant']} at {top['img_s']:.1f} img/s"
    return held


def free_gpu() -> None:
    """What a failed in-process job left on the GPU, for the jobs after it."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def composer(n: int, args: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    """`composer -n N ARGS` with its output in `log`; past `timeout` seconds the launcher and the
    training processes it started are stopped and the exit status is 124, so one hung variant
    cannot hold the GPU for the next."""
    # this interpreter's launcher, so the check also runs where the packages are not in .venv
    command = [sys.executable, "-m", "composer.cli.launcher", "-n", str(n), *args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    return run_group(command, log, timeout, env)


def run_group(command: list[str], log: Path, timeout: float, env=None) -> subprocess.CompletedProcess:
    """`command` in a process group of its own, output to `log`; past `timeout` the whole group gets
    SIGTERM and what is left of it SIGKILL 20 s later (stop_group), and the exit status is 124.
    If this script is stopped meanwhile (Ctrl-C, SIGTERM), the group gets SIGKILL at once."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        try:
            return subprocess.CompletedProcess(command, process.wait(timeout=max(timeout, 1)))
        except subprocess.TimeoutExpired:
            stop_group(process)
    except BaseException:  # this script stopped: the group is in its own session, nothing else stops it
        with contextlib.suppress(ProcessLookupError):  # gone already: the original exit goes on
            os.killpg(process.pid, signal.SIGKILL)
        raise
    with open(log, "a") as out:
        out.write(f"\ngpu-check: stopped after its time limit of {timeout:.0f} s\n")
    return subprocess.CompletedProcess(command, 124)


def stop_group(process: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM to `process`'s group, SIGKILL to what is left of it `grace` s later: the whole group's wait,
    as the launcher may exit on SIGTERM before the processes it started (still freeing the GPU) do."""
    deadline = time.monotonic() + grace
    with contextlib.suppress(ProcessLookupError):  # raised once the whole group is gone
        os.killpg(process.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            process.poll()  # reaps the launcher once it has exited: a zombie still counts as alive
            os.killpg(process.pid, 0)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def table(rows: list[dict], anchors: dict) -> str:
    """The markdown table of `rows`: each row against the anchor at its size (`anchors`: px -> (img/s,
    source)), and the first 256 px variant against the plain loop where their microbatches match."""
    lines = [
        "| variant | px | microbatch | img/s per GPU | MFU | peak GB | vs anchor | GPU busy | launches/step "
        "| syncs/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["ok"]:
            why = "timed out" if r.get("timed_out") else "failed"
            lines.append(
                f"| {r['variant']} | {r['resolution']} | {r['microbatch']} | {why}: {r['log']} | | | | | | |"
            )
            continue
        anchor = anchors.get(r["resolution"], (None,))[0]
        versus = f"{r['img_s'] / anchor:.2f}x" if anchor else "-"
        memory = f"{r['memory_gb']:.1f}" if r.get("memory_gb") is not None else "?"
        busy = f"{r['gpu_busy']:.0%}" if r.get("gpu_busy") is not None else "?"
        profile = f"{busy} | {r['launches']:,.0f} | {r['syncs']:g}" if "profile" in r else "| |"
        lines.append(
            f"| {r['variant']} | {r['resolution']} | {r['microbatch']} | {r['img_s']:.1f} | {r['mfu']:.1%} "
            f"| {memory} | {versus} | {profile} |"
        )
    anchor_text = (
        "; ".join(f"{px} px: {v:g} img/s ({why})" for px, (v, why) in anchors.items()) or "none public"
    )
    ceiling = next((r for r in rows if r["ok"] and r["variant"] == PLAIN), None)
    base = next((r for r in rows if r["ok"] and r["variant"] != PLAIN and r["resolution"] == 256), None)
    if ceiling and base and base["microbatch"] == ceiling["microbatch"]:
        anchor_text += f". {base['variant']} / plain loop at 256 px: {base['img_s'] / ceiling['img_s']:.2f}x"
    return "\n".join(lines) + f"\n\nAnchors: {anchor_text}. Moonshot: 50% MFU.\n"
