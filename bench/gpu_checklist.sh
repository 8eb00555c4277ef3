#!/usr/bin/env bash
# The GPU checklist (docs/gpu.md) as one script, for a lent machine with one GPU
# and no package registry: install, doctor, exactness on the GPU, the cost model against a
# real-size block, calibrate, the emulated cluster with a core per rank, and the tests on the
# machine's own torch. Every step is bounded and logged; a failing step does not stop the
# rest. Needs the wheels the machine lacks in .whl/ (diffusers, simpy, importlib_metadata,
# lazy-importer: docs/gpu.md says how to fetch them).
#
#   OUT=/tmp/out LIMIT=540 bash bench/gpu_checklist.sh
#
# Writes $OUT/log.txt and $OUT/results.tar.gz (every JSON, latents comparison, TOML).
# First run: docs/gpu.md (2026-11-26, H100, torch 2.11.0+cu130).
set -u
OUT=${OUT:-/tmp/gpu-checklist}
LIMIT=${LIMIT:-540}
RES=/tmp/gpu-results
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$SECONDS
left() { echo $((LIMIT - (SECONDS - start))); }
step() { echo; echo "=== [$((SECONDS - start)) s] $*"; }
bounded() {  # bounded SECONDS COMMAND...: at most SECONDS, and never past LIMIT
  local limit=$1; shift
  local remaining; remaining=$(($(left) - 15))
  if ((remaining < 20)); then echo "skipped (time): $*"; return 124; fi
  ((limit > remaining)) && limit=$remaining
  timeout --kill-after 5 "$limit" "$@"; local rc=$?
  echo "--- rc=$rc"
  return $rc
}
# OMP_NUM_THREADS set: torchrun prints no banner (and sets 1 per rank anyway).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1

step "machine"
nvidia-smi -L; nproc; free -g | head -2; python3 --version

step "install: the declared ranges (pyproject.toml) against what the image has"
python3 - <<'EOF2'
import tomllib
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for text in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    req = Requirement(text)
    if req.marker and not req.marker.evaluate():
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        have = None
    verdict = "missing" if have is None else "ok" if req.specifier.contains(have, prereleases=True) else "REFUSED"
    print(f"  {text:28} image: {have or '-':14} {verdict}")
EOF2
step "install: the wheels the image lacks, beside the image's torch; cocodiff from this tree"
# Into the image's own Python (the machine is thrown away after): the tests' subprocesses
# set PYTHONPATH to the repository alone, so a --target directory would be lost to them.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
export PYTHONPATH=$PWD
python3 - <<'EOF2'
import diffusers, simpy, torch, cocodiff
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "| diffusers", diffusers.__version__, "| simpy", simpy.__version__)
EOF2

step "doctor: 1 rank"
bounded 60 python3 -m cocodiff doctor --json $RES/doctor1.json
step "doctor: 2 ranks on the one GPU"
bounded 90 torchrun --standalone --nproc-per-node 2 -m cocodiff doctor --json $RES/doctor2.json
step "nccl itself with 2 ranks on one GPU (what the runtime steps around)"
cat > /tmp/nccl2.py <<'EOF'
import os, torch, torch.distributed as dist
rank = os.environ["RANK"]
try:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("rank", rank, "nccl all_reduce ok:", x[0].item())
    dist.destroy_process_group()
except Exception as e:
    print("rank", rank, "nccl refused:", type(e).__name__, str(e).strip().splitlines()[0][:300])
EOF
bounded 60 torchrun --standalone --nproc-per-node 2 /tmp/nccl2.py

step "exactness: tiny-flux, 4 steps, GPU 1 rank vs 2 and 4 ranks (tapa, vfirst, cocodiff), float32 and bfloat16"
run1() { local name=$1; shift; python3 -m cocodiff run --model tiny-flux --quiet --timeout 120 \
  --save-latents $RES/$name.pt --json $RES/$name.json "$@" > $RES/$name.log 2>&1; echo "$name rc=$?"; }
runN() { local name=$1 n=$2; shift 2; torchrun --standalone --nproc-per-node $n -m cocodiff run \
  --model tiny-flux --quiet --timeout 120 --save-latents $RES/$name.pt --json $RES/$name.json "$@" \
  > $RES/$name.log 2>&1; echo "$name rc=$?"; }
