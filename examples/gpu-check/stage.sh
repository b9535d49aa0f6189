#!/usr/bin/env bash
# Builds gpu-check and the device plugin (release) on this machine and copies them, stripped, into
# target/gpu-check/ of this checkout: the one ignored folder to carry to the GPU machine, where
# examples/gpu-check/run.sh finds them. SKIP_PLUGIN=1: gpu-check only (the plugin copied before stays).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
stage=$repo/target/gpu-check
mkdir -p "$stage"
cargo build --release --locked --manifest-path "$repo/examples/gpu-check/Cargo.toml"
cp "$target/release/gpu-check" "$stage/gpu-check"
if [ "${SKIP_PLUGIN:-0}" != 1 ]; then
  cargo build --release --locked --manifest-path "$repo/Cargo.toml" -p gpuplace-device-plugin \
    --bin gpuplace-device-plugin --example guard_check --example driver_limit_check
  cp "$target/release/gpuplace-device-plugin" "$stage/gpuplace-device-plugin"
  # the guard's loop against one process on the real driver (run.sh step 6)
  cp "$target/release/examples/guard_check" "$stage/guard_check"
  # the plugin's driver memory cap on one cgroup (run.sh step 7)
  cp "$target/release/examples/driver_limit_check" "$stage/driver_limit_check"
fi
# the workspace's release profile keeps symbols (backtraces); the carried copies need none
if command -v strip >/dev/null; then strip "$stage"/* 2>/dev/null || true; fi
ls -l "$stage"
du -sh "$stage"
