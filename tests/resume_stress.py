"""Kill a two-process tiny training run at seeded moments and check that every restart ends bitwise equal
to the uninterrupted run (not part of `make test`: ~1 minute a kill on two shared cores).

    python tests/resume_stress.py [--kills 20] [--seed 0] [--out DIR] [--keep] [--sharded]

The run is the one the resume tests train (tests/resume_check.py: `composer -n 2` through
tests/launch.py, the tiny recipe, 8 batches over two epochs, a checkpoint every batch, autoresume,
EMA). One uninterrupted reference, then per kill a fresh folder: the run is killed, restarted with the
same command, and its loss at every batch, final UNet and EMA weights must equal the reference's
bit for bit. Each kill draws, from --seed and its number, a batch and one of these moments:

  group         SIGKILL to every process 0-0.4 s after the batch is logged (the node goes, the OOM
                killer takes the job): mid-batch, mid-save or between the two
  rank1         SIGKILL to rank 1 alone at the same moments; the launcher then stops rank 0
  in-write      rank 0 SIGKILLed halfway through writing the batch's checkpoint file
                (tests.probes.KillDuringSave)
  before-latest rank 0 SIGKILLed once the checkpoint is in place and Composer has deleted `latest`
                to link it anew (tests.probes.KillBeforeLatest)

After a kill, every file under a checkpoint's name must load, and the restart must train on from the
newest of them (not from an older one, nor from batch 0 over its own checkpoints).

`--sharded` stresses sharded checkpoints instead (tests/fsdp2_runs.py: the tiny MMDiT on 2 processes
with parallelism.shard=2, 6 batches, a folder of 2 shard files and a .metadata per batch), with the
kinds group and rank1: a kill often lands inside a save, and leaves a folder without its metadata
or with a shard cut short; the restart must train on from the newest complete one. Prints a line per
kill and the seconds each took; exits 1 on the first restart that differs (--keep-going to carry on),
with the line to repeat it.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("group", "rank1", "in-write", "before-latest")


def shapes_mds(root: Path) -> Path:
    """The resume tests' data: 64 synthetic shapes as MDS (tests/conftest.py, shapes_mds)."""
    from convert.folder import iter_samples
    from convert.mds import write_mds
    from data.synthetic import write_shapes_folder

    if not (root / ".built").exists():
        shutil.rmtree(root, ignore_errors=True)
        write_shapes_folder(root / "images", n=64, size=32, seed=0)
        write_mds(iter_samples(root / "images"), str(root / "mds"))
        (root / ".built").touch()
    return root


def draw(seed: int, number: int, sharded: bool = False) -> tuple[str, int, float]:
    """Kill `number`'s moment: (kind, batch, seconds after the batch is logged)."""
    from tests import fsdp2_runs, resume_check

    rng = random.Random(f"{seed}-{number}")
    kinds = KINDS[:2] if sharded else KINDS  # the probes kill inside a checkpoint file's write
    batches = fsdp2_runs.BATCHES if sharded else resume_check.BATCHES
    kind = kinds[number % len(kinds)] if number < len(kinds) else rng.choice(kinds)  # each kind early on
    # Not after the last two batches: 0.6 s after batch 6 of 8 the run had ended once, and a kill after
    # the end tests nothing of a resume.
    batch = rng.randint(1, batches - 2)
    return kind, batch, rng.uniform(0.0, 0.4) if kind in ("group", "rank1") else 0.0


