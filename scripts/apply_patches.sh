#!/usr/bin/env bash
# Apply, check or revert the megatron-paging source patches on a vendored Megatron-Core 0.19.2.
#
#   bash scripts/apply_patches.sh apply  [SITE]   # patch the sources in place
#   bash scripts/apply_patches.sh check  [SITE]   # exit 0 if they apply (or are applied) cleanly
#   bash scripts/apply_patches.sh revert [SITE]   # restore the original sources
#
# SITE is the directory that contains megatron/ (default: where `python3 -c "import megatron"`
# finds it). The patched Megatron-Core calls megatron_paging exactly as install() wires it:
# the paged-stash API and PagedStashRunner delegate to megatron_paging (MEGATRON_PAGING=0 keeps
# Megatron-Core's own), MoELayer builds megatron_paging's flex dispatcher (adds backend 'static'),
# and TransformerConfig accepts moe_flex_dispatcher_backend='static'.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCHES=("$ROOT"/patches/megatron-core-0.19.2/*.patch)
action=${1:-}
SITE=${2:-$(${PYTHON:-python3} -c 'import os, megatron; print(os.path.dirname(os.path.dirname(os.path.abspath(megatron.__file__))))')}
[ -d "$SITE/megatron" ] || { echo "error: $SITE has no megatron/ directory" >&2; exit 2; }

applied() {  # all patches reverse-apply cleanly = already applied
  for p in "${PATCHES[@]}"; do patch -p1 -d "$SITE" -R --dry-run -s -f <"$p" >/dev/null || return 1; done
}

case $action in
  apply)
    if applied; then echo "already applied in $SITE"; exit 0; fi
    for p in "${PATCHES[@]}"; do patch -p1 -d "$SITE" --dry-run -s -f <"$p" >/dev/null; done
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
  *) echo "usage: $0 {apply|check|revert} [SITE]" >&2; exit 2 ;;
esac
