"""The wheels a lent GPU machine needs to run `make gpu-check` (bench/gpu/gpu_session.sh), fetched here.

    python bench/gpu/device_wheels.py [--dest .whl] [--check]

That machine (/work/.library/device: KINDS.md, README.md) has no network and no python3.11: its own
Python 3.12 holds torch 2.11.0+cu130, torchvision 0.26, transformers 5.17, tokenizers 0.23.2,
huggingface_hub 1.33, torchmetrics 1.9.0, numpy 2.5.2 and ~190 other packages (DEVICE_PACKAGES), not
our stack. bench/gpu/gpu_session.sh installs the wheels this script leaves in `.whl/` (git-ignored through
.git/info/exclude; the device call carries it) with `pip install --no-deps --target /tmp/site`, beside
the machine's own torch, the way the 2026-11-24 H100 run did it by hand. Our lock's torch 2.14.1 is
the same CUDA 13.0 build family as the device's 2.11.0+cu130, so the kit still carries no torch; a
carried wheel's pin that requirements-overrides.txt lifts is accepted as `make install` accepts it.

WHEELS: what our import path needs that the machine lacks, or holds at a version our pins exclude, each
at requirements-lock.txt's version (tests/test_device_kit.py checks that): cp312 manylinux x86_64 or
pure-python wheels, downloaded with `pip download --no-deps --only-binary=:all:` for that interpreter;
antlr4-python3-runtime 4.9.3 has only an sdist on the registry and is built here into a pure-python
wheel (SDIST_ONLY). The list was drawn from the lock and checked two ways: importing our path
(bench/gpu/gpu_check.py, bench/throughput.py, train.py, models.export, composer's launcher, diffusers'
pipeline) in the local python3.11 venv with every package the device lacks and this list leaves out
made unimportable (sys.modules[name] = None): it imports; and, each time this script runs, reading
every carried wheel's METADATA Requires-Dist (markers evaluated for CPython 3.12 on x86-64 Linux):
each requirement must be carried (at a version it accepts), on the device (DEVICE_PACKAGES; where
KINDS.md records the version, one it accepts, or a reason in DEVICE_OUT_OF_RANGE), or left out with a
reason (LEFT_OUT). Anything else, a wheel of the wrong name, version or platform, or two versions of
one package (they stop the whole install) fails the run.

Idempotent: a wheel already in `.whl/` is not fetched again; a listed package's other versions there
are removed. Prints each wheel's size, the total, and what travels with a device call (this tree's
tracked and untracked-not-ignored files plus the wheels) against the tool's 64 MiB.
"""

import argparse
import email.message
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement  # in .venv (run this script with .venv/bin/python)
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-lock.txt"
OVERRIDES = REPO / "requirements-overrides.txt"  # pins our engine declares and make install lifts
CARRY_LIMIT_MIB = 64  # the device tool's cap on what travels: the working tree, shared/ and carried paths
WARN_MIB = 48  # "well under" the cap: above this the run still succeeds, with a warning

