#!/usr/bin/env bash
# Load-test `kiln serve` with guidellm (https://github.com/vllm-project/guidellm), the load generator
# used on vLLM. This is optional: guidellm is not a kiln dependency.
#
#   benchmarks/guidellm.sh MODEL_DIR [OUT_DIR]          # OUT_DIR defaults to build/guidellm
#
# Starts `kiln serve MODEL_DIR` and waits for /health. Then it runs `guidellm run` with its default
# backend: openai_http, streaming /v1/chat/completions with stream_options.include_usage and
# continuous_usage_stats. The data is synthetic text, tokenized with MODEL_DIR's tokenizer. The run is
# one concurrency level after another. It writes OUT_DIR/benchmarks.json, console.txt (guidellm's
# tables) and server.log, and stops the server on exit. Settings (environment variables):
#   GUIDELLM=guidellm      the guidellm executable (0.8+, which has `guidellm run`)
#   PORT=8123  ARTIFACT=auto (auto: compile if absent, else load it; eager: no artifact)
#   STREAMS=1,2,4          concurrency levels (concurrent profile; 1 is synchronous)
#   DURATION=25            seconds per level
#   PROMPT_TOKENS=64 OUTPUT_TOKENS=32
#   HEALTH_TIMEOUT=900     seconds to wait for /health (a first compile takes minutes)
#   KILN_ARGS=             extra `kiln serve` options, e.g. "--max-num-seqs 8"
set -euo pipefail

model_dir=${1:?usage: benchmarks/guidellm.sh MODEL_DIR [OUT_DIR]}
out=${2:-build/guidellm}
GUIDELLM=${GUIDELLM:-guidellm} PORT=${PORT:-8123} ARTIFACT=${ARTIFACT:-auto} STREAMS=${STREAMS:-1,2,4}
DURATION=${DURATION:-25} PROMPT_TOKENS=${PROMPT_TOKENS:-64} OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-900}

# guidellm pulls in torch. Install it into a venv that reuses this environment's torch so pip
# does not download a CUDA build of torch.
if ! command -v "$GUIDELLM" >/dev/null; then
    torch_version=$(python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo VERSION)
    cat >&2 <<EOF
error: guidellm not found ('$GUIDELLM'). Install it in its own venv, reusing the installed torch:
    python -m venv --system-site-packages /tmp/glenv
    /tmp/glenv/bin/pip install guidellm -c <(echo torch==$torch_version)
then run:  GUIDELLM=/tmp/glenv/bin/guidellm $0 $*
EOF
    exit 1
fi

mkdir -p "$out"
base=http://127.0.0.1:$PORT
# shellcheck disable=SC2086  # KILN_ARGS is a list of options
"${PYTHON:-python}" -m kiln -v serve "$model_dir" --port "$PORT" --served-model-name bench --artifact "$ARTIFACT" \
    ${KILN_ARGS:-} >"$out/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT

start=$SECONDS
until curl -sf -o /dev/null "$base/health"; do
    kill -0 "$server" 2>/dev/null || { echo "error: kiln serve exited; see $out/server.log" >&2; exit 1; }
    ((SECONDS - start < HEALTH_TIMEOUT)) || { echo "error: no /health after ${HEALTH_TIMEOUT}s" >&2; exit 1; }
    sleep 1
done
echo "kiln serve ready in $((SECONDS - start))s ($base, artifact=$ARTIFACT)"

# The tokenizer is MODEL_DIR's own (tokenizer.json + tokenizer_config.json, loaded with AutoTokenizer),
# so guidellm sizes its synthetic prompts in the model's tokens and downloads nothing.
"$GUIDELLM" run --disable-progress \
    --backend "kind=openai_http,target=$base,model=bench" \
    --tokenizer "kind=huggingface_auto,model=$model_dir" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --profile kind=concurrent --override profile.streams "$STREAMS" \
    --constraint "kind=max_duration,seconds=$DURATION" \
    --output "kind=json,path=$out/benchmarks.json" \
    2>&1 | tee "$out/console.txt"
echo "wrote $out/benchmarks.json, $out/console.txt and $out/server.log"
