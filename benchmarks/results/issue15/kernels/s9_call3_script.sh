#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
L=/tmp/logs3; mkdir -p $L /tmp/tc; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/env.txt
git log --oneline -1 >> $L/env.txt; git diff --stat >> $L/env.txt
[ -n "$(ls /tmp/tc)" ] || (cat .tc/tc.tar.xz.* | xz -d | tar -x -C /tmp)
export TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
timeout 540 env -u OUT python3 -m benchmarks.train_gla340m --runs ours:16384,fla:16384 --steps 15 --warmup 3 \
  --run_timeout 430 --outdir $L/model --tag h200_s9 > $L/model.log 2>&1
echo "model rc $?" >> $L/env.txt
tar czf $OUT/logs.tgz -C /tmp logs3
(cd /tmp && tar cf - tc | xz -1 -T8 | split -b 15M - $OUT/tc.tar.xz.)
ls -la $OUT >> $L/env.txt
n=$(ls $OUT/tc.tar.xz.* | wc -l); [ $n -le 7 ] || rm $OUT/tc.tar.xz.*
tar czf $OUT/logs.tgz -C /tmp logs3
