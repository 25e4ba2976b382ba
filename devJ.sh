source devrun.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
mkdir -p $OUT/J
python scripts/bench_first_sweep.py --out /root/J --parts peft plora-fixed --peft-n 8 --keep-runs > $OUT/J/J.log 2>&1; echo bench $?
cp /root/J/first_sweep.* /root/J/*summary.json $OUT/J/ 2>/dev/null
tail -10 /root/J/first_sweep.md
cd $OUT && tar czf J.tgz J && rm -rf J && ls -la $OUT
