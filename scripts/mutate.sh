#!/usr/bin/env bash
# make mutate: mutation testing of the core modules with mutmut (docs/testing.md).
#
#   scripts/mutate.sh                         # every core module (windowkit/kv, windowkit/store, windowkit/graph)
#   scripts/mutate.sh windowkit/store/keys.py # one module
#
# Works on a copy in build/mutate/ (mutmut writes mutants/ next to its config); prints, per module, the
# mutants killed / total and the kill rate, and fails when a module is below MUTATE_MIN (default 85%).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VPY="${VPY:-$ROOT/.venv/bin/python}"
WORK="${MUTATE_DIR:-$ROOT/build/mutate}"
MIN="${MUTATE_MIN:-85}"
MODULES=("$@")
if [ ${#MODULES[@]} -eq 0 ]; then
  MODULES=(windowkit/kv/*.py windowkit/store/*.py windowkit/graph/*.py)
fi

# the tests that cover each core package (fast ones; the hypothesis machines run in their quick profile)
tests_for() {
  case "$1" in
    windowkit/kv/*) echo "tests/test_kv_operator.py tests/test_defaults.py tests/test_isvd.py tests/test_basis.py" ;;
    windowkit/store/*) echo "tests/test_keys.py tests/test_store.py tests/test_cold_tier.py" ;;
    windowkit/graph/*) echo "tests/test_graph.py" ;;
    *) echo "tests" ;;
  esac
}

fail=0
for mod in "${MODULES[@]}"; do
  case "$mod" in */__init__.py) continue ;; esac
  rm -rf "$WORK" && mkdir -p "$WORK"
  (cd "$ROOT" && tar -cf - --exclude=__pycache__ windowkit policies agents examples tests pyproject.toml) | tar -xf - -C "$WORK"
  {
    cat "$ROOT/mutate/mutmut.cfg"
    echo "only_mutate = $mod"
    echo "pytest_add_cli_args_test_selection ="
    for t in $(tests_for "$mod"); do echo "    $t"; done
  } > "$WORK/setup.cfg"
  echo "== $mod ($(tests_for "$mod"))"
  (cd "$WORK" && OMP_NUM_THREADS=1 WINDOWKIT_TEST_PROFILE=quick "$VPY" -m mutmut run > mutmut-run.log 2>&1) || true
  (cd "$WORK" && "$VPY" -m mutmut export-cicd-stats > /dev/null 2>&1) || true
  stats="$WORK/mutants/mutmut-cicd-stats.json"
  if [ ! -f "$stats" ]; then
    echo "   mutmut produced no stats; see $WORK/mutmut-run.log"; tail -5 "$WORK/mutmut-run.log"; fail=1; continue
  fi
  "$VPY" - "$stats" "$MIN" "$mod" <<'PY' || fail=1
import json, sys
s = json.load(open(sys.argv[1]))
killed, total = s.get("killed", 0) + s.get("timeout", 0), s.get("total", 0)
rate = 100.0 * killed / total if total else 100.0
print(f"   {sys.argv[3]}: killed {killed} / {total} mutants ({rate:.1f}%); survived {s.get('survived', 0)}, "
      f"no tests {s.get('no_tests', 0)}, suspicious {s.get('suspicious', 0)}")
sys.exit(0 if rate >= float(sys.argv[2]) else 1)
PY
  (cd "$WORK" && "$VPY" -m mutmut results 2>/dev/null | head -40) || true
done
exit $fail
