#!/usr/bin/env bash
# Makes the Dockerfile's base image available locally: if IMAGE (default debian:bookworm-slim) is
# neither present nor pullable (no registry reachable, as on an air-gapped build machine), builds an
# equivalent minimal Debian bookworm root file system with debootstrap and `docker import`s it under
# that tag, so deploy/Dockerfile and docker-compose.yml work unchanged.
#
# Usage: bash deploy/build-base-image.sh [IMAGE]
# Env:   MESHRUN_DEBIAN_MIRROR (default http://deb.debian.org/debian), MESHRUN_PULL_TIMEOUT (s, 60)
# Needs: root, docker, debootstrap (installed with apt-get when missing).
set -euo pipefail

image="${1:-debian:bookworm-slim}"
mirror="${MESHRUN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image: present"
  exit 0
fi
if timeout "${MESHRUN_PULL_TIMEOUT:-60}" docker pull "$image" >/dev/null 2>&1; then
  echo "base image $image: pulled"
  exit 0
fi
echo "base image $image: not pullable; building it with debootstrap from $mirror"

if ! command -v debootstrap >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

rootfs="$(mktemp -d /tmp/meshrun-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
  tail -20 "$rootfs.log" >&2
  echo "debootstrap of $suite from $mirror failed (log above)" >&2
  exit 1
}
rm -f "$rootfs.log"

# What the official slim image carries: the suite, its updates and security archives; no apt
# caches, no docs; apt does not install recommends.
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
SOURCES
echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/99meshrun-no-recommends"
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*

tar -C "$rootfs" --numeric-owner -c . |
  docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$image" >/dev/null
echo "base image $image: built locally ($(docker image inspect -f '{{.Size}}' "$image") bytes)"
