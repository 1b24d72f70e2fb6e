#!/usr/bin/env python3
"""Compile-failure tests: every snippet in tests/compile_fail/ that says `// rejects: TEXT` must fail
to compile with a diagnostic containing TEXT (so that it fails for the reason it claims, not for a
typo), and a snippet that says nothing (accepts.cpp) must compile. Usage: compile_fail_test.py
COMPILER FLAGS... -- DIRECTORY|SNIPPET... (a directory stands for every .cpp in it; run in the
build directory, where the module map's paths point)."""
import glob
import os
import subprocess
import sys


def main():
    sep = sys.argv.index("--")
    compiler, flags = sys.argv[1], sys.argv[2:sep]
    snippets = []
    for arg in sys.argv[sep + 1:]:
        snippets += sorted(glob.glob(os.path.join(arg, "*.cpp"))) if os.path.isdir(arg) else [arg]
    passed = failed = 0
    for path in snippets:
        with open(path, encoding="utf-8") as f:
            expected = [line.split("rejects:", 1)[1].strip() for line in f if line.startswith("// rejects:")]
        run = subprocess.run([compiler, *flags, "-fsyntax-only", path], capture_output=True, text=True)
        output = run.stdout + run.stderr
        name = path.rsplit("/", 1)[-1]
        if not expected:
            ok = run.returncode == 0
            why = "compiles" if ok else "does not compile:\n" + output
        else:
            missing = [e for e in expected if e not in output]
            ok = run.returncode != 0 and not missing
            why = ("rejected: " + "; ".join(expected) if ok else
                   "compiled" if run.returncode == 0 else
                   "rejected, but without '" + "', '".join(missing) + "':\n" + output)
        print(f"{'ok' if ok else 'FAIL'}: {name}: {why}")
        passed += ok
        failed += not ok
    print(f"compile-fail: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
