#!/bin/bash
# The GPU runs behind benchmarks/results/gpu/ on one NVIDIA H200 or H100, after the kit of
# ../shared/gpu/README.md installed the stack (`source .gpucarry/install.sh`). Run from the project
# root: `bash benchmarks/gpu_h200.sh STEP...`, results under $OUT (default /var/tmp/tandem-gpu/out).
#
#   smollm2      SmolLM2-135M prepared from the carried GGUF (k=4 and the whole model)
#   prep-1b      a random-weight Llama-3.2-1B shape prepared at k=2,4,8 (k/L = 1/8, 1/4, 1/2) and whole
#   prep-tier    the Llama-3.2-1B shape at k=4 (no whole-model export) for the GPU tier's real-size test
#   tier         the GPU test tier (tests/gpu) on SmolLM2-135M, and the 1B shape of prep-tier (the test
#                prepares it itself where prep-tier has not); TIER_K selects tests (pytest's -k)
#   bench-1b     tandem-bench modes on the 1B shape: split k=4, cloud-only, edge-only (ONNX Runtime CUDA on
#                the same GPU), remote prefill, auto and auto-whole; loopback and wifi6; 64/256/1024/4096 tokens
#   capacity-1b  tandem-bench capacity on the 1B shape: cloud-only, split k=2,4,8, auto
#   prep-rp-1b   the 1B shape at k=4 with its whole model (what capacity-rp-1b and matrix-1b run on)
#   capacity-rp-1b  tandem-bench capacity on the 1B shape prepared at k=4 with its whole model: cloud-only,
#                split k=4, edge-only (ONNX Runtime CUDA on the same GPU), remote prefill and auto,
#                64 output tokens, TTFT and mean-ITL objectives
#   capacity-rp-smollm2  capacity-rp-1b's sweep on SmolLM2-135M (prepared from the carried GGUF: no export
#                first), the engines in bf16 (`dtype auto` on a GPU)
#   bench-8b     tandem-bench modes on a Llama-3.1-8B shape (split k=4 and cloud-only; no whole-model ONNX
#                export: 32 GB in fp32); its head is a float16-compute ONNX export (tandem-model
#                --onnx-dtype float16: what a GPU edge runs, half the disk of an fp32 head)
#   capacity-8b  tandem-bench capacity on the 8B shape: cloud-only, split k=4 (k/L = 1/8), auto
#   prep-8b-k8, capacity-8b-k8, prep-8b-k16, capacity-8b-k16
#                the same at k = 8 and 16 (k/L = 1/4, 1/2), one split layer prepared at a time: the
#                checkpoint with every tail beside it passes the host's 64 GiB disk, so preparing one
#                k removes the others' tails and heads first
#   fidelity     tandem-bench fidelity on SmolLM2 over all 200 chats, k = 4 and 8, every default pair and
#                remote prefill's downlink in every default KV format (its table's remote_prefill):
#                fp32 CUDA engines, the in-process tail and full model on the GPU; its edge row is the
#                bf16 builder graph smollm2 prepares ($SMOL/edge-decoder) on ONNX Runtime's CUDA provider
#   fidelity-bf16  the same in bf16 (--dtype bfloat16): the split's agreement with direct beside
#                direct's own bf16 run-to-run floor, and the edge row (the bf16 builder graph, as
#                local mode and remote prefill run it) against the bf16 engine
#   exactness    tandem-bench exactness on SmolLM2, fp32 CUDA engines: remote prefill, direct and
#                local over all 200 chats and 20 three-turn sessions; it resumes what an earlier
#                call on the same host finished (the host keeps /var/tmp while it stays up), so a
#                run cut by a call's time limit goes on in the next call
#   matrix-1b    tandem-bench modes on the 1B shape per output length (16/128/512 tokens), wifi6 and 4g,
#                64, 256 and 1024 prompt tokens: end to end and cloud engine time per mode (auto-whole: auto
#                minimising end-to-end time, as a client of whole replies asks), on the 1B
#                shape capacity-rp-1b prepares; MATRIX_LINKS=wifi6 (or 4g) runs one link per call
#   matrix-smollm2  the same matrix on SmolLM2-135M (prepared from the carried GGUF, nothing to
#                export first), the engines in bf16 (`dtype auto` on a GPU), both links in one call;
#                MATRIX_LINKS, MATRIX_PROMPT_LENS (default 64,256,1024) and MATRIX_OUTPUT_LENS (default
#                16,128,512) narrow it; MATRIX_REQUESTS requests per cell (default 3: one request's
#                end to end moves by 10-40% from run to run; on an H100 each request per cell adds about
#                2 min to the whole matrix, after the stack's 75 s start)
#   edge-decode  tandem-bench edge: the edge's runtimes at batch 1 (tandem's DecoderGraph on the builder's
#                fp16 graph with and without a CUDA graph, ONNX Runtime GenAI's Generator on the same graph,
#                the torch.onnx edge-full.onnx on SmolLM2) and the weights-read floor, on SmolLM2-135M and
#                the Llama-3.2-1B shape, then 1, 4 and 16 turns decoding together (LocalEngine's batched
#                steps, one CUDA graph per batch size, against the Generator at that batch size);
#                EDGE_VLLM=1 adds vLLM single-stream; EDGE_MODELS="smollm2 l1b" (default) picks the models
#                among smollm2, l1b, l3b (Llama-3.2-3B shape) and l8b (Llama-3.1-8B shape)
#   graphs-smollm2  tandem-bench modes on SmolLM2, loopback, 256 prompt and 128 output tokens, every mode:
#                eager engines, then the GPU defaults (CUDA graphs and torch.compile), each start timed
# The capacity runs use the unshaped loopback: one proxy would be one link shared by every request,
# where the deployment measured gives each edge client its own.
#
# Python runs from outside the project root: its tandem/ folder (the SDK alone) would shadow the
# installed package. The engines run with the GPU defaults, CUDA graphs and torch.compile
# (TANDEM_CLOUD_ENGINE__ENFORCE_EAGER=true for eager engines): on a fresh host the SmolLM2 stack
# started in 93 s with compilation against 77 s eager, and decode steps ran 9x faster
# (graphs-smollm2; larger shapes compile longer). The h200- results under benchmarks/results/gpu/
# other than h200-graphs-smollm2/eager-false ran eager; the h100- ones at the defaults.
set -uo pipefail
ROOT=$(pwd)
W=/var/tmp/tandem-gpu
OUT=${OUT:-$W/out}
SMOL=$W/model
mkdir -p "$OUT" "$W"
export TANDEM_CLOUD_ENGINE__ENFORCE_EAGER=${TANDEM_CLOUD_ENGINE__ENFORCE_EAGER:-false}
export TANDEM_CLOUD_ENGINE__MAX_MODEL_LEN_TOKENS=8192
export TANDEM_CLOUD_ENGINE__MAX_NUM_BATCHED_TOKENS=8192
export TANDEM_CLOUD_ENGINE__MAX_NUM_SEQS=32
export TANDEM_CLOUD_ENGINE__TAIL_GPU_MEMORY_UTILIZATION=0.25
export TANDEM_CLOUD_ENGINE__DECODE_GPU_MEMORY_UTILIZATION=0.45
# one edge stands for every client here: a 4096-token turn of the 8B shape holds 1.1 GB of KV and
# activations in the cloud, past the default 1 GiB bound per edge
export TANDEM_CLOUD_EDGE_MAX_STORED_BYTES=17179869184
# and its uploads in flight: a 1024-token split turn of the 8B shape at k = 16 reserves 144 MiB, so the
# default 256 MiB per edge admits one at a time and refuses the rest (RESOURCE_EXHAUSTED)
export TANDEM_CLOUD_MAX_UPLOAD_BYTES_PER_PEER=17179869184
export TANDEM_CLOUD_MAX_UPLOAD_BYTES=34359738368

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }

