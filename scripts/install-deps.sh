#!/usr/bin/env bash
# Installs every build and runtime dependency of meshrun from Debian bookworm's packages.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build pkg-config \
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
  libabsl-dev libdnnl-dev prometheus-cpp-dev libgoogle-glog-dev zlib1g-dev nlohmann-json3-dev \
  libgtest-dev libgmock-dev libbenchmark-dev \
  libcli11-dev dataset-fashion-mnist procps
