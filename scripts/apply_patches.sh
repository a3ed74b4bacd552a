#!/usr/bin/env bash
# Apply, check or revert the megatron-paging source patches on a vendored Megatron-Core 0.19.2.
#
#   bash scripts/apply_patches.sh apply  [SITE]   # patch the sources in place
#   bash scripts/apply_patches.sh check  [SITE]   # exit 0 if they apply (or are applied) cleanly
#   bash scripts/apply_patches.sh revert [SITE]   # restore the original sources
#
# SITE is the directory that contains megatron/ (a Megatron-LM checkout, or a site-packages
# folder). Without it, the megatron-core 0.19.2 installed for the project's interpreter is
# patched: the repository's .venv/bin/python (what `make venv` / `make test` create), else
# $PYTHON; with neither, or without megatron-core 0.19.2 there, the script says so in one line
# and exits 2. The patched Megatron-Core calls megatron_paging exactly as install() wires it:
# the paged-stash API and PagedStashRunner delegate to megatron_paging (MEGATRON_PAGING=0 keeps
# Megatron-Core's own), MoELayer builds megatron_paging's flex dispatcher (adds backend 'static'),
# TransformerConfig accepts moe_flex_dispatcher_backend='static', and combined 1F1B's schedule
# nodes keep the inputs that backend passes through (as for HybridEP).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MCORE_VERSION=0.19.2
PATCHES=("$ROOT"/patches/megatron-core-$MCORE_VERSION/*.patch)
action=${1:-}
usage="usage: $0 {apply|check|revert} [SITE]  (SITE: the folder that contains megatron/)"

die2() { echo "apply_patches.sh: $*" >&2; exit 2; }

case $action in
  apply | check | revert) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
[ $# -le 2 ] || { echo "$usage" >&2; exit 2; }

installed_site() {  # print the folder holding the interpreter's megatron/, or die in one line
  local python="" how hint out
  hint="run \`make venv\` (or \`make test\`) in $ROOT first, which creates .venv with megatron-core $MCORE_VERSION, or pass the Megatron-LM folder: $0 $action /path/to/Megatron-LM"
  if [ -x "$ROOT/.venv/bin/python" ]; then
    python=$ROOT/.venv/bin/python how="$ROOT/.venv/bin/python"
  elif [ -n "${PYTHON:-}" ]; then
    python=$PYTHON how="\$PYTHON=$PYTHON"
  else
    die2 "no project interpreter ($ROOT/.venv/bin/python missing, \$PYTHON unset); $hint"
  fi
  # Metadata and find_spec only: megatron (and torch) are not imported, so this is fast.
  out=$("$python" -c '
import importlib.metadata as md, importlib.util, os, sys
if sys.path[:1] == [""]:
    del sys.path[0]  # not a megatron/ that happens to lie in the current folder
try:
    version = md.version("megatron-core")
    spec = importlib.util.find_spec("megatron")
except (md.PackageNotFoundError, ImportError):
    version, spec = "missing", None
paths = list(spec.submodule_search_locations or []) if spec else []
print(version if paths else "missing", os.path.dirname(os.path.abspath(paths[0])) if paths else "")
' 2>/dev/null) || die2 "$how does not run; $hint"
  case $out in
    "$MCORE_VERSION "*) echo "${out#* }" ;;
    missing*) die2 "no megatron-core found for $how; $hint" ;;
    *) die2 "$how has megatron-core ${out%% *}, these patches are for $MCORE_VERSION; $hint" ;;
  esac
}

command -v patch >/dev/null || die2 "needs the patch program (e.g. apt-get install patch)"
if [ $# -ge 2 ]; then SITE=$2; else SITE=$(installed_site); fi
[ -d "$SITE/megatron" ] || { echo "error: $SITE has no megatron/ directory" >&2; exit 2; }

applied() {  # all patches reverse-apply cleanly = already applied
  for p in "${PATCHES[@]}"; do patch -p1 -d "$SITE" -R --dry-run -s -f <"$p" >/dev/null || return 1; done
}

case $action in
  apply)
    if applied; then echo "already applied in $SITE"; exit 0; fi
    # Every patch is tried first, so a failing one leaves the sources untouched.
    for p in "${PATCHES[@]}"; do
      patch -p1 -d "$SITE" --dry-run -s -f <"$p" >/dev/null \
        || { echo "apply_patches.sh: does not apply: $(basename "$p") (nothing changed in $SITE)" >&2; exit 1; }
    done
    for p in "${PATCHES[@]}"; do patch -p1 -d "$SITE" -s -f --no-backup-if-mismatch <"$p"; done
    echo "applied ${#PATCHES[@]} patches in $SITE" ;;
  check)
    if applied; then echo "applied in $SITE"; exit 0; fi
    for p in "${PATCHES[@]}"; do
      patch -p1 -d "$SITE" --dry-run -s -f <"$p" >/dev/null \
        || { echo "does not apply: $(basename "$p")" >&2; exit 1; }
    done
    echo "not applied; all ${#PATCHES[@]} patches apply cleanly to $SITE" ;;
  revert)
    if ! applied; then echo "not applied in $SITE"; exit 0; fi
    for p in "${PATCHES[@]}"; do patch -p1 -d "$SITE" -R -s -f --no-backup-if-mismatch <"$p"; done
    echo "reverted ${#PATCHES[@]} patches in $SITE" ;;
esac