keep_logs() {  # keep_logs NAME: the daemons' logs of the runs so far, one archive (few files come back)
  local dirs
  dirs=$(ls -d /tmp/tandem-bench-* /tmp/tandem-capacity-* /tmp/tandem-exactness-* 2>/dev/null)
  [ -n "$dirs" ] || return 0
  tar czf "$OUT/logs-$1.tgz" --exclude='kv*' $dirs 2>/dev/null && rm -rf $dirs
}

smollm2() {
  if [ ! -f "$SMOL/split-k4/manifest.json" ] || [ ! -f "$SMOL/edge-full.onnx" ] || [ ! -f "$SMOL/edge-decoder/tandem_build.json" ]; then
    log "prepare SmolLM2-135M (k=4, whole model, the builder's decoder, bf16 on a GPU)"
    (cd "$W" && tandem-model --out "$SMOL" --split-layers 4 --no-bundles) \
      > "$OUT/prepare_smollm2.log" 2>&1
  fi
}

realsize() {  # realsize SHAPE DIR SPLIT_LAYERS [tandem-model flags...]
  local shape=$1 dir=$2 ks=$3
  shift 3
  if [ ! -f "$dir/split-k${ks##*,}/manifest.json" ]; then
    log "random-weight $shape checkpoint"
    (cd "$W" && python -m tandem.benchmarks.realsize --shape "$shape" --out "$dir-ckpt" --tokenizer "$SMOL/hf") \
      > "$OUT/realsize_$shape.log" 2>&1
    log "tandem-model $shape k=$ks $*"
    (cd "$W" && tandem-model --checkpoint "$dir-ckpt" --out "$dir" --split-layers "$ks" \
      --no-bundles "$@") > "$OUT/prepare_$shape.log" 2>&1
    log "prepared $shape: $(du -sh "$dir" | cut -f1)"
  fi
}

