#!/usr/bin/env bash
# Byte-for-byte comparison of Prism's JSON outputs between a git revision and the working tree:
# `prism simulate --json`, `prism predict --json` (default job, both examples, a pruning job;
# fixed seed), `prism explore --json` on a small job (deterministic and sampled), and the
# DeepSeek-V3 example, `prism geo plan` and `prism resilience` on their examples.
#
#   scripts/compare-outputs.sh REV [EXTRA_EXPLORE_ARGS_FOR_THE_WORKING_TREE...]
#
# Builds REV in a temporary worktree (release), runs both binaries on the same commands and
# prints SAME or DIFF per output; exits 1 on any difference. Extra arguments are appended to the
# working tree's sampled `explore` command only (e.g. `--clusters 6` where the default changed).
set -euo pipefail
rev=${1:?usage: scripts/compare-outputs.sh REV [explore args]}
shift
root=$(git rev-parse --show-toplevel)
cd "$root"
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach "$tmp/base" "$rev" >/dev/null 2>&1
(cd "$tmp/base" && cargo build --release --quiet)
cargo build --release --quiet
data=crates/prism-cli/tests/data
{ cat "$data/explore.toml"; echo; sed -n '/^\[variability\]/,$p' "$data/variability.toml"; } > "$tmp/explore-var.toml"

run_all() { # binary outdir extra-explore-args...
  local p=$1 o=$2; shift 2
  mkdir -p "$o"
  "$p" simulate --json > "$o/simulate.json"
  "$p" predict --json --tokens 15e12 --seed 7 > "$o/predict-default.json" 2>/dev/null
  "$p" predict --json examples/llama3-405b-16k-variability.toml --tokens 15e12 --samples 60 --seed 7 > "$o/predict-16k.json" 2>/dev/null
  "$p" predict --json examples/llama3-405b-64k-variability.toml --tokens 15e12 --samples 40 --seed 7 > "$o/predict-64k.json" 2>/dev/null
  "$p" predict --json "$data/pruning.toml" --tokens 1e9 --samples 30 > "$o/predict-pruning.json" 2>/dev/null
  "$p" explore --json "$data/explore.toml" > "$o/explore-det.json" 2>/dev/null
  "$p" explore --json "$tmp/explore-var.toml" --samples 6 --objective p99 --top 0 "$@" > "$o/explore-var.json" 2>/dev/null
  # Capabilities added later: an older revision without them writes an empty file.
  "$p" simulate --json --allow-oom examples/deepseek-v3-2048-h800.toml > "$o/simulate-deepseek-v3.json" 2>/dev/null || true
  "$p" geo plan --json examples/geo-llama3-70b-2dc.toml > "$o/geo-plan-70b.json" 2>/dev/null || true
  "$p" resilience --json examples/resilience/llama70b-256-a100.toml --scenario examples/resilience/mixed-6h.toml > "$o/resilience-mixed.json" 2>/dev/null || true
}
run_all "$tmp/base/target/release/prism" "$tmp/before"
run_all target/release/prism "$tmp/after" "$@"
status=0
for f in "$tmp/before"/*.json; do
  name=$(basename "$f")
  if cmp -s "$f" "$tmp/after/$name"; then echo "SAME $name"; else echo "DIFF $name"; status=1; fi
done
exit $status
