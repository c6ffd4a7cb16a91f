"""The kit for a lent GPU machine (docs/benchmarks.md, "GPU figures"), without one and without the
network: bench/gpu/device_wheels.py's list pins the lock's versions and leaves the device's torch alone, its
METADATA check flags an uncovered requirement, and bench/gpu/gpu_session.sh, run with a fake `python3`,
installs the wheels, runs the preflight and gpu_check with their flags, and packs the results into
$OUT when gpu_check fails, when the preflight fails, and when the call is stopped."""

import os
import signal
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from bench.gpu import device_wheels

REPO = Path(__file__).resolve().parents[1]
SESSION = REPO / "bench/gpu/gpu_session.sh"


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements-lock.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[device_wheels.canonical(name)] = version.strip()
    return pins


def test_every_wheel_is_pinned_at_the_lock_version_once():
    listed = device_wheels.wheel_list()
    assert len(listed) == len(device_wheels.WHEELS)  # no package named twice
    lock = lock_pins()
    assert {name: lock.get(name) for name in listed} == listed


def test_no_torch_or_nvidia_package_is_carried():
    """The device's own torch 2.11 (and its CUDA libraries) is what gpu-check measures."""
    for name in device_wheels.wheel_list():
        assert name not in {"torch", "torchvision", "torchaudio", "triton"}, name
        assert not name.startswith(("nvidia-", "cuda-")), name


def test_the_exceptions_do_not_contradict_the_list():
    listed = set(device_wheels.wheel_list())
    assert not listed & set(device_wheels.LEFT_OUT)
    assert not listed & set(device_wheels.DEVICE_OUT_OF_RANGE)
    assert set(device_wheels.DEVICE_OUT_OF_RANGE) <= device_wheels.DEVICE_PACKAGES
    assert device_wheels.SDIST_ONLY <= listed


def fake_wheel(folder: Path, name: str, version: str, requires: list[str], tags="py3-none-any") -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-{tags}.whl"
    lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_the_metadata_check_flags_what_is_neither_carried_on_the_device_nor_left_out(tmp_path):
    pins = device_wheels.wheel_list()
    requires = [
        "boto3<2",  # LEFT_OUT
        "numpy>=1.17",  # on the device, in range
        "numpy<2.2",  # on the device, out of range, with a reason: a printed line
        f"tokenizers>={pins['tokenizers']}",  # carried at a version in range
        "some-package-nobody-has>=1",
        "rich<13",  # carried, but at a version out of this range
        'pytest; extra == "test"',  # an extra: not needed
        'tomli; python_version < "3.11"',  # another Python
    ]
    fake_wheel(tmp_path, "mosaicml-streaming", pins["mosaicml-streaming"], requires)
    fake_wheel(tmp_path, "hydra-core", pins["hydra-core"], [], tags="cp311-cp311-manylinux_2_17_x86_64")
    problems = device_wheels.check(tmp_path)
    about = [p for p in problems if p.startswith(("mosaicml-streaming ", "hydra"))]
    assert len(about) == 3, problems
    assert "some-package-nobody-has" in about[1] and "rich" in about[2] and "hydra_core" in about[0]
    assert f"diffusers=={pins['diffusers']}: no wheel in {tmp_path}" in problems