step_prep_1b() {
  smollm2
  realsize llama-3.2-1b "$W/l1b" 2,4,8
}

step_prep_tier() {
  smollm2
  realsize llama-3.2-1b "$W/l1b-tier" 4 --no-edge-full
}

step_tier() {
  smollm2
  export TANDEM_GPU_REALSIZE_DIR=$W/l1b-tier
  rm -rf "$W/t" && mkdir -p "$W/t" && cp -r "$ROOT/tests" "$ROOT/pyproject.toml" "$W/t/"
  log "GPU test tier"
  (cd "$W/t" && TANDEM_MODEL_DIR=$SMOL python -m pytest -m gpu tests/gpu -v -p no:cacheprovider ${TIER_K:+-k "$TIER_K"}) \
    2>&1 | tee "$OUT/gpu_tier.log" | tail -25
}

step_bench_1b() {
  smollm2
  realsize llama-3.2-1b "$W/l1b" 2,4,8
  log "tandem-bench modes 1B"
  (cd "$W" && tandem-bench modes --model-dir "$W/l1b" --split-layers 4 --links loopback,wifi6 \
    --prompt-lens 64,256,1024,4096 --requests 3 --max-new-tokens 16 --shaper proxy --out "$OUT/bench-1b") \
    > "$OUT/bench-1b.log" 2>&1
  keep_logs bench-1b
  tail -40 "$OUT/bench-1b.log"
}

step_capacity_1b() {
  smollm2
  realsize llama-3.2-1b "$W/l1b" 2,4,8
  log "tandem-bench capacity 1B"
  # three tail engines (k = 2, 4, 8) and the decode engine share the GPU
  (cd "$W" && TANDEM_CLOUD_ENGINE__TAIL_GPU_MEMORY_UTILIZATION=0.12 tandem-bench capacity --model-dir "$W/l1b" \
    --split-layers 2,4,8 --rates 8,16,32,64 --requests 64 --prompt-tokens 1024 --max-new-tokens 16 \
    --ttft-slo-ms 500 --link loopback --cloud-cpus "" --edge-cpus "" --max-num-seqs 32 --out "$OUT/capacity-1b") \
    > "$OUT/capacity-1b.log" 2>&1
  keep_logs capacity-1b
  tail -20 "$OUT/capacity-1b.log"
}

