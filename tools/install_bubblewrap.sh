#!/usr/bin/env bash
# bubblewrap, the boundary of the Python tool's sandbox (rlhf/tools/isolation.py), from the
# system's packages: called by `make setup` when `bwrap` is missing. Without root or a
# known package manager it says what to install and stops setup.
set -euo pipefail
command -v bwrap >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
elif [ "$(id -u)" = 0 ] && command -v dnf >/dev/null; then
    dnf install -y -q bubblewrap
fi
command -v bwrap >/dev/null && exit 0
echo "setup: install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install bubblewrap): the Python tool's sandbox needs it" >&2
exit 1
