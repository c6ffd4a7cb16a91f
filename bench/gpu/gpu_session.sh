#!/usr/bin/env bash
# One device call of `make gpu-check` on a lent GPU machine, which has no network and no `make install`
# (docs/benchmarks.md, "GPU figures"). Here first: `.venv/bin/python bench/gpu/device_wheels.py` (fills .whl/); then
# the device tool's command, with carry [".whl"] and timeout_s 600:
#
#     bash bench/gpu/gpu_session.sh [RUN]      # RUN: one of bench/gpu/gpu_runs.py RUNS, 1 by default
#     bash bench/gpu/gpu_session.sh flux-schnell   # or a preset: `gpu_check.py --preset PRESET` (~2 min)
#
# 1. installs .whl/*.whl into /tmp/site (--no-deps, beside the machine's own torch), PYTHONPATH=/tmp/site:REPO;
# 2. a preflight (~10 s): our stack imports from /tmp/site, CUDA is there, versions; stops here if not;
# 3. python3 bench/gpu/gpu_check.py --run RUN (or --preset PRESET) --out /tmp/gpu-check --budget 520 (its data
#    and checkpoints stay in /tmp/gpu-check; 520 s leaves the 600 s call room for steps 1, 2 and 4: 3 s,
#    16-26 s and a few s on 2026-11-26);
# 4. packs the results (tables, json, profiles, logs, the e2e image; no data, no checkpoints) into
#    $OUT/STEM.tgz, and copies the table to $OUT/STEM.md (STEM: gpu-check-runRUN, or gpu-check-PRESET:
#    gpu_check's names). This also happens when
#    gpu_check fails or the call is stopped (SIGTERM), and every 60 s meanwhile, so a call killed
#    outright still returns what was packed last.
# A later run that times run 1's best variant at 512 px reads /tmp/gpu-check/gpu-check-run1.json: on a
# fresh machine, unpack run 1's tgz into runs/gpu-check/ here and carry runs/gpu-check/gpu-check-run1.json
# too; it is copied there.
# Exit status: gpu_check's; 2 when the wheels are missing or do not install, 3 when the preflight fails.
# Overrides (environment): GPU_CHECK_BUDGET (520), GPU_CHECK_OUT (/tmp/gpu-check), KIT_WHEELS (REPO/.whl),
# KIT_SITE (/tmp/site), PY (python3); OUT defaults to the tool's.
set -u -o pipefail

RUN=${1:-1}
if [[ "$RUN" =~ ^[0-9]+$ ]]; then
  CHECK=(--run "$RUN") STEM=gpu-check-run$RUN
else # a preset (bench/gpu/gpu_check.py TARGETS)
  CHECK=(--preset "$RUN") STEM=gpu-check-$RUN
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
PY=${PY:-python3}
WHEELS=${KIT_WHEELS:-$REPO/.whl}
SITE=${KIT_SITE:-/tmp/site}
RESULTS=${GPU_CHECK_OUT:-/tmp/gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-520}
: "${OUT:?OUT is unset: run this as the device tool command (it sets OUT), or set OUT=a folder}"
mkdir -p "$RESULTS" "$OUT" || exit 2
LOG=$RESULTS/session-run$RUN.log
TGZ=$OUT/$STEM.tgz

# What `make gpu-check` exports (Makefile), and unbuffered output for the tool's output_tail.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

trap '' PIPE # a killed `tee` must not take this script down before it packs
exec > >(tee -a "$LOG") 2>&1

