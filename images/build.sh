#!/usr/bin/env bash
# Builds both images from the repository root with the tags the manifests in scheduler-config/ use
# (image: gpuplace:dev and gpuplace-device-plugin:dev). TAG=v0.1.0 images/build.sh for another tag;
# REGISTRY=registry.example.com/team/ to prefix the names (then edit image: in the manifests).
# Extra arguments go to both `docker build` calls (e.g. --build-arg RUST_VERSION=1.95, --push with
# buildx). Needs BuildKit (Docker 23+ or DOCKER_BUILDKIT=1) and network access to crates.io and the
# base images' registries.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${TAG:-dev}"
registry="${REGISTRY:-}"
docker build -f images/Dockerfile --target extender -t "${registry}gpuplace:${tag}" "$@" .
# the build stage is cached from the first call: this one only assembles the image
docker build -f images/Dockerfile --target device-plugin -t "${registry}gpuplace-device-plugin:${tag}" "$@" .
