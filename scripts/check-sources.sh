#!/usr/bin/env bash
# Rules about Relay's sources that no compiler checks, run by CTest (test "source_rules") in every
# build. Each rule prints the offending lines and the reason; the script fails if any rule does.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0

# 1. Every JSON text is parsed through core/json.h's parse_json / parse_json_file, which refuse
#    nesting deeper than kMaxJsonDepth before anything recursive walks the result (a 20,000-level
#    request body once crashed the server). nlohmann's own parse is called only there.
if hits=$(grep -rnE '(json|ordered_json|Json)::parse\(' src --include='*.cpp' --include='*.h' \
            --include='*.cu' --include='*.cuh' | grep -v '^src/core/json\.h:'); then
  echo "check-sources: parse JSON with relay::parse_json (src/core/json.h), not nlohmann's parse:"
  echo "$hits"
  status=1
fi

exit $status