def run_session(tmp_path: Path, *args: str, fail_preflight: bool = False, background: bool = False):
    """bench/gpu/gpu_session.sh with a fake python3 that logs its arguments; as gpu_check it writes a table,
    its json, data and a checkpoint into --out and exits 1 (or, `background`, sleeps until stopped)."""
    fake_bin, wheels = tmp_path / "bin", tmp_path / "whl"
    fake_bin.mkdir()
    wheels.mkdir()
    (wheels / "pkg-1.0-py3-none-any.whl").write_bytes(b"")
    python = fake_bin / "python3"
    python.write_text(
        """#!/bin/sh
echo "python3 $*" >>"$FAKE_LOG"
case " $* " in
  *" bench/gpu/gpu_check.py "*)
    prev=""; for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
    mkdir -p "$out/latents" "$out/e2e-a"
    printf '# gpu-check (fake)\\n\\n| variant | px |\\n' >"$out/gpu-check-run1.md"
    echo '{"rows": []}' >"$out/gpu-check-run1.json"
    echo '{}' >"$out/latents/index.json"
    echo checkpoint >"$out/e2e-a/ep0-ba25-rank0.pt"
    echo '{"batch": 26}' >"$out/e2e-a/loss.jsonl"
    [ -n "$FAKE_SLEEP" ] && exec sleep 30
    echo "FAILED: a fake check"; exit 1;;
  *" - "*) cat >/dev/null; [ -z "$FAKE_PREFLIGHT_FAIL" ] || { echo "preflight FAILED: fake"; exit 1; };;
esac
exit 0
"""
    )
    python.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PY", "PYTHONPATH")},
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "KIT_WHEELS": str(wheels),
        "KIT_SITE": str(tmp_path / "site"),
        "GPU_CHECK_OUT": str(tmp_path / "results"),
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "FAKE_PREFLIGHT_FAIL": "1" if fail_preflight else "",
        "FAKE_SLEEP": "1" if background else "",
    }
    command = ["bash", str(SESSION), *args]
    if background:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def packed(tmp_path: Path, run: int = 1) -> set[str]:
    with tarfile.open(tmp_path / f"out/gpu-check-run{run}.tgz") as archive:
        return {os.path.normpath(name) for name in archive.getnames() if not archive.getmember(name).isdir()}


@pytest.mark.subprocess
def test_session_script_parses():
    assert subprocess.run(["bash", "-n", str(SESSION)], capture_output=True).returncode == 0


@pytest.mark.subprocess
def test_session_packs_the_results_when_gpu_check_fails(tmp_path):
    done = run_session(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu-check-run1.md", "gpu-check-run1.tgz"]
    assert (tmp_path / "out/gpu-check-run1.md").read_text().startswith("# gpu-check (fake)")
    files = packed(tmp_path)
    assert {"gpu-check-run1.md", "gpu-check-run1.json", "e2e-a/loss.jsonl", "session-run1.log"} <= files
    assert not any(f.startswith("latents") or f.endswith(".pt") for f in files), files
    calls = (tmp_path / "calls.log").read_text().splitlines()
    install = next(c for c in calls if " -m pip install " in c)
    assert "--no-index --no-deps" in install and f"--target {tmp_path / 'site'}" in install
    assert install.endswith("pkg-1.0-py3-none-any.whl")
    assert f"python3 bench/gpu/gpu_check.py --run 1 --out {tmp_path / 'results'} --budget 520" in calls


@pytest.mark.subprocess
def test_session_stops_before_gpu_check_when_the_preflight_fails(tmp_path):
    done = run_session(tmp_path, "2", fail_preflight=True)
    assert done.returncode == 3 and "PREFLIGHT FAILED" in done.stdout, done.stdout + done.stderr
    assert "bench/gpu/gpu_check.py" not in (tmp_path / "calls.log").read_text()
    assert packed(tmp_path, run=2) == {"session-run2.log"}


@pytest.mark.subprocess
def test_session_packs_what_gpu_check_wrote_when_it_is_stopped(tmp_path):
    process = run_session(tmp_path, background=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "results/e2e-a/loss.jsonl").exists():  # the fake gpu_check's last file
        assert time.monotonic() < deadline and process.poll() is None, "gpu_check was never started"
        time.sleep(0.05)
    time.sleep(0.2)  # the fake goes on to its sleep
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 143, output
    assert {"gpu-check-run1.md", "gpu-check-run1.json", "e2e-a/loss.jsonl"} <= packed(tmp_path)


@pytest.mark.subprocess
def test_session_runs_a_presets_check_by_name(tmp_path):
    """`bash bench/gpu/gpu_session.sh flux-schnell`: gpu_check's --preset (its depth job), packed under the
    preset's name."""
    done = run_session(tmp_path, "flux-schnell")
    assert done.returncode == 1, done.stdout + done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    results = tmp_path / "results"
    assert f"python3 bench/gpu/gpu_check.py --preset flux-schnell --out {results} --budget 520" in calls
    assert "gpu-check-flux-schnell.tgz" in os.listdir(tmp_path / "out")
