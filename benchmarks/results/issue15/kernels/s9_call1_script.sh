#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
L=/tmp/logs1; mkdir -p $L /tmp/tc; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/env.txt
git log --oneline -1 >> $L/env.txt; git diff --stat >> $L/env.txt
[ -n "$(ls /tmp/tc)" ] || (cat .tc/tc.tar.xz.* | xz -d | tar -x -C /tmp)
timeout 100 python3 benchmarks/kernels.py --no-fla --no-jnp --skip-checks --stages --out $L/new > $L/new.log 2>&1
echo "new rc $?" >> $L/env.txt
mkdir -p /tmp/newk; cp pallas_kernels/{grads,intra,_common}.py /tmp/newk/; cp .dev/old/*.py pallas_kernels/
timeout 100 python3 benchmarks/kernels.py --no-fla --no-jnp --skip-checks --stages --out $L/old > $L/old.log 2>&1
echo "old rc $?" >> $L/env.txt
cp /tmp/newk/*.py pallas_kernels/
tar czf $OUT/logs.tgz -C /tmp logs1
export TRITON_CACHE_AUTOTUNING=1
timeout 60 python3 benchmarks/kernels.py --no-pallas --no-jnp --skip-checks --triton-cache /tmp/tc --out $L/fla > $L/fla.log 2>&1
echo "fla rc $?" >> $L/env.txt
tar czf $OUT/logs.tgz -C /tmp logs1
timeout 220 python3 benchmarks/kernels.py --check-only --no-fla --no-jnp --out $L/checks > $L/checks.log 2>&1
echo "checks rc $?" >> $L/env.txt
tar czf $OUT/logs.tgz -C /tmp logs1
