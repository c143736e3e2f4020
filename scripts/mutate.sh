#!/usr/bin/env bash
# make mutate: mutation testing of the core modules with mutmut (docs/testing.md, "Mutation testing").
#
#   scripts/mutate.sh                            # every core module: windowkit/kv, graph, window/plan.py, store
#   scripts/mutate.sh windowkit/store/keys.py    # one module (several may be named)
#
# Each module is run in its own copy of the project, build/mutate/<module>/ (mutmut writes mutants/ next to its
# config), so its survivors can be looked at afterwards:
#
#   cd build/mutate/windowkit_store_keys && ../../../.venv/bin/python -m mutmut show <mutant name>
#
# Prints, per module, the mutants killed / total and the kill rate (a timeout counts as killed; a mutant no
# selected test reaches counts as not killed), merges the module's row into bench/results/mutation.json
# (killed/total/survived/no_tests/timeouts, the survivors' names, seconds, date, git HEAD, whether the module
# differed from HEAD when it was run) and rewrites bench/results/mutation.md from it, so modules can be run
# one at a time. Fails when a module is below MUTATE_MIN (default 85%).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VPY="${VPY:-$ROOT/.venv/bin/python}"
WORK="${MUTATE_DIR:-$ROOT/build/mutate}"
MIN="${MUTATE_MIN:-85}"
REPORT="${MUTATE_REPORT:-$ROOT/bench/results/mutation.json}"
MODULES=("$@")
if [ ${#MODULES[@]} -eq 0 ]; then
  MODULES=(windowkit/kv/*.py windowkit/graph/*.py windowkit/window/plan.py windowkit/store/*.py)
fi

# the tests that cover each core module (fast ones: mutmut runs them per mutant; the hypothesis machines run
# in their quick profile)
tests_for() {
  case "$1" in
    windowkit/kv/*) echo "tests/test_kv_operator.py tests/test_defaults.py tests/test_isvd.py tests/test_basis.py tests/test_kv_mutants.py" ;;
    # the Mooncake backend: its tests against a real loopback mooncake_master (tests/store_helpers.py's fixtures)
    # and the survivors' tests (fake clients for the return codes, plus the real master)
    windowkit/store/mooncake.py) echo "tests/test_mooncake.py tests/test_mooncake_mutants.py" ;;
    windowkit/store/*) echo "tests/test_keys.py tests/test_store.py tests/test_cold_tier.py tests/test_store_mutants.py" ;;
    windowkit/graph/*) echo "tests/test_graph.py tests/test_graph_mutants.py" ;;
    windowkit/window/plan.py) echo "tests/test_planner.py tests/test_plan_mutants.py tests/test_simulate.py" ;;
    *) echo "tests" ;;
  esac
}

# extra pytest arguments per package (one per line in setup.cfg): the store's two cross-process reopen tests
# spend ~8 s each starting a fresh interpreter; the in-process reopen tests cover the same code
extra_args_for() {
  case "$1" in
    # mooncake.py: test_mooncake.py's slow tests left out (run per mutant they cost ~30 s of the file's ~36 s, and
    # 3 s more each for the tiny model they build): a second interpreter sharing the tier, the holder killed (~8 s
    # of reconnects), the master killed mid-run, 8 threads x 1000 values, and the three store-level tests on the
    # tiny model (bit-identical round trip, corrupt value recomputed, frozen master). The backend code they reach
    # (return codes, counters, the breaker, the timeout, the "missing" read, corrupt values dropped) is checked
    # call by call in tests/test_mooncake_mutants.py, with a client that answers given codes
    windowkit/store/mooncake.py) printf '%s\n' "-k" "not two_processes_share and not lost_with_their_holder and not master_killed_mid_run and not load_8_threads and not store_round_trip_is_bit_identical and not corrupt_mooncake_value and not frozen_master" ;;
    windowkit/store/*) printf '%s\n' "-k" "not reopen_in_another_process and not disk_reopen_in_new_process" ;;
  esac
}

# extra mutmut settings per module (appended to setup.cfg). mooncake.py: the tests run Mooncake's native client,
# whose threads do not survive a fork: a mutant forked from mutmut's main process (which ran the stats and clean
# runs) hangs in its first client call, so every mutant reached by those tests would "time out". The fork server
# forks each mutant from a process that has only imported and collected the tests.
cfg_for() {
  case "$1" in
    windowkit/store/mooncake.py) echo "process_isolation = forkserver" ;;
  esac
}

# a mutant killed on timeout leaves its LocalMooncake (master + holder, own sessions) behind: end those started in
# this module's copy (their working directory), nothing else
reap_mooncake() {
  local p c
  for p in $(pgrep -f 'mooncake_(master|client)' 2>/dev/null || true); do
    c="$(readlink "/proc/$p/cwd" 2>/dev/null || true)"
    case "$c" in "$1"|"$1"/*) kill -9 "$p" 2>/dev/null || true ;; esac
  done
}

fail=0
for mod in "${MODULES[@]}"; do
  case "$mod" in */__init__.py) continue ;; esac
  [ -f "$ROOT/$mod" ] || { echo "no such module: $mod"; fail=1; continue; }
  tests=""
  for t in $(tests_for "$mod"); do [ -e "$ROOT/$t" ] && tests="$tests $t"; done
  slug="$(echo "${mod%.py}" | tr '/' '_')"
  dir="$WORK/$slug"
  rm -rf "$dir" && mkdir -p "$dir"
  (cd "$ROOT" && tar -cf - --exclude=__pycache__ windowkit policies agents examples tests docs bench/traces pyproject.toml) | tar -xf - -C "$dir"
  # a killed mutant needs only the first failing example: no hypothesis shrinking (it can take minutes per
  # mutant on the stateful machines); loaded by pytest_add_cli_args in mutate/mutmut.cfg
  cat > "$dir/mutate_fast_fail.py" <<'PYPLUGIN'
from hypothesis import Phase, settings

settings.register_profile("mutate", phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=False)
settings.load_profile("mutate")
PYPLUGIN
  {
    cat "$ROOT/mutate/mutmut.cfg"
    cfg_for "$mod"
    echo "only_mutate = $mod"
    echo "pytest_add_cli_args_test_selection ="
    for t in $tests; do echo "    $t"; done
    extra_args_for "$mod" | while IFS= read -r a; do echo "    $a"; done
  } > "$dir/setup.cfg"
  echo "== $mod ($tests $(extra_args_for "$mod" | tr '\n' ' '))"
  t0=$(date +%s)
  (cd "$dir" && OMP_NUM_THREADS=1 WINDOWKIT_TEST_PROFILE=quick "$VPY" -m mutmut run > mutmut-run.log 2>&1) || true
  secs=$(( $(date +%s) - t0 ))
  reap_mooncake "$dir"
  (cd "$dir" && "$VPY" -m mutmut export-cicd-stats > /dev/null 2>&1) || true
  stats="$dir/mutants/mutmut-cicd-stats.json"
  if [ ! -f "$stats" ]; then
    echo "   mutmut produced no stats; see $dir/mutmut-run.log"; tail -5 "$dir/mutmut-run.log"; fail=1; continue
  fi
  (cd "$dir" && "$VPY" -m mutmut results 2>/dev/null) > "$dir/results.txt" || true
  dirty=false
  (cd "$ROOT" && git diff --quiet HEAD -- "$mod" 2>/dev/null) || dirty=true
  head_sha="$(cd "$ROOT" && git rev-parse HEAD 2>/dev/null || echo unknown)"
  "$VPY" - "$stats" "$dir/results.txt" "$REPORT" "$MIN" "$mod" "$secs" "$head_sha" "$dirty" "$tests" "$(extra_args_for "$mod" | tr '\n' ' ')" <<'PY' || fail=1
import datetime, json, os, sys
from pathlib import Path

stats, results, report, min_pct, mod, secs, head, dirty, tests, extra = sys.argv[1:11]
s = json.load(open(stats))
status = {}
for line in open(results):
    name, _, st = line.strip().rpartition(": ")
    if name:
        status[name] = st
killed, timeouts, total = s.get("killed", 0), s.get("timeout", 0), s.get("total", 0)
rate = 100.0 * (killed + timeouts) / total if total else 100.0
row = {
    "killed": killed + timeouts, "total": total, "percent": round(rate, 1), "survived": s.get("survived", 0),
    "no_tests": s.get("no_tests", 0), "timeouts": timeouts, "suspicious": s.get("suspicious", 0),
    "skipped": s.get("skipped", 0), "not_killed": sorted(f"{n}: {st}" for n, st in status.items() if st != "timeout"),
    "seconds": int(secs), "tests": tests.split(), "pytest_extra": extra.strip(),
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "git_head": head, "module_differs_from_head": dirty == "true",
}
print(f"   {mod}: killed {row['killed']} / {total} mutants ({rate:.1f}%) in {secs} s; survived {row['survived']}, "
      f"no tests {row['no_tests']}, timeouts {timeouts}, suspicious {row['suspicious']}")
for n in row["not_killed"]:
    print(f"      {n}")

path = Path(report)
doc = json.loads(path.read_text()) if path.exists() else {}
doc.update({"tool": "mutmut 3.8.1", "min_percent": float(min_pct),
            "score": "killed / total; killed includes timeouts, total includes mutants no selected test reaches",
            "reproduce": "make mutate MUTATE_ONLY=<module>   (scripts/mutate.sh <module> ...)"})
doc.setdefault("modules", {})[mod] = row
doc["modules"] = dict(sorted(doc["modules"].items()))
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(doc, indent=1) + "\n")

md = ["# Mutation score (`make mutate`, mutmut 3.8.1)", "",
      f"Written by scripts/mutate.sh from {path.name}; target >= {float(min_pct):g}% killed per module. A timeout "
      "counts as killed; a mutant no selected test reaches counts against the module. docs/testing.md lists "
      "the survivors that are equivalent, with the reason.", "",
      "| module | killed / total | % | survived | no tests | timeouts | time | date (UTC) | git HEAD | tests |",
      "|---|---|---|---|---|---|---|---|---|---|"]
for m, r in doc["modules"].items():
    head_s = r["git_head"][:10] + (" + local edits" if r.get("module_differs_from_head") else "")
    md.append(f"| {m} | {r['killed']} / {r['total']} | {r['percent']:.1f} | {r['survived']} | {r['no_tests']} | "
              f"{r['timeouts']} | {r['seconds']} s | {r['date']} | {head_s} | {' '.join(Path(t).name for t in r['tests'])} |")
md += ["", "Not killed:", ""]
for m, r in doc["modules"].items():
    md += [f"* `{n}`" for n in r["not_killed"]]
path.with_suffix(".md").write_text("\n".join(md) + "\n")
sys.exit(0 if rate >= float(min_pct) else 1)
PY
done
exit $fail
