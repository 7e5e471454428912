#!/usr/bin/env bash
# Builds the CPU image (deploy/docker/Dockerfile) from the repository root; `make image` runs it.
#
#   deploy/docker/build-image.sh [--tag NAME] [--base IMAGE|debian] [--engine docker|podman] [-- BUILD-ARGS...]
#
# Engine: Docker when it has an engine to talk to (`docker info` answers), else Podman; Podman
# builds with --isolation chroot (BUILDAH_ISOLATION overrides it), which needs no OCI runtime, so
# it builds where `podman run` cannot run containers.
# Base: python:3.11-slim when it is in the engine's store or can be pulled; otherwise (no registry
# reachable) one made from Debian's packages by deploy/docker/debian-base.sh, kept and reused.
# `--base debian` asks for that one; `--base IMAGE` for any other (Dockerfile, BASE_IMAGE).
# pip in the build trusts the CA bundle pip here trusts ($PIP_CERT, else $SSL_CERT_FILE, else
# /etc/ssl/certs/ca-certificates.crt): Podman mounts it for the build only (-v, never in a layer).
# Layers are cached in the engine's own store, so a second build of the same sources takes seconds.
# Prints the image's name on its last line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

DEFAULT_BASE=docker.io/library/python:3.11-slim
tag="keyword-embedder:0.1.0" base="" engine="${KWE_IMAGE_ENGINE:-}"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "build-image.sh: unknown argument $1 (usage: build-image.sh [--tag NAME] [--base IMAGE|debian] [--engine docker|podman] [-- BUILD-ARGS...])" >&2; exit 2 ;;
  esac
done

if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  else
    echo "build-image.sh: no container engine: Docker has no engine to talk to here and Podman is not installed (apt-get install podman)" >&2
    exit 1
  fi
fi

if [ -z "$base" ]; then
  if "$engine" image inspect "$DEFAULT_BASE" >/dev/null 2>&1 || timeout 120 "$engine" pull -q "$DEFAULT_BASE" >/dev/null 2>&1; then
    base="$DEFAULT_BASE"
  else
    echo "build-image: cannot pull $DEFAULT_BASE (no registry reachable?): using a base made from Debian's packages" >&2
    base=debian
  fi
fi
if [ "$base" = debian ]; then
  base="$(bash deploy/docker/debian-base.sh --engine "$engine" | tail -n 1)"
fi

args=(build -f deploy/docker/Dockerfile -t "$tag" --build-arg "BASE_IMAGE=$base")
if [ "$engine" = podman ]; then
  # BuildKit reads <Dockerfile>.dockerignore by itself; Podman 4 is told.
  args+=(--isolation "${BUILDAH_ISOLATION:-chroot}" --ignorefile deploy/docker/Dockerfile.dockerignore)
  ca="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
  if [ -f "$ca" ]; then
    args+=(-v "$(readlink -f "$ca"):/run/kwe-build-ca.pem:ro" --build-arg PIP_CERT=/run/kwe-build-ca.pem)
  fi
fi

echo "build-image: $engine ${args[*]} ${extra[*]} ." >&2
started=$SECONDS
"$engine" "${args[@]}" "${extra[@]}" .
size="$("$engine" image inspect --format '{{.Size}}' "$tag")"
echo "build-image: $tag from $base in $((SECONDS - started)) s, $((size / 1000000)) MB" >&2
echo "$tag"