step_capacity_rp_1b() {
  smollm2
  realsize llama-3.2-1b "$W/l1b-rp" 4
  log "tandem-bench capacity 1B, remote prefill and edge-only"
  (cd "$W" && tandem-bench capacity --model-dir "$W/l1b-rp" --split-layers 4 --rates 4,8 --requests 32 \
    --prompt-tokens 1024 --max-new-tokens 64 --ttft-slo-ms 500 --itl-slo-ms 50 --link loopback \
    --cloud-cpus "" --edge-cpus "" --max-num-seqs 32 --out "$OUT/capacity-rp-1b") > "$OUT/capacity-rp-1b.log" 2>&1
  keep_logs capacity-rp-1b
  tail -30 "$OUT/capacity-rp-1b.log"
}

step_capacity_rp_smollm2() {
  smollm2
  log "tandem-bench capacity SmolLM2, remote prefill and edge-only"
  (cd "$W" && tandem-bench capacity --model-dir "$SMOL" --split-layers 4 --rates 4,8 --requests 32 \
    --prompt-tokens 1024 --max-new-tokens 64 --ttft-slo-ms 500 --itl-slo-ms 50 --link loopback \
    --cloud-cpus "" --edge-cpus "" --max-num-seqs 32 --out "$OUT/capacity-rp-smollm2") > "$OUT/capacity-rp-smollm2.log" 2>&1
  keep_logs capacity-rp-smollm2
  tail -30 "$OUT/capacity-rp-smollm2.log"
}

prep_8b() {  # prep_8b [K]: the 8B shape split at K (default 4), the other split layers' files removed
  local k=${1:-4} d
  smollm2
  for d in "$W"/l8b/split-k*; do [ -d "$d" ] && [ "$d" != "$W/l8b/split-k$k" ] && rm -rf "$d"; done
  # the 8B shape takes about 33 GB (checkpoint, tail, float16 head): make room on a 64 GiB disk
  if [ "$(df --output=avail -B1G "$W" | tail -1)" -lt 45 ]; then rm -rf "$W/l1b" "$W/l1b-ckpt"; fi
  if [ -d "$W/l8b-ckpt" ] && [ ! -f "$W/l8b/split-k$k/manifest.json" ]; then  # the checkpoint is kept
    log "tandem-model llama-3.1-8b k=$k"
    (cd "$W" && tandem-model --checkpoint "$W/l8b-ckpt" --out "$W/l8b" --split-layers "$k" --no-bundles \
      --no-edge-full --onnx-dtype float16) >> "$OUT/prepare_llama-3.1-8b.log" 2>&1
  fi
  realsize llama-3.1-8b "$W/l8b" "$k" --no-edge-full --onnx-dtype float16
  log "8B split k=$k: $(du -sh "$W/l8b" | cut -f1), $(df -h --output=avail "$W" | tail -1) free"
}

step_bench_8b() {
  prep_8b
  log "tandem-bench modes 8B"
  (cd "$W" && tandem-bench modes --model-dir "$W/l8b" --split-layers 4 --links loopback,wifi6 \
    --prompt-lens 256,1024,4096 --requests 3 --max-new-tokens 16 --shaper proxy --no-edge-only \
    --no-remote-prefill --out "$OUT/bench-8b") > "$OUT/bench-8b.log" 2>&1
  keep_logs bench-8b
  tail -30 "$OUT/bench-8b.log"
}

