#!/usr/bin/env bash
# For whoever has a machine with an NVIDIA GPU: builds residentd with the
# nvml feature, starts it with a pool bound to GPU 0, and prints what the
# probe reads (the pool's budget, effective budget and the free memory NVML
# reports), next to nvidia-smi's view when it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p residentd --features nvml --bins
dir=$(mktemp -d)
trap 'kill "$agent" 2>/dev/null || true; rm -rf "$dir"' EXIT
cat > "$dir/gpu.toml" <<TOML
[node]
name = "gpu-check"
listen = "unix://$dir/residentd.sock"
state_dir = "$dir/state"

[[pool]]
name = "gpu0"
budget = "1TB"
device = "nvml:0"
reserve = "1GB"
TOML
target/release/residentd --config "$dir/gpu.toml" &
agent=$!
for _ in $(seq 100); do [ -S "$dir/residentd.sock" ] && break; sleep 0.1; done
echo "== what residentd reads (effective = free - reserve, capped by budget)"
target/release/residentctl --socket "$dir/residentd.sock" node
if command -v nvidia-smi >/dev/null; then
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,memory.free --format=csv
fi
