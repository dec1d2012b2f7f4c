#!/usr/bin/env bash
# second GPU call of 2026-11-27: what the first could not measure (self-check fix, test tolerances, TRL, 1.5B)
set -uo pipefail
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m benchmarks.bench_train_gpu --prepare /tmp/d --row-lengths 32768,131072 --fixtures .fixtures > $OUT/prepare.log 2>&1 &
timeout 60 python3 -m pytest tests/test_attention_features.py -m gpu -n 8 -p no:cacheprovider -rs -v --timeout 60 > $OUT/gpu_tests2.log 2>&1
tail -5 $OUT/gpu_tests2.log; grep -E "FAILED|relative error" $OUT/gpu_tests2.log | head -20
wait
echo "data ready at $(( $(date +%s) - t0 )) s"
python3 -m benchmarks.bench_train_gpu --packed /tmp/d/data_32768/packed --shapes qwen2.5-1.5b --row-lengths 32768 --backends torch_varlen --steps 5 --timeout 100 --out $OUT/train_15b_32k 2>&1 | tail -4
echo "1.5B done at $(( $(date +%s) - t0 )) s"
python3 -m benchmarks.bench_trl --packed /tmp/d/data_32768/packed --shape qwen2.5-0.5b --tokenizer .fixtures/tokenizers/qwen2_5_instruct --attn flex_attention --steps 5 --timeout 130 --deadline $(( t0 + 255 )) --gradient-checkpointing false --out $OUT/trl 2>&1 | tail -4
echo "trl done at $(( $(date +%s) - t0 )) s"
python3 -m benchmarks.bench_train_gpu --packed /tmp/d/data_131072/packed --shapes qwen2.5-1.5b --row-lengths 131072 --backends torch_varlen --steps 4 --timeout 100 --deadline $(( t0 + 262 )) --out $OUT/train_15b_128k 2>&1 | tail -3
echo "all done at $(( $(date +%s) - t0 )) s"
