#!/usr/bin/env bash
# Installs every build and runtime dependency of meshrun from Debian bookworm's packages
# (skips apt entirely when everything is already installed).
set -euo pipefail
# ocl-icd-opencl-dev: a Recommends of libdnnl-dev that its CMake config needs (find_package(OpenCL)).
# clang, libfuzzer-14-dev, libomp-14-dev, libclang-rt-14-dev (sanitizer headers and runtimes, only a
# Recommends of clang): the libFuzzer targets (tests/fuzz), built in build-fuzz/ by scripts/test.sh.
# python3-venv: scripts/python-env.sh's venv (numpy from PyPI) for the tests' .npy datasets.
PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev libxbyak-dev ocl-icd-opencl-dev prometheus-cpp-dev libgoogle-glog-dev zlib1g-dev nlohmann-json3-dev
  libssl-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
  prometheus iproute2 iptables dataset-fashion-mnist procps
  clang libfuzzer-14-dev libomp-14-dev libclang-rt-14-dev
  python3-venv
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