step_capacity_8b() {  # step_capacity_8b [K]: results in capacity-8b (K = 4) or capacity-8b-kK
  local k=${1:-4} name=capacity-8b
  [ "$k" = 4 ] || name=capacity-8b-k$k
  prep_8b "$k"
  log "tandem-bench capacity 8B k=$k"
  (cd "$W" && tandem-bench capacity --model-dir "$W/l8b" --split-layers "$k" --rates 4,8,16,32 --requests 48 \
    --prompt-tokens 1024 --max-new-tokens 16 --ttft-slo-ms 500 --link loopback --cloud-cpus "" --edge-cpus "" \
    --max-num-seqs 32 --out "$OUT/$name") > "$OUT/$name.log" 2>&1
  keep_logs "$name"
  tail -20 "$OUT/$name.log"
}

step_fidelity() {  # step_fidelity DTYPE
  smollm2
  if [ ! -f "$SMOL/split-k8/manifest.json" ]; then
    (cd "$W" && tandem-model --out "$SMOL" --split-layers 4,8 --no-bundles) \
      >> "$OUT/prepare_smollm2.log" 2>&1
  fi
  log "tandem-bench fidelity $1"
  (cd "$W" && tandem-bench fidelity --model-dir "$SMOL" --split-layers 4,8 --dtype "$1" --device cuda \
    --edge-decoder "$SMOL/edge-decoder" --out "$OUT/fidelity-$1") > "$OUT/fidelity-$1.log" 2>&1
  tail -30 "$OUT/fidelity-$1.log"
}

step_exactness() {
  smollm2
  log "tandem-bench exactness (resumes $W/exactness)"
  (cd "$W" && tandem-bench exactness --model-dir "$SMOL" --resume --out "$W/exactness") > "$OUT/exactness.log" 2>&1
  cp "$W/exactness/exactness.md" "$W/exactness/exactness.json" "$OUT/" 2>/dev/null
  keep_logs exactness
  tail -15 "$OUT/exactness.log"
}

