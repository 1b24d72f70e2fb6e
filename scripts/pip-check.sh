#!/usr/bin/env bash
# The package as Python users install it (test.sh runs this): pip install of the checkout into a
# fresh virtual environment of /usr/bin/python3 (scripts/pip-install.sh; meson-python builds in
# build-pip/), then, with neither PYTHONPATH nor LD_LIBRARY_PATH, a save, a load and the tool's
# verify and --version from that environment, the versions agreeing; the bundled library found
# through the extension's $ORIGIN rpath, the tool needing none; the refusals of a venv without pip
# and of a machine without the C++ compiler. Then the same package into build/peers-venv (torch 2.x,
# for tests/torch2) when that environment exists. Prints "pip: N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() {  # what, command...
  local what=$1; shift
  if "$@" > "$work/out" 2>&1; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "pip: FAILED: $what"; tail -30 "$work/out"; fi
}
clean() { env -u PYTHONPATH -u LD_LIBRARY_PATH -u PYTHONHOME "$@"; }

/usr/bin/python3 -m venv "$work/v"
check "pip install . into a fresh venv" clean scripts/pip-install.sh "$work/v" --config-settings=compile-args=-j2
cat > "$work/roundtrip.py" <<'PY'
import importlib.metadata, subprocess, sys
import numpy as np
import shardckpt
path = sys.argv[1]
assert "site-packages" in shardckpt.__file__, shardckpt.__file__
w = np.arange(24, dtype=np.float32).reshape(6, 4)
state = shardckpt.StateDict()
state.add(shardckpt.ShardedTensor("layer.weight", w, [6, 4], [0, 0]))
state.add_common("step", 7)
shardckpt.save(state, path)
into = np.zeros_like(w)
request = shardckpt.StateDict()
request.add(shardckpt.ShardedTensor("layer.weight", into, [6, 4], [0, 0]))
values = shardckpt.load_into(path, request)
assert (into == w).all() and values["step"] == 7, values
meta = importlib.metadata.version("shardckpt")
tool = subprocess.run([sys.argv[2], "--version"], capture_output=True, text=True, check=True).stdout
assert shardckpt.__version__ == meta and f"shardckpt {meta} " in tool, (shardckpt.__version__, meta, tool)
print(f"shardckpt {meta}: saved, loaded; {tool.strip()}")
PY
check "a save and a load from the venv, versions agreeing" clean "$work/v/bin/python" "$work/roundtrip.py" "$work/c.h5" "$work/v/bin/shardckpt"
check "the venv's tool verifies the checkpoint" clean "$work/v/bin/shardckpt" verify "$work/c.h5"
core=$(ls "$work"/v/lib/python3*/site-packages/shardckpt/_core*.so 2>/dev/null | head -1)
check "the extension finds the bundled library through \$ORIGIN" \
  bash -c "readelf -d '$core' | grep -q 'RUNPATH.*\$ORIGIN/../.shardckpt.mesonpy.libs' && ls $work/v/lib/python3*/site-packages/.shardckpt.mesonpy.libs/libshardckpt.so.0"
check "the tool needs no libshardckpt.so" bash -c "! readelf -d '$work/v/bin/shardckpt' | grep -q 'NEEDED.*libshardckpt'"

/usr/bin/python3 -m venv --without-pip "$work/nopip"
check "a venv without pip: one line saying what to do" \
  bash -c "! scripts/pip-install.sh '$work/nopip' 2> '$work/err' && grep -q 'ensurepip' '$work/err' && [ \$(wc -l < '$work/err') -eq 1 ]"
printf "[binaries]\ncpp = 'no-such-clang++'\n" > "$work/none.ini"
check "no C++ compiler: meson says what to install" \
  bash -c "! meson setup '$work/nocxx' --native-file '$work/none.ini' > '$work/setup.log' 2>&1 && grep -q 'apt-get install clang-19' '$work/setup.log'"

if [ -x build/peers-venv/bin/python ]; then
  check "the same package into build/peers-venv" clean scripts/pip-install.sh build/peers-venv
  check "build/peers-venv imports the installed package" \
    clean build/peers-venv/bin/python -c "import shardckpt; assert 'site-packages' in shardckpt.__file__, shardckpt.__file__"
fi
echo "pip: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