pack() { # the results, not the data (latents*/) or checkpoints (*.pt, pipeline/), into $TGZ
  (cd "$RESULTS" && find . -maxdepth 2 -type f -size -8M ! -path './latents*' ! -path './pipeline/*' \
    \( -name '*.md' -o -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.png' \) -print0 |
    tar -czf "$TGZ.part" --null -T -) && mv -f "$TGZ.part" "$TGZ"
  if [ -f "$RESULTS/$STEM.md" ]; then cp -f "$RESULTS/$STEM.md" "$OUT/"; fi
}

child="" packer=""
finish() {
  local status=$?
  trap - EXIT TERM INT HUP
  if [ -n "$packer" ]; then kill "$packer" 2>/dev/null; fi
  pack
  echo "gpu_session: exit $status; in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  exit "$status"
}
stopped() {
  echo "gpu_session: stopped by a signal: stopping gpu_check, packing what it wrote"
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null # its handler kills the job in flight (bench/gpu/gpu_runs.py run_group)
    for _ in $(seq 40); do kill -0 "$child" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$child" 2>/dev/null
  fi
  exit 143
}
trap finish EXIT
trap stopped TERM INT HUP

echo "gpu_session: run $RUN, $(date -u +%FT%TZ), results in $RESULTS, budget ${BUDGET} s"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "gpu_session: no wheels in $WHEELS: run '.venv/bin/python bench/gpu/device_wheels.py' on the development machine and carry .whl"
  exit 2
fi
stamp=$(printf '%s\n' "${wheels[@]##*/}" | sha256sum | cut -c1-16)
if [ "$(cat "$SITE/.kit-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "gpu_session: the ${#wheels[@]} wheels are already in $SITE (a warm machine)"
else
  began=$SECONDS
  mkdir -p "$SITE" || exit 2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${wheels[@]}" || { echo "gpu_session: installing the wheels into $SITE failed"; exit 2; }
  echo "$stamp" >"$SITE/.kit-stamp"
  echo "gpu_session: installed ${#wheels[@]} wheels into $SITE in $((SECONDS - began)) s"
fi
export PYTHONPATH=$SITE:$REPO

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
KIT_SITE=$SITE timeout 180 "$PY" - <<'PREFLIGHT'
import importlib.metadata as md
import os
import sys
import time

start, site = time.monotonic(), os.path.realpath(os.environ["KIT_SITE"])
import torch
import torch._dynamo
from torch.optim.adamw import adamw  # noqa: F401 (extensions/master_weights.py)

recompile_limit = torch._dynamo.config.recompile_limit  # compat/torch.py raises it
import composer
import diffusers
import huggingface_hub
import hydra
import omegaconf
import peft
import streaming
import tokenizers
import torchmetrics
import transformers
from composer.cli import launcher  # noqa: F401 (gpu_check's `composer -n`)
from diffusers import StableDiffusionPipeline  # noqa: F401 (bench/gpu/gpu_e2e.py)

import bench.gpu.gpu_check  # noqa: F401
import bench.throughput  # noqa: F401
import extensions.ema  # noqa: F401
import models.export  # noqa: F401
import recipes.plan  # noqa: F401
import train  # noqa: F401
from models.components import build_components  # noqa: F401
from models.engine.tokenizer import default_bpe

carried = (composer, diffusers, huggingface_hub, hydra, omegaconf, peft, streaming, tokenizers, torchmetrics,
           transformers)  # fmt: skip
elsewhere = [f"{m.__name__} ({m.__file__})" for m in carried if not os.path.realpath(m.__file__).startswith(site)]
names = ["mosaicml", "mosaicml-streaming", "diffusers", "transformers", "tokenizers", "huggingface_hub",
         "torchmetrics", "hydra-core", "omegaconf", "peft", "numpy", "pillow", "packaging", "rich"]  # fmt: skip
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      + ", ".join(f"{n} {md.version(n)}" for n in names) + f"; recompile_limit {recompile_limit}")  # fmt: skip
try:  # the carried wheels' declared ranges against what imports here (informational)
    from packaging.requirements import Requirement

    absent, outside = set(), []
    for dist in md.distributions(path=[site]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                absent.add(req.name)
                continue
            if not req.specifier.contains(have, prereleases=True):
                outside.append(f"{dist.metadata['Name']} needs {req}, has {have}")
    print("declared, not installed (bench/gpu/device_wheels.py LEFT_OUT):", ", ".join(sorted(absent)) or "none")
    print("declared range not met:", "; ".join(outside) or "none")
except Exception as err:  # noqa: BLE001 - only a report
    print(f"(range check skipped: {err})")
problems = [f"not imported from {site}: {', '.join(elsewhere)}"] * bool(elsewhere)
problems += [f"no CLIP BPE vocabulary at {default_bpe()}"] * (not default_bpe().exists())
if not torch.cuda.is_available():
    problems.append("torch.cuda.is_available() is False")
else:
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
print(f"preflight {'FAILED: ' + '; '.join(problems) if problems else 'ok'} ({time.monotonic() - start:.1f} s)")
sys.exit(1 if problems else 0)
PREFLIGHT
preflight=$?
if [ $preflight -ne 0 ]; then
  echo "gpu_session: PREFLIGHT FAILED (exit $preflight, above): nothing measured; fix the kit (bench/gpu/device_wheels.py)"
  exit 3
fi

seed=$REPO/runs/gpu-check/gpu-check-run1.json
if [ "${CHECK[0]}" = --run ] && [ "$RUN" != 1 ] && [ ! -e "$RESULTS/gpu-check-run1.json" ] && [ -f "$seed" ]; then
  cp "$seed" "$RESULTS/" && echo "gpu_session: run 1's results from $seed (for its best variant at 512 px)"
fi
(
  trap 'kill $s 2>/dev/null; exit 0' TERM
  while :; do
    sleep 60 &
    s=$!
    wait $s
    pack
  done
) >/dev/null 2>&1 &
packer=$!

"$PY" bench/gpu/gpu_check.py "${CHECK[@]}" --out "$RESULTS" --budget "$BUDGET" &
child=$!
wait "$child"
