#!/usr/bin/env bash
# The first screen of each committed example report as a reader opens it: headless
# Chromium (Debian's `chromium` package) at 1400x900 -> docs/screenshots/<name>.png.
# Usage: scripts/screenshot_reports.sh [OUT_DIR]   (run after `make demo`)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/screenshots}"
command -v chromium >/dev/null || { echo "chromium not installed (apt-get install chromium)" >&2; exit 2; }
mkdir -p "$out"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
for pair in ab:reports/example needle:reports/needle/example; do
    name="${pair%%:*}"; page="$(realpath "${pair#*:}/index.html")"
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$profile" --hide-scrollbars --window-size=1400,900 \
        --screenshot="$out/$name.png" "file://$page" >/dev/null 2>&1
    echo "$out/$name.png"
done
