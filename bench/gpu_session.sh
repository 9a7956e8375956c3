#!/usr/bin/env bash
# Every GPU check and figure in one command, for a session that is lent a GPU machine
# (one H200, its own torch, no package index): run from the repository root there,
#   bash bench/gpu_session.sh OUT_DIR          (about 5 minutes)
# It writes each part's output to OUT_DIR and prints a summary; it needs only python3
# with torch (and pytest for the tests). Each part has its own time limit, so one that
# hangs leaves the others' results, and all of them fit GPU_SESSION_BUDGET_S (default 540:
# a device call's 600 s less the transfers): a part gets what is left at most, and one
# with under 20 s left is skipped and said so. Exits non-zero if any part failed.
set -uo pipefail
out=${1:?usage: bench/gpu_session.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
status=0
ends=$(( $(date +%s) + ${GPU_SESSION_BUDGET_S:-540} ))
part() {  # part NAME SECONDS COMMAND...: run one part into OUT_DIR/NAME.txt
    local name=$1 limit=$2
    shift 2
    local left=$(( ends - $(date +%s) ))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s of the session's budget left"
        status=1
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc (limit ${limit} s)"
    [ "$rc" = 0 ] || status=1
}
{
    nvidia-smi -L
    python3 -c "import sys, torch, torch.distributed as d; print(sys.version); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), \
'nccl2', hasattr(d, 'ProcessGroupNCCL2'), 'cudnn', torch.backends.cudnn.version())"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
timeout 360 python3 bench/gpu_check.py >"$out/gpu_check.json" 2>"$out/gpu_check.err"
rc=$?
echo "== gpu_check: exit $rc"
[ "$rc" = 0 ] || status=1
grep '^\[gpu_check' "$out/gpu_check.err"
part reduce_device_cost 240 python3 bench/reduce_device_cost.py --profile
part pytest 200 env PYTHONPATH=elastic python3 -m pytest -q -o addopts= -W error \
    -W "ignore:\`torch.jit.script_method\` is deprecated:DeprecationWarning" \
    --noconftest -p no:cacheprovider \
    tests/elastic/test_transport_nccl_gpu.py tests/elastic/test_reduce_device.py \
    tests/elastic/test_rng.py tests/elastic/test_numerics.py tests/elastic/test_transport.py \
    tests/elastic/test_device.py tests/elastic/test_snapshot_device.py tests/elastic/test_transfer.py
part nccl_abort 120 python3 bench/nccl_abort.py
tail -n 3 "$out/pytest.txt" 2>/dev/null
cat "$out/reduce_device_cost.txt" "$out/nccl_abort.txt" 2>/dev/null
python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
print(json.dumps({k: r.get(k) for k in ('ok', 'seconds', 'checks', 'figures', 'errors')}, indent=1))" \
    "$out/gpu_check.json" || status=1
exit "$status"
