#!/usr/bin/env bash
# Proves the README's two commands on a fresh Debian 12 root made with debootstrap, so a missing
# install step cannot hide behind packages already on this machine. Needs root and network
# access to a Debian mirror. Usage: scripts/verify-fresh-debian.sh [ROOT_DIR]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
root="${1:-/var/tmp/baton-fresh-bookworm}"
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
if [ ! -x "$root/bin/bash" ]; then
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian
fi
rm -rf "$root/baton" && mkdir -p "$root/baton"
git -C "$repo" archive HEAD | tar -x -C "$root/baton"
# A real machine has /proc, /sys (UCX's TCP transport lists /sys/class/net) and /dev (shared memory).
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/sys" || mount -t sysfs sysfs "$root/sys"
mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
mountpoint -q "$root/dev/shm" || mount -t tmpfs tmpfs "$root/dev/shm"
trap 'umount "$root/dev/shm" "$root/dev" "$root/sys" "$root/proc" 2>/dev/null || true' EXIT
echo "== README command 1: scripts/run-local.sh"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root bash -c 'cd /baton && ./scripts/run-local.sh'
echo "== README command 2: scripts/test.sh"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root bash -c 'cd /baton && ./scripts/test.sh'
echo "== fresh Debian 12 root: both README commands passed"
