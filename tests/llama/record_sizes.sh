#!/bin/bash
# Records what llama.cpp itself reports for the models of arch_models.py
# (and make_model.py's llama), case by case: its KV / recurrent-state
# ("RS") and output buffers, a vision projector's model size, as crates/resident-config/tests/gguf.rs
# compares them to residentd's sizing. Each llama-server runs until it
# listens (or 60 s), then is stopped.
#
# Usage: record_sizes.sh [BIN_DIR] [PYTHON]
#   BIN_DIR: llama-server's folder (default ~/.cache/residentd/llama.cpp-0.3.36/bin)
#   PYTHON:  a python with the gguf package (default python3)
set -u
bin=${1:-$HOME/.cache/residentd/llama.cpp-0.3.36/bin}
py=${2:-python3}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export LD_LIBRARY_PATH=$bin
"$py" "$here/arch_models.py" "$out" >/dev/null || exit 1
"$py" "$here/make_model.py" "$out/llama.gguf" --embd 256 --layers 4 || exit 1
port=18$((RANDOM % 900 + 100))

run() {
    local name=$1 model=$2
    shift 2
    local log=$out/$name.log
    "$bin/llama-server" -m "$out/$model.gguf" --host 127.0.0.1 --port "$port" -t 1 -v "$@" >"$log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 120); do
        sleep 0.5
        grep -q "listening on\|exiting due to" "$log" && break
        kill -0 "$pid" 2>/dev/null || break
    done
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "== $name: llama-server -m $model.gguf $*"
    # The last context is the real one (the first is the fit probe's,
    # which allocates nothing).
    sed 's/^[0-9.]* [A-Z] //' "$log" | awk '
        /llama_context: n_seq_max/ { n = 0 }
        /output buffer size|KV buffer size|RS buffer size|llama_kv_cache: size|llama_memory_recurrent: size|creating .*KV cache, size|exiting due to|^E / { kept[n++] = $0 }
        /load_hparams: model size|worst-case memory usage of mmproj/ { extra = extra "   " $0 "\n" }
        END { for (i = 0; i < n; i++) print "   " kept[i]; printf "%s", extra }'
}

run llama-np4 llama -c 4096 -np 4
run llama-np4-kvu llama -c 4096 -np 4 -kvu
run llama-auto llama -c 4096
run llama-np1-c1000 llama -c 1000 -np 1
run llama-q8 llama -c 4096 -np 1 -fa on -ctk q8_0 -ctv q8_0
run gemma2-auto gemma2 -c 4096
run gemma2-np1 gemma2 -c 4096 -np 1
run gemma2-np2 gemma2 -c 4096 -np 2
run gemma2-swa-full gemma2 -c 4096 -np 1 --swa-full
run gemma3-np1 gemma3 -c 8192 -np 1
run deepseek2 deepseek2 -c 8192 -np 1
run mamba-np64 mamba -c 4096 -np 64
run rwkv6-np64 rwkv6 -c 4096 -np 64
run jamba-np64 jamba -c 65536 -np 64
run llama-mmproj llama -c 1024 -np 1 --mmproj "$out/mmproj.gguf"
