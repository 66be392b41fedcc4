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

# 2. Includes follow the layers of docs/architecture.md: a module (a folder of src/) includes only
#    modules of lower layers, so no two modules depend on each other and a change in one layer
#    can only break the layers above it. .cu and .cuh files count too.
if ! python3 - <<'PY'
import os
import re
import sys

LAYERS = [
    ["core"],
    ["tokenizer", "chat", "http", "parallel", "kvcache", "sequence", "kernels", "speculative"],
    ["quant", "grammar", "transfer"],
    ["model"],
    ["scheduler"],
    ["engine"],
    ["server", "convert"],
    ["disagg"],
    ["cli"],
]

level = {m: i for i, layer in enumerate(LAYERS) for m in layer}
bad = []
for root, _, files in os.walk("src"):
    for name in sorted(files):
        if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
            continue
        path = os.path.join(root, name)
        module = path.split(os.sep)[1]
        if module not in level:
            bad.append(f"{path}: module '{module}' is in no layer (add it to scripts/check-sources.sh "
                       "and docs/architecture.md)")
            continue
        with open(path, errors="replace") as f:
            for number, line in enumerate(f, 1):
                m = re.match(r'\s*#\s*include\s+"([a-z0-9_]+)/', line)
                if not m or m.group(1) == module or m.group(1) not in level:
                    continue
                if level[m.group(1)] >= level[module]:
                    bad.append(f"{path}:{number}: {module} (layer {level[module]}) includes "
                               f"{m.group(1)} (layer {level[m.group(1)]}): {line.strip()}")
if bad:
    print("check-sources: includes against the layers of docs/architecture.md:")
    print("\n".join(bad))
    sys.exit(1)
PY
then
  status=1
fi

# 3. One definition per model architecture (model/decoder_plan.h and the builders of
#    model/architectures.h): architecture names and checkpoint tensor names are spelled in
#    src/model only, so a backend builds from the plan instead of its own copy of the model.
if hits=$(grep -rnE 'For(CausalLM|ConditionalGeneration)' src --include='*.cpp' --include='*.h' \
            --include='*.cu' --include='*.cuh' | grep -v '^src/model/'); then
  echo "check-sources: architecture names belong in src/model (model/registry.cpp):"
  echo "$hits"
  status=1
fi
if hits=$(grep -rnE '"[^"]*(_proj|layernorm|embed_tokens|lm_head|norm)\.(weight|bias)"|"model\.layers' \
            src/engine src/kernels src/server src/disagg src/cli 2>/dev/null); then
  echo "check-sources: checkpoint tensor names belong in src/model (model/decoder_plan.h):"
  echo "$hits"
  status=1
fi

# 4. No source file over 1,000 lines: past that a file holds several concerns, which get their own
#    files (as engine/cuda/ splits the CUDA backend's rank).
if hits=$(find src -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort |
            xargs wc -l | awk '$2 != "total" && $1 > 1000 {print $2 ": " $1 " lines"}' | grep .); then
  echo "check-sources: files over 1,000 lines (split them by concern):"
  echo "$hits"
  status=1
fi

exit $status
