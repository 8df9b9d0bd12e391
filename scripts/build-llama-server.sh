#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for `tokenloom bench peers`, from the llama.cpp sources
# that ship inside the llama-cpp-python sdist on PyPI (no other download needed).
# Usage: scripts/build-llama-server.sh [DEST]   (default .peers; ~5-7 minutes on 2 cores)
set -euo pipefail
DEST=${1:-.peers}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$DEST/src"
if [ ! -f "$DEST/src/llama_cpp_python-$VERSION.tar.gz" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST/src"
fi
tar xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
# -march=native, except AMX: on a Xeon with AMX, llama.cpp's AMX kernels die with SIGILL
# (`tilezero`) in this sandbox, so they are left out wherever the CPU has them. With
# GGML_NATIVE the GGML_AMX_* options are not read (the compiler's -march=native defines
# __AMX_INT8__ and ggml compiles its AMX path from that), so the ISA itself is turned off:
# GCC's explicit -mno-* flags win over -march=native whatever their order.
CMAKE_AMX=()
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_AMX=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
               "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
    echo "CPU has AMX: building without llama.cpp's AMX kernels"
fi
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON "${CMAKE_AMX[@]}" \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > "$DEST/cmake.log"
cmake --build "$DEST/build" --target llama-server llama-bench -j "$(nproc)" >> "$DEST/cmake.log"
ln -sf build/bin/llama-server "$DEST/llama-server"  # they link to the shared libs beside them
ln -sf build/bin/llama-bench "$DEST/llama-bench"
echo "built $DEST/llama-server and $DEST/llama-bench"
