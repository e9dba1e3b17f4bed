#!/usr/bin/env bash
# GPU bring-up on one CUDA GPU (an H200) with the machine's own torch, no SGLang; about 8 minutes:
#   1. three DAPO steps of train.py on the Qwen2.5-0.5B shape: torch engine, bf16, torch.compile,
#      FlexAttention (attention_backend "auto" on CUDA), with torch.cuda.max_memory_allocated / reserved;
#   2. the rehearsal of that same run (train.py --rehearse, 1 rank x the GPU's memory): its predicted
#      per-phase peak beside the measured one;
#   3. the MFU table of the update step (bench/train_mfu.py, 0.5B shape).
#
#   bash bench/gpu_bringup.sh [OUT_DIR]      # OUT_DIR default: a temporary folder; everything lands there
#
# Each part has its own time limit, so a part that hangs cannot take the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-$(mktemp -d /tmp/gpu_bringup.XXXX)}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
echo "bring-up into $OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name(), round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1), 'GB')" \
  || exit 2
GPU_GB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)")

# The run of part 1, as train.py overrides (the same as bench/dapo_gpu_steps.py).
RUN=(--config configs/demo_cpu.toml --job.run_dir="$OUT/runs" --job.name=gpu --model.preset=qwen2.5-0.5b
     --model.dtype=float32 --data.synthetic_num_train=2048 --data.synthetic_num_eval=16 --data.max_prompt_length=128
     --rollout.engine=torch --rollout.n=16 --rollout.max_response_length=512 --rollout.dtype=bfloat16
     --rollout.compile=true --rollout.max_batch_size=512 --algorithm.overlong_buffer=128
     --algorithm.overlong_filter=false --training.steps=3 --training.train_batch_size=32
     --training.mini_batch_size=8 --training.micro_batch_tokens=16384 --training.sft_warmup_steps=0
     --parallelism.param_dtype=bfloat16 --parallelism.compile=true --eval.at_start=false --eval.at_end=false
     --eval.interval=0 --checkpoint.enabled=false --checkpoint.export_hf=false
     --metrics.progress=false)

echo "== 1. three DAPO steps (0.5B, torch engine, bf16, compile, FlexAttention)"
timeout 300 "$PY" - "$OUT/measured.json" "${RUN[@]}" <<'EOF' 2>&1 | tail -n 20
import json, sys
import torch
import train, trainer.scoring
from tests.planted_train import planted_score

trainer.scoring.compute_score = planted_score  # half the random responses count as correct: every group trains
out, argv = sys.argv[1], sys.argv[2:]
torch.cuda.reset_peak_memory_stats()
status = train.main(argv)
measured = {"status": status, "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "max_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}
json.dump(measured, open(out, "w"))
print(json.dumps(measured))
EOF
tail -n 3 "$OUT/runs/gpu/metrics.jsonl" 2>/dev/null | cut -c1-400

echo "== 2. the rehearsal of the same run (1 rank x ${GPU_GB} GB)"
timeout 120 "$PY" train.py "${RUN[@]}" --rehearse --rehearse.world_size=1 --rehearse.gpu_memory_gb="$GPU_GB" \
  > "$OUT/rehearsal.txt" 2>&1
cat "$OUT/rehearsal.txt" | grep -v '^{'
"$PY" - "$OUT/rehearsal.txt" "$OUT/measured.json" <<'EOF'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('{"rehearsal"')]
try:
    measured = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    measured = {}
if not lines:
    sys.exit("the rehearsal printed no JSON line")
phases = json.loads(lines[-1])["rehearsal"]["phases"]
# The torch engine lives in the trainer's process: its memory is part of what torch.cuda measures.
allocated = max(sum(p["trainer_gb"].values()) + p["engine_gb"] for p in phases)
reserved = max(p["total_gb"] - p["context_gb"] for p in phases)
print(f"{'':24}{'predicted':>12}{'measured':>12}")
print(f"{'max allocated (GB)':24}{allocated:>12.2f}{measured.get('max_allocated_gb', float('nan')):>12.2f}")
print(f"{'max reserved (GB)':24}{reserved:>12.2f}{measured.get('max_reserved_gb', float('nan')):>12.2f}")
print(json.dumps({"bench": "gpu_bringup", "predicted_allocated_gb": allocated, "predicted_reserved_gb": reserved,
                  **{f"measured_{k}": v for k, v in measured.items()}}))
EOF

echo "== 3. MFU of the update step (0.5B shape)"
timeout 240 "$PY" bench/train_mfu.py --shapes qwen2.5-0.5b 2>&1 | tail -n 12
echo "bring-up done: $OUT"
