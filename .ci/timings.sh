# Sourced by the CI scripts (`. .ci/timings.sh NAME`): `begin "what"` and
# `end` around each step, `report_timings` to print each step's time.
timings=()
timings_of=$1
begin() { step=$1; step_start=$SECONDS; echo "$timings_of: $step"; }
end() { timings+=("$((SECONDS - step_start)) s  $step"); }
report_timings() { echo "$timings_of timings${1:-}:"; printf '  %s\n' "${timings[@]}"; }
