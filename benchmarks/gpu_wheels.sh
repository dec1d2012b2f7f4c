#!/usr/bin/env bash
# Prepares what benchmarks/bench_train_gpu.py needs on the GPU machine, which has no internet (../shared/NOTES.md:
# torch 2.11+cu130, transformers 5.17, triton; no orjson, no flash-attn): run it here, where pip reaches PyPI.
#   .whl/       wheels it lacks (transformers 5.23.0 as tested here, orjson; liger-kernel for `liger: true`; TRL and
#               datasets with their two missing needs, dill and multiprocess, for the TRL baseline, bench_trl.py;
#               peft 0.21.2 as tested here, for bench_long_rows' --lora, over the image's own peft)
#   .fixtures/  the fixture files the benchmark packs its data from (a copy of part of ../shared/fixtures)
# Both are ignored by git; name them in the device call's `carry`, then run `bash scripts/gpu_check.sh $OUT` there
# (BENCHMARKS.md has the exact call).
# Extra arguments are more NAME==VERSION requirements to download.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FIXTURES=${FIXTURES:-../shared/fixtures}

mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    transformers==5.23.0 orjson==3.13.0 liger-kernel==0.8.5 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
    multiprocess==0.70.19 peft==0.21.2 "$@"

mkdir -p .fixtures/data .fixtures/tokenizers
for name in gsm8k_train.jsonl skyt1_math500_longcot.messages.jsonl fastchat_dummy_conversation.json \
            llamafactory_glaive_toolcall_en_demo.json llamafactory_reason_tool_use_demo_50.jsonl; do
    cp "$FIXTURES/data/$name" .fixtures/data/
done
cp -r "$FIXTURES/tokenizers/qwen2_5_instruct" "$FIXTURES/tokenizers/qwen3" .fixtures/tokenizers/  # qwen3: stepwise trees
chmod -R u+w .fixtures
du -sh .whl .fixtures
