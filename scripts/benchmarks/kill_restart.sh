#!/usr/bin/env bash
# As run on 4 x H200 (2026-11-27) after `multi_gpu.py` had listed its shards; $OUT: where the log and
# metrics.jsonl are copied. docs/bench/multi_gpu_kill_restart_4xh200.json holds its output.
# kill -9 of one of 4 workers mid-run, torchrun --max-restarts=1 resume=latest, NCCL
RUN=/tmp/killrun; rm -rf $RUN
URLS='/tmp/multi-gpu-bench/listed/shard-{000000..000156}.tar'
CMD="python3 -m torch.distributed.run --standalone --nproc_per_node=4 --max-restarts=1 train.py model=openclip model.arch=ViT-B-32 loss=infcl batch=8192 data=webdataset data.train.urls=$URLS data.num_workers=8 data.decode=gpu trainer.max_steps=50 trainer.ckpt_every=10 trainer.log_every=1 eval=none run_dir=$RUN resume=latest"
echo "$CMD"
start=$(date +%s)
timeout 240 $CMD > $OUT/kill_run.log 2>&1 &
for i in $(seq 1 300); do grep -q '"step": 25,' $RUN/metrics.jsonl 2>/dev/null && break; sleep 0.5; done
TORCHRUN=$(pgrep -f "^python3 -m torch.distributed.run --standalone" | head -1)
VICTIM=$(pgrep -P $TORCHRUN | sort -n | tail -1)
echo "at $(tail -1 $RUN/metrics.jsonl | cut -c1-12) after $(( $(date +%s) - start )) s: kill -9 $VICTIM (a worker of torchrun $TORCHRUN: $(pgrep -P $TORCHRUN | tr '\n' ' '))"
kill -9 $VICTIM
wait; echo "torchrun finished after $(( $(date +%s) - start )) s"
cp $RUN/metrics.jsonl $OUT/kill_metrics.jsonl
python3 - $RUN/metrics.jsonl <<'PY'
import json, sys, collections
steps = [json.loads(l)["step"] for l in open(sys.argv[1]) if l.strip()]
c = collections.Counter(steps)
print("records", len(steps), "distinct steps", len(c), "first", min(steps), "last", max(steps), "twice", sorted(s for s, n in c.items() if n > 1)[:10])
PY
grep -iE "restart|resum|gone|heartbeat|exitcode|signal|stopped|finished" $OUT/kill_run.log | cut -c1-240 | head -20
