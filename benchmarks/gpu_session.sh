#!/usr/bin/env bash
# One short session on a lent CUDA machine (issue 26): the CUDA test suite, the kernel benchmark,
# bench and batched-bench on a SmolLM2-shaped file, greedy tokens of the tiny models on the GPU
# against the CPU. Run from the tree's root (the machine has torch and Triton but nothing else of
# kvtool's). Every step has its own timeout, cut to what is left of BUDGET seconds; the log (and
# each step's output) goes to $OUT.
#
#   OUT=dir BUDGET=380 STEPS=setup,tests,diag,greedy,suite,kernels,warm,bench,batched,prof \
#       bash benchmarks/gpu_session.sh
#
# Inputs beside the tree (all optional): WHEELS (a folder of wheels to install, default .whl),
# HEADER (a GGUF's first DATA_OFFSET bytes) with SIZE (the whole file's size in bytes), from which
# the model file is rebuilt with random weights (benchmarks/random_weights.py).
set -u
OUT=${OUT:-$PWD/gpu-out}
BUDGET=${BUDGET:-380}
STEPS=${STEPS:-setup,tests,diag,greedy,suite,kernels,warm,bench,batched,prof}
WHEELS=${WHEELS:-.whl}
PY=${PY:-python3}
HEADER=${HEADER:-}
SIZE=${SIZE:-0}
MODEL=${MODEL:-/tmp/smollm2-random.gguf}
TESTS=${TESTS:-tests/kvtool/test_device_cuda.py tests/kernels/test_kernels_cuda.py tests/kernels/test_gpu_kernels_bench.py}
export PYTHONUNBUFFERED=1
XDIST=()
mkdir -p "$OUT"
LOG=$OUT/log
T0=$SECONDS

log() { echo "== +$((SECONDS - T0))s $*" | tee -a "$LOG"; }
want() { [[ ",$STEPS," == *",$1,"* ]]; }

# step NAME SECONDS CMD...: runs CMD under a timeout cut to the budget left (skipped under 15 s)
step() {
	local name=$1 t=$2 left
	shift 2
	left=$((BUDGET - (SECONDS - T0) - 5))
	((t > left)) && t=$left
	if ((t < 15)); then
		log "$name: skipped, ${left}s of the budget left"
		return 0
	fi
	log "$name (timeout ${t}s): $*"
	timeout -k 5 "$t" "$@" 2>&1 | tee -a "$LOG"
	local rc=${PIPESTATUS[0]}
	log "$name: rc=$rc"
	return 0
}

KV=("$PY" -m kvtool.commands)

if want setup; then
	log "setup"
	if compgen -G "$WHEELS/*.whl" >/dev/null; then
		"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
		export PYTHONPATH=/tmp/site:$PWD
	else
		export PYTHONPATH=$PWD
	fi
	# kvtool maps commands/ and kernels/ into the package (pyproject's package-dir); uninstalled,
	# links do the same
	if ! "$PY" -c "import kvtool.kernels, kvtool.commands" 2>/dev/null; then
		ln -sfn ../kernels kvtool/kernels
		ln -sfn ../commands kvtool/commands
	fi
	{
		nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
		"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
		"$PY" -m pip list 2>/dev/null | grep -iE '^(gguf|typer|rich|tokenizers|jinja2|numpy|hypothesis|pytest|pytest-xdist|safetensors|psutil|matplotlib) '
		cat COMMIT 2>/dev/null || git log -1 --format='commit %H %cd'
		nproc
	} 2>&1 | tee -a "$LOG"
fi
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 6)

# Phase 1, nothing timed: the tests in front; the model file, the tiny models' greedy tokens and
# the CPU suite beside them, each into its own log (appended to the main one when it ends).
bg() {
	local name=$1
	shift
	(LOG=$OUT/$name.log step "$name" "$@" >/dev/null) &
	BG+=("$!:$name")
}
BG=()
if [[ -n "$HEADER" && ! -s "$MODEL" ]]; then
	fill() { cp "$HEADER" "$MODEL.part" && truncate -s "$SIZE" "$MODEL.part" &&
		"$PY" benchmarks/random_weights.py "$MODEL.part" && mv "$MODEL.part" "$MODEL"; }
	export -f fill
	export HEADER SIZE MODEL PY
	bg fill 60 bash -c fill
fi

