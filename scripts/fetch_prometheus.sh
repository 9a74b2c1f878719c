#!/usr/bin/env bash
# Debian's `prometheus` package, unpacked into <venv>/opt/prometheus, its binary linked as
# <venv>/bin/prometheus. Used by scripts/install.sh for the dashboard test.
#   scripts/fetch_prometheus.sh .venv
set -euo pipefail
VENV=${1:?usage: fetch_prometheus.sh VENV}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# `apt-get download` needs the package lists; a fresh container may have none yet.
apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null; }
cd - >/dev/null
mkdir -p "$VENV/opt/prometheus"
dpkg -x "$work"/prometheus_*.deb "$VENV/opt/prometheus"
ln -sf "$(cd "$VENV/opt/prometheus/usr/bin" && pwd)/prometheus" "$VENV/bin/prometheus"
echo "[install] Prometheus: $("$VENV/bin/prometheus" --version 2>&1 | head -1)"