def kill_at(command: list[str], env: dict, loss_log: Path, kind: str, batch: int, delay: float) -> str:
    """Run `command`; kill it as `kind` says; what happened, in words."""
    import psutil

    from extensions.callbacks import read_loss_log

    probe = {"in-write": "KillDuringSave", "before-latest": "KillBeforeLatest"}.get(kind)
    if probe:
        command = [*command, f"+callbacks.kill={{_target_: tests.probes.{probe}, batch: {batch}}}"]
    with (loss_log.parent / "killed.log").open("w") as log:  # the killed run's output
        proc = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # the probe killed rank 0; the launcher stopped rank 1
                return f"exited {proc.returncode}"
            if not probe and loss_log.exists() and batch in read_loss_log(loss_log):
                time.sleep(delay)
                if kind == "group":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    rank1 = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
                    for p in rank1:
                        p.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                return f"killed {delay:.3f} s after batch {batch} was logged"
            time.sleep(0.02)
        raise TimeoutError(f"batch {batch} not reached in 600 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def unloadable(folder: Path) -> list[str]:
    """Files under a checkpoint's name in `folder` that do not load."""
    import torch

    bad = []
    for path in sorted(folder.glob("ep*-ba*-rank*.pt")):
        try:
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as error:  # noqa: BLE001 (any failure to load is what is counted)
            bad.append(f"{path.name}: {type(error).__name__}")
    return bad


def newest_complete(folder: Path) -> int:
    """The batch of the newest complete sharded checkpoint in `folder` (0 if none)."""
    from models.checkpoints.sharded_checkpoint import ShardedCheckpointError, check_complete

    batches = [0]
    for path in folder.glob("ep*-ba*"):
        try:
            if path.is_dir() and not path.is_symlink() and check_complete(path):
                batches.append(int(path.name.split("-ba")[1]))
        except ShardedCheckpointError:
            pass
    return max(batches)


def command_for(args, out: Path, data: Path) -> tuple[list[str], int]:
    """The run's command and its number of batches."""
    from tests import fsdp2_runs, resume_check

    launch = resume_check.LAUNCH_EXEC  # new interpreters: the rank-1 kill finds that rank by its environment
    if args.sharded:
        return fsdp2_runs.mmdit_command("shard-2", out, data, launch=launch), fsdp2_runs.BATCHES
    return resume_check.train_command(2, out, data, launch=launch), resume_check.BATCHES


def one_kill(number: int, args, data: Path, reference: Path) -> tuple[bool, str]:
    from tests.resume_check import assert_same_run, run, train_env

    kind, batch, drawn = draw(args.seed, number, args.sharded)
    out = args.out / f"kill-{number:02d}"
    command, batches = command_for(args, out, data)
    for delay in (drawn, 0.0):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        what = kill_at(command, train_env(), out / "loss.jsonl", kind, batch, delay)
        # A kill after the run's end (on an idle machine the last batches take < 0.3 s) tests no resume:
        # once more, the moment the batch is logged.
        if not list(out.glob(f"ckpt/*-ba{batches}-rank0.pt")) and not list(
            out.glob(f"ckpt/*-ba{batches}/.metadata")
        ):
            break
    why = f"kill {number} ({kind} at batch {batch}: {what}); repeat with --seed {args.seed} --first {number}"
    # The probes' kills came where they say: rank 0 SIGKILLed (the launcher exits 9) with half a file
    # under the temporary name, or with the checkpoint in place and no `latest` link.
    names = sorted(p.name for p in (out / "ckpt").iterdir()) if (out / "ckpt").is_dir() else []
    if kind == "in-write" and (what != "exited 9" or not any(n.startswith(".tmp-") for n in names)):
        return False, f"{why}: not killed inside the write: {names}"
    if kind == "before-latest" and (what != "exited 9" or "latest-rank0.pt" in names):
        return False, f"{why}: not killed before `latest` was linked: {names}"
    if bad := unloadable(out / "ckpt"):
        return False, f"{why}: after the kill these do not load: {bad}"
    saved = [int(p.name.split("-ba")[1].split("-")[0]) for p in out.glob("ckpt/ep*-ba*-rank0.pt")]
    newest = newest_complete(out / "ckpt") if args.sharded else max(saved, default=0)
    logged = len((out / "loss.jsonl").read_text().splitlines()) if (out / "loss.jsonl").exists() else 0
    again = run(command, REPO, train_env())
    if again.returncode != 0:
        return False, f"{why}: the restart exited {again.returncode}: {again.stderr[-2000:]}"
    # The restart trains on from the newest checkpoint the kill left, not from an older one or batch 0.
    redone = [json.loads(line)["batch"] for line in (out / "loss.jsonl").read_text().splitlines()[logged:]]
    if redone[:1] != ([newest + 1] if newest < batches else []):
        return False, f"{why}: the newest checkpoint was batch {newest}, the restart trained batches {redone}"
    try:
        assert_same_run(reference, out, why, batches)
    except AssertionError as error:
        return False, f"{why}: differs from the uninterrupted run ({error})"
    if not args.keep:
        shutil.rmtree(out)
    return True, f"{why}: resumed after batch {newest}, bitwise equal"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--kills", type=int, default=20, help="how many kills (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="draws the kills' moments (default 0)")
    parser.add_argument("--first", type=int, default=0, help="number of the first kill (to repeat one)")
    parser.add_argument("--out", type=Path, help="working folder (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true", help="keep each kill's folder")
    parser.add_argument("--keep-going", action="store_true", help="go on after a restart that differs")
    parser.add_argument("--sharded", action="store_true", help="a sharded run (FSDP2, sharded checkpoints)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    temporary = args.out is None
    args.out = Path(args.out or tempfile.mkdtemp(prefix="resume-stress-")).absolute()
    from tests.resume_check import run, train_env

    data = shapes_mds(args.out / "shapes")
    reference = args.out / ("reference-sharded" if args.sharded else "reference")
    if not (reference / "ema-rank0.pt").exists():
        reference.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        result = run(command_for(args, reference, data)[0], REPO, train_env())
        if result.returncode != 0:
            sys.exit(f"the uninterrupted run failed: {result.stderr[-3000:]}")
        print(f"reference run: {time.monotonic() - start:.1f} s", flush=True)
    passed, seconds = 0, []
    for number in range(args.first, args.first + args.kills):
        start = time.monotonic()
        ok, line = one_kill(number, args, data, reference)
        seconds.append(time.monotonic() - start)
        passed += ok
        print(f"{'ok  ' if ok else 'FAIL'} {line} [{seconds[-1]:.1f} s]", flush=True)
        if not ok and not args.keep_going:
            break
    print(f"{passed}/{args.kills} restarts bitwise equal; {sum(seconds) / len(seconds):.1f} s a kill")
    if temporary and passed == args.kills and not args.keep:
        shutil.rmtree(args.out)
    sys.exit(0 if passed == args.kills else 1)


if __name__ == "__main__":
    main()