if want greedy; then
	# every tiny model's greedy text, --device cuda against the CPU
	greedy() {
		local m a cpu gpu bad=0
		for m in tests/data/tiny/models/tiny-*.gguf; do
			a=$(basename "$m" .gguf)
			cpu=$("$PY" -m kvtool.commands run -m "$m" -p "the cat sat" -n 16 --temp 0 --no-chat --weights f32 2>&1)
			gpu=$("$PY" -m kvtool.commands run -m "$m" -p "the cat sat" -n 16 --temp 0 --no-chat --weights f32 --device cuda 2>&1)
			cpu=$(grep -v " time =\|first token =" <<<"$cpu")
			gpu=$(grep -v " time =\|first token =" <<<"$gpu")
			if [[ "$cpu" == "$gpu" && -n "$cpu" ]]; then echo "$a: same"; else
				echo "$a: DIFFERENT"
				echo "cpu: $(cat -v <<<"$cpu" | head -c 600)"
				echo "gpu: $(cat -v <<<"$gpu" | head -c 600)"
				bad=1
			fi
		done
		return $bad
	}
	export -f greedy
	export PY
	bg greedy 150 bash -c greedy
fi

if want suite; then
	# the CPU suite on a machine with a GPU: tests that assume none show here
	bg suite 220 nice -n 10 "$PY" -m pytest -p no:cacheprovider -v "${XDIST[@]}" --tb=short --maxfail=40 \
		-m "not cuda and not real" tests
fi

if want diag && [[ -f diag_tiny.py ]]; then
	bg diag 200 "$PY" diag_tiny.py ${DIAG_ARCHS:-}
fi

if want tests; then
	# xdist: each test runs its checks in a subprocess that compiles kernels (CPU-bound)
	step tests 200 "$PY" -m pytest -p no:cacheprovider -q -m "cuda and not real" "${XDIST[@]}" --tb=short -rA \
		--junitxml="$OUT/tests.xml" $TESTS
fi

for b in "${BG[@]}"; do
	wait "${b%%:*}"
	# the suite's log names every test: only its failures and summary here
	if [[ "${b#*:}" == suite ]]; then grep -E "== \+|FAILED|ERROR|passed|failed" "$OUT/suite.log"; else cat "$OUT/${b#*:}.log"; fi >>"$LOG"
done
log "phase 1 done"

# Phase 2, timed: one thing at a time on the GPU
if want kernels; then
	step kernels 120 "$PY" benchmarks/gpu_kernels.py --json "$OUT/gpu_kernels.json"
fi

if want warm && [[ -s "$MODEL" ]]; then
	# Triton compiles each kernel variant on first use (cached on disk): not in the timed runs
	step warm 90 "${KV[@]}" batched-bench -m "$MODEL" --device cuda -npp 128,512 -ntg 4 -npl 1,16,64 --no-progress
fi

if want bench && [[ -s "$MODEL" ]]; then
	step bench 75 "${KV[@]}" bench -m "$MODEL" --device cuda -p 512 -n 128 -r 5 --no-progress
	step bench-nographs 75 env GGML_CUDA_DISABLE_GRAPHS=1 "${KV[@]}" bench -m "$MODEL" --device cuda -p 512 -n 128 -r 5 --no-progress
fi

if want batched && [[ -s "$MODEL" ]]; then
	step batched 100 "${KV[@]}" batched-bench -m "$MODEL" --device cuda -npp 128,512 -ntg 32 -npl 1,16,64 --no-progress
	step batched-nographs 100 env GGML_CUDA_DISABLE_GRAPHS=1 "${KV[@]}" batched-bench -m "$MODEL" --device cuda -npp 128,512 -ntg 32 -npl 1,16,64 --no-progress
fi
if want prof && [[ -s "$MODEL" ]]; then
	# where a decode step's time goes on the host: the verb run through main() under cProfile
	# (the console script ends with os._exit, which would skip writing the profile)
	step prof 60 "$PY" -c "
import cProfile, pstats, sys
from kvtool.commands import main
sys.argv = ['kvtool', 'bench', '-m', '$MODEL', '--device', '${PROF_DEVICE:-cuda}', '-p', '0', '-n', '128', '-r', '3', '--no-progress']
prof = cProfile.Profile()
try:
    prof.runcall(main)
except SystemExit:
    pass
prof.dump_stats('$OUT/tg.prof')
st = pstats.Stats(prof)
st.sort_stats('tottime').print_stats(30)
st.sort_stats('cumulative').print_stats(40)
"
fi
log "done"
