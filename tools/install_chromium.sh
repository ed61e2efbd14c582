#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium for the browser test (tests/test_browser.py).
# Idempotent and quiet: does nothing when it is already there; otherwise apt-get installs it
# (as root, or through sudo when that works without a password). Never downloads a browser
# through Playwright. Exit status 0 when /usr/bin/chromium exists at the end.
set -euo pipefail
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  echo "install_chromium: $CHROMIUM is missing and this user cannot run apt-get;" \
       "install it with: sudo apt-get install -y chromium" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium: no apt-get here; install Chromium so that $CHROMIUM exists" >&2
  exit 1
fi
echo "install_chromium: installing Debian's chromium (about a minute)"
export DEBIAN_FRONTEND=noninteractive
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
if ! { $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends chromium; } >"$LOG" 2>&1; then
  tail -n 20 "$LOG" >&2
  echo "install_chromium: apt-get failed (log above)" >&2
  exit 1
fi
if [ ! -x "$CHROMIUM" ]; then
  echo "install_chromium: apt-get finished but $CHROMIUM is still missing" >&2
  exit 1
fi
echo "install_chromium: $("$CHROMIUM" --version 2>/dev/null || echo chromium) installed"