export -f run1 runN; export RES
bounded 240 bash -c '
run1 g1_f32 & run1 g1_bf16 --dtype bfloat16 & CUDA_VISIBLE_DEVICES= run1 c1_f32 &
CUDA_VISIBLE_DEVICES= run1 c1_bf16 --dtype bfloat16 &
runN g2_tapa_f32 2 --schedule tapa & runN g2_tapa_bf16 2 --schedule tapa --dtype bfloat16 &
runN g4_tapa_f32 4 --schedule tapa --grid 2x2x1 & wait
runN g4_vfirst_f32 4 --schedule vfirst --grid 2x2x1 &
runN g4_tapa_bf16 4 --schedule tapa --grid 2x2x1 --dtype bfloat16 &
runN g4_cocodiff_f32 4 --schedule cocodiff --grid 2x2x1 --reference & wait'
for f in $RES/*.log; do echo "--- $(basename $f)"; grep -v "^W[0-9]" "$f" | tail -4; done
python3 - <<'EOF'
import json, os, torch
res = os.environ["RES"]
def load(name):
    path = f"{res}/{name}.pt"
    return torch.load(path, map_location="cpu").float() if os.path.exists(path) else None
pairs = [("g2_tapa_f32", "g1_f32"), ("g4_tapa_f32", "g1_f32"), ("g4_vfirst_f32", "g1_f32"),
         ("g2_tapa_bf16", "g1_bf16"), ("g4_tapa_bf16", "g1_bf16"), ("g1_f32", "c1_f32"),
         ("g1_bf16", "c1_bf16"), ("g1_bf16", "g1_f32"), ("c1_bf16", "c1_f32")]
out = {}
for run, ref in pairs:
    a, b = load(run), load(ref)
    if a is None or b is None:
        out[f"{run} vs {ref}"] = "missing"; continue
    try:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6); close = True
    except AssertionError:
        close = False
    out[f"{run} vs {ref}"] = {"max_abs": (a - b).abs().max().item(),
                              "ref_max_abs": b.abs().max().item(),
                              "assert_close_rtol1e-5_atol1e-6": close}
for name in ("g4_cocodiff_f32",):
    path = f"{res}/{name}.json"
    if os.path.exists(path):
        out[name] = json.load(open(path)).get("quality")
print(json.dumps(out, indent=1))
json.dump(out, open(f"{res}/exactness.json", "w"), indent=1)
EOF

step "cost model against real FLUX.1-dev blocks (hidden 3072), bfloat16"
bounded 120 python3 bench/device_block.py --model flux1-dev --resolution 1024 --world 1 --json $RES/block_1024_w1.json
bounded 90 python3 bench/device_block.py --model flux1-dev --resolution 1024 --world 4 --json $RES/block_1024_w4.json
bounded 90 python3 bench/device_block.py --model flux1-dev --resolution 512 --world 1 --json $RES/block_512_w1.json

step "cocodiff calibrate --quick on this machine (self-launched 2 x 2 ranks)"
bounded 120 python3 -m cocodiff calibrate --quick --output $RES/calibrated.toml --json $RES/calibrate.json

step "emulated cluster, a core per rank, GPU hidden (the 2-core machine's configurations)"
if command -v ip >/dev/null && command -v tc >/dev/null; then
  for config in 4x2@5 2x4@5; do
    CUDA_VISIBLE_DEVICES= bounded 180 python3 bench/emulated_speedup.py --configs $config \
      --max-repeats 3 --json $RES/emulated_${config/@/_}.json
  done
else
  echo "no ip/tc here: emulated cluster skipped"
fi

step "the tests on this machine's torch, GPU hidden (not slow, not multi-process)"
CUDA_VISIBLE_DEVICES= bounded 240 python3 -m pytest -q -n 12 -p no:cacheprovider \
  -m "not slow and not multiprocess" tests 2>&1 | tail -25

step "done"
tar -czf "$OUT/results.tar.gz" -C $RES .
ls -la "$OUT"
