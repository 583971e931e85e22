#!/usr/bin/env bash
# Issue 63's fault corpus (the table CASES in tests/it/fault_corpus.rs): runs the test behind
# every case and reports handled/total. A case counts only when its test passes (a Hub lie:
# when hub_faults' test, which runs every lie, passes); an Open case never counts.
#   scripts/fault_corpus.sh
set -euo pipefail
cd "$(dirname "$0")/.."
table=tests/it/fault_corpus.rs
hub=hub_faults::a_lying_hub_is_caught_in_every_way_and_nothing_false_is_cached
mapfile -t tests < <(grep -o 'Test("[^"]*")' "$table" | sed 's/^Test("\(.*\)")$/\1/' | sort -u)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release --locked --test it -- --exact "${tests[@]}" "$hub" >"$log" 2>&1 || true
passed() { grep -q "^test $1 \.\.\. ok$" "$log"; }
total=0
handled=0
while IFS= read -r line; do
    total=$((total + 1))
    if [[ $line =~ Test\(\"([^\"]*)\"\) ]]; then
        if passed "${BASH_REMATCH[1]}"; then handled=$((handled + 1)); else echo "not handled: $line"; fi
    elif [[ $line =~ Lie\( ]]; then
        if passed "$hub"; then handled=$((handled + 1)); else echo "not handled: $line"; fi
    else
        echo "open: $line"
    fi
done < <(grep -E '^    \("' "$table")
echo "fault corpus: $handled/$total handled"
