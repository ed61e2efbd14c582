#!/usr/bin/env bash
# A Chromium for the browser test (tests/test_browser.py), without ever needing root when one is there.
#
#  1. A Chromium that is already there is used: $CHROMIUM when set (that path only: this script
#     then never installs), else the first of /usr/bin/chromium, chromium, chromium-browser,
#     google-chrome-stable, google-chrome on PATH.
#  2. Otherwise Debian's chromium is installed with apt-get when this user can (root, or sudo
#     without a password) and COURSE_INSTALL_CHROMIUM is not 0.
#  3. Otherwise one line says why, and the browser test will be skipped with that reason; exit 0,
#     except with CI=true, where a missing browser is a failure (exit 1).
# Never downloads a browser through Playwright. Prints the browser's path on success (stdout).
set -euo pipefail
is_ci() { case "${CI:-}" in true|True|TRUE|1|yes) return 0 ;; *) return 1 ;; esac; }
missing() {
  if is_ci; then
    echo "install_chromium: $1; CI=true: the browser test must run, so this is a failure" >&2
    exit 1
  fi
  echo "install_chromium: $1; the browser test will be skipped (as root: bash tools/install_chromium.sh," \
       "or sudo apt-get install -y chromium)" >&2
  exit 0
}
find_chromium() {
  if [ -n "${CHROMIUM:-}" ]; then
    [ -x "$CHROMIUM" ] && echo "$CHROMIUM"
    return 0
  fi
  if [ -x /usr/bin/chromium ]; then echo /usr/bin/chromium; return 0; fi
  for name in chromium chromium-browser google-chrome-stable google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
  done
}

found=$(find_chromium)
if [ -n "$found" ]; then
  echo "$found"
  exit 0
fi
if [ -n "${CHROMIUM:-}" ]; then
  missing "CHROMIUM=$CHROMIUM is not an executable (set CHROMIUM to a Chromium, or unset it)"
fi
if [ "${COURSE_INSTALL_CHROMIUM:-1}" = 0 ]; then
  missing "no Chromium found and COURSE_INSTALL_CHROMIUM=0"
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  missing "no Chromium found, and this user cannot install one (not root, no passwordless sudo)"
fi
if ! command -v apt-get >/dev/null 2>&1; then
  missing "no Chromium found and no apt-get to install Debian's"
fi
echo "install_chromium: installing Debian's chromium (about a minute)" >&2
export DEBIAN_FRONTEND=noninteractive
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
if ! { $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends chromium; } >"$LOG" 2>&1; then
  tail -n 20 "$LOG" >&2
  missing "apt-get could not install chromium (log above)"
fi
if [ ! -x /usr/bin/chromium ]; then
  missing "apt-get finished but /usr/bin/chromium is still missing"
fi
echo "install_chromium: $(/usr/bin/chromium --version 2>/dev/null || echo chromium) installed" >&2
echo /usr/bin/chromium