step_matrix_1b() {  # MATRIX_LINKS (default wifi6,4g): the link profiles, one call's time limit each if need be
  local links=${MATRIX_LINKS:-wifi6,4g} name
  name=matrix-1b-${links//,/-}
  smollm2
  realsize llama-3.2-1b "$W/l1b-rp" 4
  log "tandem-bench modes 1B output-length matrix, $links"
  (cd "$W" && tandem-bench modes --model-dir "$W/l1b-rp" --split-layers 4 --links "$links" --prompt-lens 64,256,1024 \
    --output-lens 16,128,512 --requests 1 --shaper proxy --out "$OUT/$name") > "$OUT/$name.log" 2>&1
  keep_logs "$name"
  tail -40 "$OUT/$name.log"
}

step_matrix_smollm2() {
  smollm2
  log "tandem-bench modes SmolLM2 output-length matrix"
  (cd "$W" && tandem-bench modes --model-dir "$SMOL" --split-layers 4 --links "${MATRIX_LINKS:-wifi6,4g}" \
    --prompt-lens "${MATRIX_PROMPT_LENS:-64,256,1024}" --output-lens "${MATRIX_OUTPUT_LENS:-16,128,512}" --requests "${MATRIX_REQUESTS:-3}" \
    --shaper proxy --out "$OUT/matrix-smollm2") > "$OUT/matrix-smollm2.log" 2>&1
  keep_logs matrix-smollm2
  tail -40 "$OUT/matrix-smollm2.log"
}

step_graphs_smollm2() {
  local eager t0
  smollm2
  for eager in true false; do
    log "tandem-bench modes SmolLM2, enforce_eager=$eager"
    t0=$(date +%s)
    (cd "$W" && TANDEM_CLOUD_ENGINE__ENFORCE_EAGER=$eager tandem-bench modes --model-dir "$SMOL" --split-layers 4 \
      --links loopback --prompt-lens 256 --output-lens 128 --requests 2 --out "$OUT/graphs-smollm2-eager-$eager") \
      > "$OUT/graphs-smollm2-eager-$eager.log" 2>&1
    log "enforce_eager=$eager: rc $?, $(( $(date +%s) - t0 )) s with the stack's start"
    keep_logs "graphs-smollm2-eager-$eager"
  done
}

edge_decode_shape() {  # edge_decode_shape SHAPE NAME: tandem-bench edge on a random-weight checkpoint of SHAPE
  local shape=$1 name=$2
  if [ ! -f "$W/$name-ckpt/config.json" ]; then
    (cd "$W" && python -m tandem.benchmarks.realsize --shape "$shape" --out "$W/$name-ckpt" --tokenizer "$SMOL/hf") \
      > "$OUT/realsize_$shape.log" 2>&1
  fi
  log "edge decode: $shape shape"
  (cd "$W" && tandem-bench edge --hf "$W/$name-ckpt" --out "$OUT/edge-$name" \
    --build-dir "$W/edge-build-$name" --name "$shape" --batch-sizes 1,4,16 "${vllm[@]}") 2>&1 \
    | tee "$OUT/edge_$name.log" | tail -16
}

step_edge_decode() {  # EDGE_MODELS (default "smollm2 l1b"; also l3b, l8b): the models, one call's time limit each if need be
  smollm2
  local vllm=() m
  [ "${EDGE_VLLM:-0}" = 1 ] && vllm=(--vllm)
  for m in ${EDGE_MODELS:-smollm2 l1b}; do
    case $m in
      smollm2)
        log "edge decode: SmolLM2-135M"
        (cd "$W" && tandem-bench edge --hf "$SMOL/hf" --out "$OUT/edge-smollm2" \
          --build-dir "$W/edge-build-smollm2" --legacy-onnx "$SMOL/edge-full.onnx" --name smollm2-135m \
          --batch-sizes 1,4,16 "${vllm[@]}") \
          2>&1 | tee "$OUT/edge_smollm2.log" | tail -16 ;;
      l1b) edge_decode_shape llama-3.2-1b l1b ;;
      l3b) edge_decode_shape llama-3.2-3b l3b ;;
      l8b) edge_decode_shape llama-3.1-8b l8b ;;
      *) log "unknown edge model $m (smollm2, l1b, l3b, l8b)"; return 1 ;;
    esac
  done
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
for s in "$@"; do
  case $s in
    smollm2) smollm2 ;;
    prep-1b) step_prep_1b ;;
    prep-tier) step_prep_tier ;;
    tier) step_tier ;;
    graphs-smollm2) step_graphs_smollm2 ;;
    edge-decode) step_edge_decode ;;
    capacity-1b) step_capacity_1b ;;
    prep-rp-1b) smollm2; realsize llama-3.2-1b "$W/l1b-rp" 4 ;;
    capacity-rp-1b) step_capacity_rp_1b ;;
    capacity-rp-smollm2) step_capacity_rp_smollm2 ;;
    bench-1b) step_bench_1b ;;
    bench-8b) step_bench_8b ;;
    capacity-8b) step_capacity_8b ;;
    prep-8b-k8) prep_8b 8 ;;
    capacity-8b-k8) step_capacity_8b 8 ;;
    prep-8b-k16) prep_8b 16 ;;
    capacity-8b-k16) step_capacity_8b 16 ;;
    fidelity) step_fidelity float32 ;;
    fidelity-bf16) step_fidelity bfloat16 ;;
    exactness) step_exactness ;;
    matrix-1b) step_matrix_1b ;;
    matrix-smollm2) step_matrix_smollm2 ;;
    *) echo "unknown step $s (smollm2 | edge-decode | prep-1b | prep-rp-1b | prep-tier | tier | graphs-smollm2 | bench-1b | capacity-1b | capacity-rp-1b | bench-8b | capacity-8b | prep-8b-k8 | capacity-8b-k8 | prep-8b-k16 | capacity-8b-k16 | fidelity | fidelity-bf16 | exactness | matrix-1b | matrix-smollm2)" >&2; exit 2 ;;
  esac
done
log "done: $*"