WHEELS = [
    # Composer and what `import composer` imports that the device lacks. composer.loggers imports the
    # MosaicML CLI (mcli) unconditionally, and mcli imports gql/graphql-core/backoff/websockets (its
    # API engine), questionary/prompt-toolkit/wcwidth (interactive prompts), ruamel.yaml (its config),
    # validators and rich (mcli caps rich <14; the device's rich version is not recorded);
    # composer.trainer imports coolname, composer.utils.collect_env importlib_metadata.
    "mosaicml==0.32.1",
    "mosaicml-cli==0.7.5",
    "gql==3.5.3",
    "graphql-core==3.2.6",
    "backoff==2.2.1",
    "websockets==11.0.3",  # its pure-python wheel: no cp312 build of 11.0.3 exists
    "questionary==1.10.0",
    "prompt-toolkit==3.0.53",
    "wcwidth==0.9.4",
    "ruamel.yaml==0.19.1",
    "validators==0.36.0",
    "rich==13.9.4",
    "coolname==2.2.0",
    "importlib_metadata==8.9.0",
    # Metrics: composer 0.32.1 declares torchmetrics <1.7.5 (the device has 1.9.0); torchmetrics imports
    # torch-fidelity whenever it is installed (its FID, evaluation/image_metrics.py), as on the CPU.
    "torchmetrics==1.7.4",
    "torch-fidelity==0.4.0",
    # mosaicml-streaming and its unconditional imports: catalogue (registry_utils) and the codecs of
    # streaming.base.compression: zstd, brotli, python-snappy (and cramjam, its backend). xxhash and
    # matplotlib are on the device; the cloud backends are in LEFT_OUT.
    "mosaicml-streaming==0.13.0",
    "catalogue==2.0.10",
    "zstd==1.5.7.2",  # manylinux_2_14: pip matches the N of manylinux_2_N exactly (PLATFORMS)
    "brotli==1.2.1",
    "python-snappy==0.7.3",
    "cramjam==2.14.0",
    # diffusers and transformers at our pins (the device's transformers 5.17, huggingface_hub 1.33 and
    # tokenizers 0.23.2 are older than the lock's; what gpu-check measures is the stack we ship).
    "diffusers==0.42.1",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "huggingface_hub==2.4.0",
    "httpx2==2.16.2",  # huggingface_hub 2's HTTP client (the httpx fork), with its transport
    "httpcore2==2.16.2",
    "truststore==0.10.5",  # httpx2 and httpcore2 verify TLS with the system store (hub downloads only)
    "click==8.5.1",  # huggingface_hub 2 needs >=8.4.2; the device's click version is not recorded
    # Hydra (recipes/config.py) and omegaconf, which import the ANTLR 4.9 runtime their grammar needs.
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "antlr4-python3-runtime==4.9.3",  # SDIST_ONLY
    # Our own imports beyond the above: peft (models/training/lora.py; composer imports it when installed, and
    # the device's peft, of an unrecorded version, is built for its transformers 5), open_clip_torch
    # (models/engine/tokenizer.py reads its packaged CLIP BPE vocabulary; evaluation/extractors.py imports it)
    # and ftfy, which `import open_clip` needs.
    "peft==0.21.2",
    "open_clip_torch==3.3.0",
    "ftfy==6.3.1",
    # model.fp8 (models/training/fp8.py, torchao.float8); transformers and diffusers import torchao whenever
    # it is installed, so carrying it also keeps the device's import path the CPU's.
    "torchao==0.18.0",
]
SDIST_ONLY = {"antlr4-python3-runtime"}  # no wheel on the registry: `pip wheel` here, pure python

# Requirements of the carried wheels that are deliberately not carried (the device lacks them too).
LEFT_OUT = {
    "boto3": "streaming's and convert/storage.py's S3 client, imported for s3:// paths only; gpu-check's "
    "data are local (/tmp), and botocore alone is ~13 MB",
    "google-cloud-storage": "streaming's gs:// backend, imported for gs:// paths only",
    "paramiko": "streaming's sftp:// backend and composer's SFTPObjectStore (a guarded import)",
    "oci": "streaming's oci:// backend, imported for oci:// paths only",
    "azure-storage-blob": "streaming's azure:// backend, imported for azure:// paths only",
    "azure-storage-file-datalake": "streaming's azure-dl:// backend, imported for such paths only",
    "azure-identity": "streaming's azure backends' credentials, as above",
    "torch-optimizer": "declared by composer 0.32.1, imported nowhere in it",
    "argcomplete": "mosaicml-cli's command line (`mcli`), not imported by `import mcli`",
    "arrow": "mosaicml-cli's command line, not imported by `import mcli`",
    "termcolor": "mosaicml-cli's command line, not imported by `import mcli`",
}

