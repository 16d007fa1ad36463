#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
L=/tmp/logs6; mkdir -p $L /tmp/tc; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $L/env.txt
[ -n "$(ls /tmp/tc)" ] || (cat .tc/tc.tar.xz.* | xz -d | tar -x -C /tmp)
F='"fold_grad_walk":true'
timeout 100 python3 benchmarks/kernels.py --no-fla --no-jnp --skip-checks --stages --out $L/new \
  --tune "[{$F},{}]" > $L/new.log 2>&1
echo "new rc $?" >> $L/env.txt
cp pallas_kernels/grads.py /tmp/grads_new.py; cp .dev/grads_old.py pallas_kernels/grads.py
timeout 60 python3 benchmarks/kernels.py --no-fla --no-jnp --skip-checks --out $L/old \
  --tune "[{$F}]" > $L/old.log 2>&1
echo "old rc $?" >> $L/env.txt
cp /tmp/grads_new.py pallas_kernels/grads.py
tar czf $OUT/logs.tgz -C /tmp logs6
export TRITON_CACHE_AUTOTUNING=1
timeout 60 python3 benchmarks/kernels.py --no-pallas --no-jnp --skip-checks --triton-cache /tmp/tc \
  --out $L/fla > $L/fla.log 2>&1
echo "fla rc $?" >> $L/env.txt
tar czf $OUT/logs.tgz -C /tmp logs6
timeout 190 python3 benchmarks/kernels.py --check-only --no-fla --no-jnp --check-tune "[{$F}]" --out $L/checks > $L/checks.log 2>&1
echo "checks rc $?" >> $L/env.txt
tar czf $OUT/logs.tgz -C /tmp logs6
