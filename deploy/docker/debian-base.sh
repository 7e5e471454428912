#!/usr/bin/env bash
# A base image for deploy/docker/Dockerfile made from Debian's own packages, for machines that
# cannot pull python:3.11-slim (no registry reachable) but can reach Debian's archive:
#
#   deploy/docker/debian-base.sh [--engine podman|docker] [--refresh]
#
# Debian 12 (bookworm) minbase plus python3 (3.11, as python:3.11-slim), python3-venv, tini and
# ca-certificates, upgraded from bookworm-updates and bookworm-security, with apt's lists and
# caches, logs, documentation (copyright files kept), man pages and locales removed. Prints the
# image's name on its last line (localhost/keyword-embedder-base:bookworm-KEY).
#
# KEY is a hash of this recipe (suite, variant, architecture, package list, mirrors): the image is
# made once per recipe and reused while it exists in the engine's storage. Its root filesystem is
# also kept as a tar under $KWE_IMAGE_CACHE (default ~/.cache/keyword-embedder/images) with the
# list of package versions beside it, so an emptied image store imports it again in seconds
# instead of running debootstrap (about a minute and a half). The package versions are those of
# the day it was made: --refresh (or deleting the tar) makes it again with today's updates.
#
# Making it needs root and debootstrap (apt-get install debootstrap); importing a kept tar does not.
set -euo pipefail

SUITE=bookworm
VARIANT=minbase
PACKAGES="ca-certificates python3 python3-venv tini"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
CACHE="${KWE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/keyword-embedder/images}"

engine="" refresh=0
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine="$2"; shift 2 ;;
    --refresh) refresh=1; shift ;;
    *) echo "debian-base.sh: unknown argument $1 (usage: debian-base.sh [--engine podman|docker] [--refresh])" >&2; exit 2 ;;
  esac
done
if [ -z "$engine" ]; then
  if command -v podman >/dev/null; then engine=podman; else engine=docker; fi
fi
command -v "$engine" >/dev/null || { echo "debian-base.sh: $engine is not installed" >&2; exit 1; }

arch="$(dpkg --print-architecture 2>/dev/null || uname -m)"
# Bump the last field when the steps below change what ends up in the image.
recipe="suite=$SUITE variant=$VARIANT arch=$arch packages=$PACKAGES mirror=$MIRROR security=$SECURITY_MIRROR steps=1"
key="$(printf '%s' "$recipe" | sha256sum | cut -c1-12)"
image="localhost/keyword-embedder-base:$SUITE-$key"
tarball="$CACHE/debian-$SUITE-$arch-$key.tar"

mkdir -p "$CACHE"
exec 9>"$CACHE/.debian-base.lock"
flock 9   # two builds at once make it once

if [ "$refresh" = 0 ] && "$engine" image inspect "$image" >/dev/null 2>&1; then
  echo "debian-base: $image is there (recipe $key)" >&2
  echo "$image"
  exit 0
fi

if [ "$refresh" = 1 ] || [ ! -s "$tarball" ]; then
  [ "$(id -u)" = 0 ] || { echo "debian-base.sh: making the base needs root (debootstrap, chroot); $tarball is not there to import" >&2; exit 1; }
  command -v debootstrap >/dev/null || { echo "debian-base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
  started=$SECONDS
  work="$(mktemp -d "$CACHE/.rootfs.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  root="$work/root"
  echo "debian-base: debootstrap --variant=$VARIANT $SUITE from $MIRROR with $PACKAGES" >&2
  debootstrap --variant="$VARIANT" --include="${PACKAGES// /,}" "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; echo "debian-base.sh: debootstrap failed (log above)" >&2; exit 1; }
  cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  # The point release's and the security archive's updates (debootstrap installs the release as
  # it was cut). Nothing in minbase runs a service, so upgrading in a chroot starts nothing.
  chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    sh -ec 'apt-get update -q && apt-get -y -q -o Dpkg::Options::=--force-confold upgrade && apt-get clean' \
    >"$work/upgrade.log" 2>&1 \
    || { tail -n 30 "$work/upgrade.log" >&2; echo "debian-base.sh: apt-get upgrade in the new root failed (log above)" >&2; exit 1; }
  # shellcheck disable=SC2016 # dpkg-query's own ${Field} format, not the shell's
  chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$work/packages"
  # What a container base carries no copy of: apt's lists and downloads, logs, docs, man pages,
  # locales, and this machine's resolver, hostname and machine id (a runtime provides them).
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/tmp/* "$root"/root/.cache
  find "$root/var/log" -type f -delete
  find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  : >"$root/etc/resolv.conf"; : >"$root/etc/machine-id"; rm -f "$root/etc/hostname"
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$root" -cf "$work/rootfs.tar" .
  mv "$work/packages" "${tarball%.tar}.packages"
  mv "$work/rootfs.tar" "$tarball"
  echo "debian-base: made $tarball ($(du -m "$tarball" | cut -f1) MB, $(wc -l <"${tarball%.tar}.packages") packages) in $((SECONDS - started)) s" >&2
fi

"$engine" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["bash"]' \
  "$tarball" "$image" >"$CACHE/.import.log" 2>&1 \
  || { cat "$CACHE/.import.log" >&2; echo "debian-base.sh: $engine import $tarball failed (log above)" >&2; exit 1; }
echo "debian-base: imported $image from $tarball" >&2
echo "$image"