# The device image's Python packages (KINDS.md, "Python packages already there", read 2026-11-17), and
# the versions one session's pip list recorded; our carried wheels shadow the ones named in WHEELS.
DEVICE_PACKAGES = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
    cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
    execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
    httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
    jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
    lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
    mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
    nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
    opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
    pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
    tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
    yarl zipp""".split()
)
DEVICE_VERSIONS = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchmetrics": "1.9.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
# Device packages kept although a carried wheel declares a range that excludes the recorded version.
DEVICE_OUT_OF_RANGE = {
    "torch": "the device's own 2.11.0+cu130 is what is measured (composer declares <2.7.1); the "
    "2026-11-24 H100 run trained with it",
    "torchvision": "the one built for the device's torch 2.11 (composer declares <0.22.1)",
    "numpy": "the device's 2.5.2, which its torch and compiled packages are built against (streaming "
    "declares <2.2, composer <2.3); the 2026-11-24 run used it",
}

# CPython 3.12 on x86-64 Linux (the device's python3, Ubuntu 24.04's 3.12.3, glibc 2.39): pip matches
# manylinux_2_N's N exactly, so every N up to 39 is named, and the legacy aliases.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "platform_release": "",
    "platform_version": "",
    "os_name": "posix",
    "extra": "",
}
TORCH_LIKE = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines) -> dict[str, str]:
    """{canonical name: version} of `name==version` lines (comments and blanks skipped)."""
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


OVERRIDDEN = set(parse_pins(OVERRIDES.read_text().splitlines()))


def wheel_list() -> dict[str, str]:
    return parse_pins(WHEELS)


def wheel_file_key(path: Path) -> tuple[str, str, str]:
    """(canonical name, version, tags) from a wheel's file name."""
    parts = path.name[: -len(".whl")].split("-")
    return canonical(parts[0]), parts[1], "-".join(parts[-3:])


def tags_fit(tags: str) -> bool:
    """A wheel CPython 3.12 on x86-64 Linux can install: pure python, cp312, or a cp3x abi3 build."""
    python, abi, platform = tags.split("-")
    platforms = platform.split(".")
    if platforms == ["any"]:
        return abi == "none" and any(p.startswith("py3") or p == "cp312" for p in python.split("."))
    if not all(p.startswith("manylinux") and p.endswith("x86_64") for p in platforms):
        return False
    if abi == "abi3":
        return any(p.startswith("cp3") and int(p[3:]) <= 12 for p in python.split("."))
    return "cp312" in python.split(".") and abi == "cp312"


def metadata(path: Path) -> email.message.Message:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))


