#!/usr/bin/env bash
# The first screen of report pages as a reader opens them: headless Chromium (Debian's
# `chromium` package) at 1400x900 -> OUT_DIR/<name>.png.
# Usage: scripts/screenshot_reports.sh [OUT_DIR] [NAME=PAGE ...]
#   without pages: the committed example reports (ab, needle; run after `make example`);
#   NAME=PAGE: any report's index.html (or its folder), e.g. engines=reports/engines/demo
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/screenshots}"
shift || true
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(ab=reports/example needle=reports/needle/example)
command -v chromium >/dev/null || { echo "chromium not installed (apt-get install chromium)" >&2; exit 2; }
mkdir -p "$out"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
for pair in "${pairs[@]}"; do
    name="${pair%%=*}"; page="${pair#*=}"
    [ -d "$page" ] && page="$page/index.html"
    [ -f "$page" ] || { echo "no page $page" >&2; exit 2; }
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$profile" --hide-scrollbars --window-size=1400,900 \
        --screenshot="$out/$name.png" "file://$(realpath "$page")" >/dev/null 2>&1
    echo "$out/$name.png"
done
