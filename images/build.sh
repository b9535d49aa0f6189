#!/usr/bin/env bash
# Builds gpuplace's two images from this checkout, without a daemon and without pulling anything:
# gpuplace (the extender) and gpuplace-device-plugin, from images/Containerfile (FROM scratch).
#
#   images/build.sh                                  # cargo build --release, then both images
#   REGISTRY=registry.example.com/team/ TAG=v0.1.0 images/build.sh --push
#   images/build.sh --bin-dir target/release --archive /tmp/images   # docker-archive tars, for
#                                                    # `ctr -n k8s.io images import` on a node
#
# Options (each also read from the environment variable in brackets):
#   --bin-dir DIR   take gpuplace and gpuplace-device-plugin from DIR instead of building them [BIN_DIR]
#   --tag TAG       image tag, default dev (the manifests' and the chart's default) [TAG]
#   --registry P    name prefix, e.g. registry.example.com/team/ (the trailing slash is yours) [REGISTRY]
#   --push          push both images to their names' registry after building them
#   --archive DIR   also write DIR/gpuplace.tar and DIR/gpuplace-device-plugin.tar (docker-archive)
#   --root DIR      a private image store (buildah/podman --root DIR, vfs driver), e.g. for tests [IMAGE_ROOT]
#   --builder B     buildah (default), podman or docker [BUILDER]
#
# Needs: buildah (Debian: apt-get install buildah), ldd (libc-bin), the CA bundle
# /etc/ssl/certs/ca-certificates.crt (ca-certificates), and, without --bin-dir, cargo.
# The images hold the building machine's glibc, libgcc and loader (found with ldd on the binaries),
# so what was linked against is what runs, whatever the nodes' distribution.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

bin_dir=${BIN_DIR:-}
tag=${TAG:-dev}
registry=${REGISTRY:-}
root=${IMAGE_ROOT:-}
builder=${BUILDER:-buildah}
archive=""
push=0
while [ $# -gt 0 ]; do
  case $1 in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --registry) registry=$2; shift 2 ;;
    --push) push=1; shift ;;
    --archive) archive=$2; shift 2 ;;
    --root) root=$2; shift 2 ;;
    --builder) builder=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "images/build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
command -v "$builder" >/dev/null || { echo "images/build.sh: $builder not found (Debian: apt-get install buildah)" >&2; exit 1; }
command -v ldd >/dev/null || { echo "images/build.sh: ldd not found (Debian: libc-bin)" >&2; exit 1; }
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] || { echo "images/build.sh: $ca not found (Debian: apt-get install ca-certificates)" >&2; exit 1; }

bins=(gpuplace gpuplace-device-plugin)
if [ -z "$bin_dir" ]; then
  cargo build --release --locked --workspace --bins
  bin_dir=$repo/target/release
fi
for b in "${bins[@]}"; do
  [ -x "$bin_dir/$b" ] || { echo "images/build.sh: $bin_dir/$b not found or not executable" >&2; exit 1; }
done

# ---- the build context: bin/, base/, examples/
ctx=$repo/target/images/context
rm -rf "$ctx"
mkdir -p "$ctx/bin" "$ctx/base" "$ctx/examples/traces"
base=$ctx/base
for b in "${bins[@]}"; do
  # a test build carries debug info (hundreds of MB); what runs does not need it
  if command -v objcopy >/dev/null; then
    objcopy --strip-debug "$bin_dir/$b" "$ctx/bin/$b"
  else
    cp "$bin_dir/$b" "$ctx/bin/$b"
  fi
  chmod 0755 "$ctx/bin/$b"
done
cp -r examples/traces/demo "$ctx/examples/traces/demo"

# The host's top-level symlinks (merged /usr: /lib -> usr/lib), so the paths the binaries were linked
# with (their ELF interpreter /lib64/ld-linux-x86-64.so.2) resolve in the image as on the host.
for d in /lib /lib64 /lib32 /libx32 /bin /sbin; do
  [ -L "$d" ] && ln -s "$(readlink "$d")" "$base$d"
done

# Copies a file and every symlink on the way to it, each at its path with directories resolved.
copy_path() {
  local p=$1 dir target
  while :; do
    dir=$(realpath "$(dirname "$p")")
    p=$dir/$(basename "$p")
    mkdir -p "$base$dir"
    if [ -L "$p" ]; then
      [ -e "$base$p" ] || [ -L "$base$p" ] || cp -P "$p" "$base$p"
      target=$(readlink "$p")
      case $target in /*) p=$target ;; *) p=$dir/$target ;; esac
    else
      [ -e "$base$p" ] || cp "$p" "$base$p"
      return
    fi
  done
}
for b in "${bins[@]}"; do
  # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)"
  libs=$(ldd "$ctx/bin/$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
  [ -n "$libs" ] || { echo "images/build.sh: ldd found no libraries for $b (a static binary needs no base; not expected here)" >&2; exit 1; }
  for l in $libs; do copy_path "$l"; done
done
# where the NVIDIA container toolkit mounts libnvidia-ml.so.1 for the device plugin's dlopen
mkdir -p "$base/usr/lib/x86_64-linux-gnu"

mkdir -p "$base/etc/ssl/certs" "$base/tmp" "$base/home/nonroot" "$base/root"
cp "$ca" "$base/etc/ssl/certs/ca-certificates.crt"
chmod 1777 "$base/tmp"
chmod 0700 "$base/root"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$base/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$base/etc/group"
# glibc's default without this file tries DNS before /etc/hosts
printf 'hosts: files dns\n' > "$base/etc/nsswitch.conf"
chown -R 65532:65532 "$base/home/nonroot" 2>/dev/null || true

# ---- the images
store=()
if [ -n "$root" ]; then
  case $builder in
    buildah|podman) store=(--root "$root/storage" --runroot "$root/run" --storage-driver vfs) ;;
    *) echo "images/build.sh: --root needs buildah or podman" >&2; exit 2 ;;
  esac
fi
names=("${registry}gpuplace:${tag}" "${registry}gpuplace-device-plugin:${tag}")
targets=(extender device-plugin)
for i in 0 1; do
  "$builder" "${store[@]}" build -q -f images/Containerfile --target "${targets[$i]}" -t "${names[$i]}" "$ctx" >/dev/null
done

du_mb() { du -sb "$1" | awk '{printf "%.1f MB", $1 / 1e6}'; }
echo "binaries: gpuplace $(du_mb "$ctx/bin/gpuplace"), gpuplace-device-plugin $(du_mb "$ctx/bin/gpuplace-device-plugin"); base $(du_mb "$base")"
for n in "${names[@]}"; do
  case $builder in
    docker) size=$(docker image inspect -f '{{.Size}}' "$n") ;;
    *) size=$("$builder" "${store[@]}" inspect --type image -f '{{.Size}}' "$n" 2>/dev/null ||
      "$builder" "${store[@]}" images --noheading --format '{{.Size}}' "$n") ;;
  esac
  echo "image $n: $size"
done

if [ -n "$archive" ]; then
  mkdir -p "$archive"
  for i in 0 1; do
    file=$archive/${bins[$i]}.tar
    rm -f "$file"
    case $builder in
      docker) docker save -o "$file" "${names[$i]}" ;;
      *) "$builder" "${store[@]}" push -q "${names[$i]}" "docker-archive:$file:${names[$i]}" ;;
    esac
    echo "archive $file ($(du_mb "$file"))"
  done
fi
if [ "$push" = 1 ]; then
  for n in "${names[@]}"; do
    case $builder in
      docker) docker push "$n" ;;
      *) "$builder" "${store[@]}" push "$n" "docker://$n" ;;
    esac
  done
fi