def fetch(dest: Path) -> list[str]:
    """Downloads (or builds) the listed wheels missing from `dest`; removes other versions of them.
    Returns the problems met."""
    dest.mkdir(exist_ok=True)
    wanted, present = wheel_list(), {}
    for path in sorted(dest.glob("*.whl")):
        name, version, _ = wheel_file_key(path)
        if name in wanted and Version(version) != Version(wanted[name]):
            print(f"removing {path.name}: the lock pins {name}=={wanted[name]}")
            path.unlink()
        else:
            present[name] = path
    missing = [name for name in wanted if name not in present]
    binary = [f"{name}=={wanted[name]}" for name in missing if name not in SDIST_ONLY]
    problems = []
    if binary:
        print(f"downloading {len(binary)} wheels: {' '.join(binary)}", flush=True)
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
                   *binary]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            problems.append(f"pip download failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    for name in (n for n in missing if n in SDIST_ONLY):
        print(f"building {name}=={wanted[name]} from its sdist (pure python)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary=:all:",
                       "--wheel-dir", tmp, f"{name}=={wanted[name]}"]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            built = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or len(built) != 1:
                problems.append(f"building {name} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
                continue
            shutil.move(str(built[0]), dest / built[0].name)
    return problems


def check(dest: Path) -> list[str]:
    """The wheels in `dest` against WHEELS, and every Requires-Dist of theirs (see the docstring)."""
    wanted, problems, found, requires = wheel_list(), [], {}, {}
    for path in sorted(dest.glob("*.whl")):
        name, version, tags = wheel_file_key(path)
        if name not in wanted:
            problems.append(f"{path.name}: not in WHEELS (remove it, or list it)")
            continue
        if name in found:
            problems.append(f"two wheels of {name}: {found[name].name}, {path.name}")
        found[name] = path
        meta = metadata(path)
        if canonical(meta["Name"]) != name or Version(meta["Version"]) != Version(wanted[name]):
            problems.append(f"{path.name}: its METADATA says {meta['Name']} {meta['Version']}")
        if not tags_fit(tags):
            problems.append(f"{path.name}: not installable by CPython 3.12 on x86-64 Linux ({tags})")
        requires[name] = meta.get_all("Requires-Dist") or []
    problems += [f"{name}=={pin}: no wheel in {dest}" for name, pin in wanted.items() if name not in found]
    for name, lines in requires.items():
        for line in lines:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate(MARKER_ENV):
                continue  # another Python, or an extra
            needed, spec = canonical(req.name), req.specifier
            if needed in wanted:
                if spec.contains(wanted[needed], prereleases=True):
                    continue
                if needed in OVERRIDDEN:  # as `make install` does: requirements-overrides.txt
                    print(f"overridden: {needed} {wanted[needed]} ({name} declares {req})")
                else:
                    problems.append(f"{name} needs {req}, but {needed}=={wanted[needed]} is carried")
            elif needed in DEVICE_PACKAGES:
                version = DEVICE_VERSIONS.get(needed)
                if version and not spec.contains(version, prereleases=True):
                    if needed in DEVICE_OUT_OF_RANGE:
                        print(f"kept from the device: {needed} {version} ({name} needs {req}): "
                              f"{DEVICE_OUT_OF_RANGE[needed]}")  # fmt: skip
                    else:
                        problems.append(f"{name} needs {req}; the device has {version}: carry it, or "
                                        "give the reason in DEVICE_OUT_OF_RANGE")  # fmt: skip
            elif needed not in LEFT_OUT:
                problems.append(f"{name} needs {req}: neither carried, on the device, nor in LEFT_OUT")
    return problems


def travelling_tree_bytes() -> int:
    """What a device call sends of this checkout besides carried paths: tracked files and untracked
    ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    return sum(os.lstat(REPO / f).st_size for f in listed if f and os.path.lexists(REPO / f))


def ensure_excluded(dest: Path) -> None:
    """`dest` in .git/info/exclude (it must travel as a carried path, not be committed)."""
    try:
        relative = dest.resolve().relative_to(REPO)
    except ValueError:
        return  # outside this checkout
    path = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    exclude, line = REPO / path, f"/{relative.as_posix()}/"
    text = exclude.read_text() if exclude.exists() else ""
    if line not in text.splitlines():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line + "\n")
        print(f"added {line} to {exclude}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="where the wheels go (.whl)")
    parser.add_argument("--check", action="store_true", help="check the wheels there; fetch nothing")
    args = parser.parse_args(argv)
    problems = []
    if not args.check:
        ensure_excluded(args.dest)
        problems += fetch(args.dest)
    problems += check(args.dest)
    wheels = sorted(args.dest.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    for path in wheels:
        name, version, _ = wheel_file_key(path)
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {name}=={version}  {path.name}")
    total, tree = sum(p.stat().st_size for p in wheels) / 2**20, travelling_tree_bytes() / 2**20
    print(f"{total:7.2f} MiB  in {len(wheels)} wheels ({args.dest})")
    print(f"a device call carries {tree:.1f} MiB of this tree + {total:.1f} MiB of wheels = "
          f"{tree + total:.1f} MiB of its {CARRY_LIMIT_MIB} MiB")  # fmt: skip
    if tree + total > CARRY_LIMIT_MIB:
        problems.append(f"over the device tool's {CARRY_LIMIT_MIB} MiB")
    elif tree + total > WARN_MIB:
        print(f"warning: over {WARN_MIB} MiB: little room left under the tool's {CARRY_LIMIT_MIB} MiB")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if not problems:
        print("ok: each requirement of the wheels is carried, on the device, or left out with a reason")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
