#!/usr/bin/env bash
# One nvidia-h100-x4 lease's work, detached so that it runs on between the calls that watch it (a process in a new
# session outlives its call; the machine stays while calls keep coming). After the model is staged
# (/root/smollm2/model.gguf and its tokenizer files):
#   bash benchmarks/gpu_lease.sh start   # copies the tree to /root/frozen (later calls re-sync the working tree, so
#                                        # runs started later must not import from it), then in the background:
#       GPUs 0,1: the rollback experiment (benchmarks/gpu_experiments.sh rollback), then weak scaling at 1 and 2 GPUs
#       GPU 2:    tests/test_gpu.py
#       GPU 3:    the MoE upcycle; when it is done, all 4 GPUs: the 5 MoE arms at 8 minibatches, 3 seeds each
#   bash benchmarks/gpu_lease.sh wait SECS   # prints progress until everything is done or SECS have passed
#   bash benchmarks/gpu_lease.sh pack        # results to $OUT (a few archives: a call brings back at most 8 files)
#   bash benchmarks/gpu_lease.sh scaling     # weak scaling at 1, 2 and 4 GPUs with the working tree's code, alone
#   bash benchmarks/gpu_lease.sh ab          # detached: weak scaling (GPUS, default 1,2) of the working tree, then of
#                                            # the older tree in .gpu/base (git archive REV src benchmarks configs |
#                                            # tar -x -C .gpu/base), on the same machine; ROUNDS=2 repeats the pair;
#                                            # then PGPUS="1 2": the profile of the working tree; TESTK=expr: the GPU
#                                            # tests that match it
#   bash benchmarks/gpu_lease.sh rounds      # detached: ROUNDS (default 2) rounds of weak scaling (GPUS, default
#                                            # 1,2,4) of the working tree alone, the last one with the one-GPU run at
#                                            # the largest batch too (--equal-batch: the reward curve at equal batch)
#   bash benchmarks/gpu_lease.sh cards       # detached: ROUNDS (default 2) rounds of the working tree, each one GPU on
#                                            # every card at once (4 one-GPU runs side by side: the host as loaded as
#                                            # under the 4-GPU job) and then the 4-GPU job; cards.tgz to pack
#   bash benchmarks/gpu_lease.sh measure     # detached, from a frozen copy, one after another on the whole machine:
#                                            # weak scaling at 1, 2, 4 GPUs; the profile at 1 and 4; tests/test_gpu.py
#                                            # on GPUs 0-1 (its two-GPU tests included). Watch it with `wait`. On a
#                                            # 2-GPU machine: GPUS=1,2 PGPUS="1 2".
set -uo pipefail
R=/root/results
F=/root/frozen
mkdir -p $R
# the working tree copied to $F, which later calls' re-synced trees cannot change under the detached runs
freeze() { rm -rf $F $R/status && mkdir -p $F && tar --exclude=./.gpu -cf - . | tar -xf - -C $F; }
case "$1" in
start)
  freeze
  cd $F
  export PYTHONPATH=/tmp/site:$F/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  setsid bash -c "
    (CUDA_VISIBLE_DEVICES=3 CHECK= STEPS=700 LR=3e-4 OUT=$R bash benchmarks/gpu_moe.sh upcycle > $R/upcycle.log 2>&1
     echo \"upcycle exit \$?\" >> $R/status
     OUT=$R CKPT=80 SECS=1700 TRAIN_STEPS=320 JOBS=12 \
       ARMS=gspo+mb8,grpo+mb8,grpo+r2+mb8,grpo+r3+mb8,gspo+r2+mb8 bash benchmarks/gpu_moe.sh compare > $R/moe.log 2>&1
     echo \"moe exit \$?\" >> $R/status) &
    (CUDA_VISIBLE_DEVICES=2 timeout 600 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $R/gpu_tests.txt 2>&1
     echo \"tests exit \$?\" >> $R/status) &
    (CUDA_VISIBLE_DEVICES=0,1 W=/root/exp SECS=900 RJOBS=6 bash benchmarks/gpu_experiments.sh rollback > $R/rollback.log 2>&1
     echo \"rollback exit \$?\" >> $R/status
     tar czf $R/rollback.tgz -C /root/exp --exclude=checkpoints rollback rollback.log
     CUDA_VISIBLE_DEVICES=0,1 OMP_NUM_THREADS=1 GPUS=1,2 EQUAL= NAME=scaling_12 OUT=$R \
       bash benchmarks/gpu_scale.sh scaling > $R/scaling_12.log 2>&1
     echo \"scaling_12 exit \$?\" >> $R/status) &
    wait; echo all done >> $R/status" > $R/driver.log 2>&1 < /dev/null &
  sleep 5; cat $R/driver.log
  ;;
measure)
  freeze
  cd $F
  export PYTHONPATH=/tmp/site:$F/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 OUT=$R
  setsid bash -c "
    GPUS=\${GPUS:-1,2,4} EQUAL= NAME=\${NAME:-scaling_124} bash benchmarks/gpu_scale.sh scaling > $R/scaling.log 2>&1
    echo \"scaling exit \$?\" >> $R/status
    GPUS=\"\${PGPUS:-1 4}\" bash benchmarks/gpu_scale.sh profile > $R/profile.log 2>&1
    echo \"profile exit \$?\" >> $R/status
    CUDA_VISIBLE_DEVICES=0,1 timeout 600 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $R/gpu_tests.txt 2>&1
    echo \"tests exit \$?\" >> $R/status
    echo all done >> $R/status" > $R/driver.log 2>&1 < /dev/null &
  sleep 5; cat $R/driver.log
  ;;
ab)
  freeze && rm -rf /root/base && cp -r .gpu/base /root/base
  export OMP_NUM_THREADS=1 OUT=$R HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  setsid bash -c "
    for i in \$(seq \${ROUNDS:-1}); do
      for tree in $F /root/base; do
        cd \$tree && GPUS=\${GPUS:-1,2} EQUAL= NAME=\$(basename \$tree)_\$i bash benchmarks/gpu_scale.sh scaling \
          > $R/\$(basename \$tree)_\$i.log 2>&1
        echo \"\$tree \$i done\" >> $R/status
      done
    done
    cd $F
    if [ -n \"\${PGPUS-}\" ]; then GPUS=\"\$PGPUS\" bash benchmarks/gpu_scale.sh profile > $R/profile.log 2>&1; echo profile done >> $R/status; fi
    if [ -n \"\${TESTK-}\" ]; then PYTHONPATH=/tmp/site:$F/src timeout 400 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gpu.py -k \"\$TESTK\" > $R/gpu_tests.txt 2>&1; echo \"tests exit \$?\" >> $R/status; fi
    echo all done >> $R/status" > $R/driver.log 2>&1 < /dev/null &
  sleep 5; cat $R/driver.log
  ;;
rounds)
  freeze
  export OMP_NUM_THREADS=1 OUT=$R HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  setsid bash -c "
    cd $F
    n=\${ROUNDS:-2}
    for i in \$(seq \$n); do
      if [ \$i = \$n ]; then unset EQUAL; else export EQUAL=; fi
      GPUS=\${GPUS:-1,2,4} NAME=round_\$i bash benchmarks/gpu_scale.sh scaling > $R/round_\$i.log 2>&1
      echo \"round \$i done\" >> $R/status
    done
    echo all done >> $R/status" > $R/driver.log 2>&1 < /dev/null &
  sleep 5; cat $R/driver.log
  ;;
cards)
  freeze
  export OMP_NUM_THREADS=1 OUT=$R HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$F/src
  C=/dev/shm/cards
  rm -rf $C  # a run directory left from an earlier call would get a suffix, and its runs would be packed too
  M="model.name='/root/smollm2/model.gguf'"
  setsid bash -c "
    cd $F
    for i in \$(seq \${ROUNDS:-2}); do
      for k in 0 1 2 3; do
        CUDA_VISIBLE_DEVICES=\$k python3 benchmarks/scaling.py --gpus 1 --batches 40 --out $C/r\$i/card\$k/scaling.json \"$M\" \
          > $R/r\${i}_card\$k.log 2>&1 &
      done
      wait
      python3 benchmarks/scaling.py --gpus 4 --batches 40 --out $C/r\$i/gpus4/scaling.json \"$M\" > $R/r\${i}_gpus4.log 2>&1
      echo \"round \$i done\" >> $R/status
    done
    cd /dev/shm && tar czf $R/cards.tgz cards/*/*/scaling.json cards/*/*/scaling-runs/*/{metrics.jsonl,config.json,timings.json}
    echo all done >> $R/status" > $R/driver.log 2>&1 < /dev/null &
  sleep 5; cat $R/driver.log
  ;;
wait)
  end=$((SECONDS + ${2:-500}))
  while [ $SECONDS -lt $end ] && ! grep -q "all done" $R/status 2>/dev/null; do sleep 20; done
  cat $R/status 2>/dev/null; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  tail -3 $R/upcycle.log 2>/dev/null; tail -4 $R/gpu_tests.txt 2>/dev/null; tail -8 $R/rollback.log 2>/dev/null
  grep -h "speed-up\|GPUs\|rror" $R/scaling_12.log 2>/dev/null | tail -6
  tail -12 $R/scaling.log 2>/dev/null; grep -h -A3 "compl/s" $R/frozen_*.log $R/base_*.log $R/round_*.log $R/r?_*.log 2>/dev/null | grep -v "^seconds\|^--"; grep -h "^gspo/\|^stage" $R/profile.log 2>/dev/null | head -60
  ls /dev/shm/moe-compare 2>/dev/null | head -20; tail -25 $R/moe.log 2>/dev/null
  ;;
pack)
  cd $R && tar czf $OUT/lease.tgz --exclude='*.tgz' . && cp *.tgz $OUT/ 2>/dev/null; ls -la $OUT
  ;;
scaling)
  export OMP_NUM_THREADS=1
  GPUS=${GPUS:-1,2,4} EQUAL= NAME=${NAME:-scaling_124} bash benchmarks/gpu_scale.sh scaling
  ;;
esac
