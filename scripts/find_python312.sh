#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter, or explain why there is none and fail.
# Order: $PYTHON312, python3.12 on PATH, pyenv's 3.12.x (its shim needs PYENV_VERSION outside a
# folder with .python-version, so ask pyenv for the real path).
set -u
is312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
for cand in "${PYTHON312:-}" "$(command -v python3.12 2>/dev/null)"; do
  if is312 "$cand"; then echo "$cand"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for v in $(ls -1 "$root/versions" 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -t. -k3 -n -r); do
    cand="$root/versions/$v/bin/python3.12"
    if is312 "$cand"; then echo "$cand"; exit 0; fi
  done
fi
for cand in /usr/bin/python3.12 /usr/local/bin/python3.12; do
  if is312 "$cand"; then echo "$cand"; exit 0; fi
done
echo "error: no Python 3.12 interpreter found (tried \$PYTHON312, python3.12 on PATH, pyenv versions 3.12.*, /usr/bin, /usr/local/bin); install Python 3.12 or set PYTHON312=/path/to/python3.12" >&2
exit 1
