#!/usr/bin/env bash
# A lent GPU machine's one command (docs/benchmarks.md, "A lent device"): the carried wheels
# installed beside the image's own CUDA torch, then gpu_check's sections in the order of what they
# decide (FLUX.1-dev's speed, rent, seed), each configuration a JSON line appended to
# $OUT/gpu-check.jsonl as it ends; none starts past what fits in $SLICE_BUDGET_S (540) seconds, and
# a section still running then is killed (a device command's limit is 600).
#   bash benchmarks/gpu/slice.sh --wheels   # here, with a network: the wheels into .gpu-wheels/
#   bash benchmarks/gpu/slice.sh [--tiny]   # there (carry .gpu-wheels); --tiny: the CPU's rehearsal
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.gpu-wheels BUDGET=${SLICE_BUDGET_S:-540} PYTHON=${PYTHON:-python3} OUT=${OUT:-benchmarks/results/slice}
# diffserve's needs the device image lacks, as tested here; not torch (its own), nor av (videos' 40 MB)
NEEDS="diffusers==0.42.1 torchao==0.18.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4
pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0
pyzmq==27.3.0 orjson==3.13.0 msgspec==0.22.0 setproctitle==1.3.8 python-multipart==0.0.34 ftfy==6.3.1
wcwidth==0.9.4 importlib-metadata==10.2.0"
if [[ ${1:-} == --wheels ]]; then  # shellcheck disable=SC2046,SC2086 # each a word
  exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $(printf -- '--platform manylinux_%s_x86_64 ' 2_28 2_27 2_17 2014 1) -d "$WHEELS" $NEEDS
fi
TINY=${1:-} status=0 LINES=$OUT/gpu-check.jsonl
mkdir -p "$OUT"
if [[ $TINY == --tiny || ! -d $WHEELS ]]; then
  echo "slice: no wheels installed (${TINY:-no $WHEELS/ here})"
else
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for section in speed:flux sizes:flux,qwen-image rent:qwen-image,wan,flux seed:qwen-image,flux,z-image; do
  name=${section%%:*} left=$((BUDGET - SECONDS)) code=0
  ((left >= 30)) || { echo "{\"section\": \"$name\", \"skipped\": \"$left s left\"}" | tee -a "$LINES"; continue; }
  timeout -k 5 "$left" "$PYTHON" benchmarks/gpu_check.py $TINY --only "$name" --families "${section#*:}" \
    --budget-s $((left - 15)) --jsonl "$LINES" --output-file "$OUT/$name.json" \
    ${TINY:+--torch-threads 1 --repeats 1} 2>&1 | tee -a "$OUT/slice.log" || code=$? status=$?
  ((code == 124 || code == 137)) && echo "slice: $name stopped at the budget's end (${BUDGET} s)"
done
echo "slice: $(wc -l <"$LINES") lines in $OUT/gpu-check.jsonl, ${SECONDS} s, status ${status}"
exit "$status"
