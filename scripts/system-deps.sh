#!/usr/bin/env bash
# Debian packages the test suite drives for real: Chromium for the browser demo test,
# PostgreSQL for the shared job store, espeak-ng for speech fixtures.
# Installs only what is missing, and only where apt-get can run (as root); elsewhere the
# tests that need a package skip with the reason.
set -euo pipefail
packages=(chromium chromium-driver postgresql espeak-ng)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "system-deps: missing ${missing[*]} (run this script as root to install them)" >&2
    exit 0
fi
echo "system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
